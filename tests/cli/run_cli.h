// Runs the real `shoestring` executable (SHOESTRING_BINARY, set by CMake) with
// a command line and captures what it prints, for the CLI tests.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace shoestring::testing {

struct CliResult {
  int code;            ///< exit status; -1 if it did not exit normally
  std::string output;  ///< stdout + stderr
};

/// Runs `shoestring ARGS` through the shell (ARGS is pasted as is), with
/// `env` ("NAME=value ...", pasted before the command) added to its
/// environment.
inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  const std::string cmd = env + (env.empty() ? "" : " ") + std::string(SHOESTRING_BINARY) + " " + args + " 2>&1";
  std::FILE* pipe = ::popen(cmd.c_str(), "r");
  CliResult r{-1, ""};
  if (!pipe) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace shoestring::testing
