// Shared GoogleTest entry point: fixes libtorch's thread count so tests are
// repeatable and do not oversubscribe the 2-core CI machine.
#include <gtest/gtest.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // One intra-op thread per test process: ctest runs two processes at once
  // on the 2-core CI machine, and OpenMP barriers degrade badly when
  // oversubscribed. Tests that need more threads set them themselves.
  torch::set_num_threads(1);
  return RUN_ALL_TESTS();
}
