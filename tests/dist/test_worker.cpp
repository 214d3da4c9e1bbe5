// The entry point of the worker processes that tests/dist start (see
// dist_testing.h); skipped when this binary runs as the test suite itself.
#include <sys/socket.h>
#include <netinet/in.h>

#include "dist_testing.h"

namespace shoestring::testing {

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

}  // namespace shoestring::testing

TEST(DistWorker, Main) {
  const std::string scenario = shoestring::testing::worker_env("SHOESTRING_DIST_WORKER");
  if (scenario.empty()) GTEST_SKIP() << "a worker of the multi-process tests; runs only as their child";
  auto& scenarios = shoestring::testing::dist_scenarios();
  auto it = scenarios.find(scenario);
  ASSERT_NE(it, scenarios.end()) << "unknown scenario " << scenario;
  it->second();
}
