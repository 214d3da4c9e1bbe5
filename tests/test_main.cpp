// Shared GoogleTest entry point: fixes libtorch's thread count so tests are
// repeatable and do not oversubscribe the 2-core CI machine.
#include <gtest/gtest.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  torch::set_num_threads(2);
  return RUN_ALL_TESTS();
}
