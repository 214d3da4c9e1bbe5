// libFuzzer target for the safetensors reader and the sharded-checkpoint
// index reader (input layout: fuzz_input.h). Built with -DSHOESTRING_FUZZ=ON
// and clang (scripts/fuzz.sh); ASan + UBSan catch memory errors and undefined
// behaviour. The assertions live in fuzz_input.h, shared with the regression
// test: sizes and names of what was read, the round trip of an accepted file,
// a refusal's message naming the file; a failed one throws std::logic_error,
// and any exception other than shoestring::Error is a finding (libFuzzer
// reports it as a crash).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "fuzz_input.h"
#include "shoestring/core/error.h"

namespace {

/// A private folder for the files of one input, removed at exit.
struct WorkDir {
  std::filesystem::path path;
  WorkDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "shoestring_fuzz_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) std::abort();
    path = tmpl;
  }
  ~WorkDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

const std::filesystem::path& work_dir() {
  static const WorkDir dir;
  return dir.path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    shoestring::fuzz::read_fuzz_input(data, size, work_dir());
  } catch (const shoestring::Error&) {
    // A refused file: the expected outcome for most inputs.
  }
  return 0;
}
