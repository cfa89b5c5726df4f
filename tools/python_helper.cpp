#include "python_helper.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <fmt/format.h>

#include "flashlm/device.h"
#include "flashlm/error.h"

extern char** environ;

namespace {

// A pipe whose ends close with it.
struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() {
    if (::pipe2(fd, O_CLOEXEC) != 0) throw flashlm::Error(fmt::format("prepare_data.py: pipe: {}", std::strerror(errno)));
  }
  ~Pipe() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  void close_end(int i) {
    ::close(fd[i]);
    fd[i] = -1;
  }
};

// What a helper may print before it is cut off: its token ids for the longest prompt fit many times over.
constexpr size_t kMaxOutputBytes = size_t{64} << 20;

}  // namespace

std::string run_prepare_data_script(const std::vector<std::string>& args, double timeout_s) {
  // Bounded: the deadline below is steady_clock's integer nanoseconds, which a huge value overflows.
  if (const char* t = std::getenv("FLASHLM_PREPARE_DATA_TIMEOUT"); t && *t) {
    const std::string_view text = t;
    double v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v) || v <= 0 ||
        v > flashlm::kMaxTimeoutSeconds) {
      throw flashlm::InvalidArgument(
          fmt::format("FLASHLM_PREPARE_DATA_TIMEOUT: '{}' is not a number of seconds in (0, {}]", t,
                      flashlm::kMaxTimeoutSeconds));
    }
    timeout_s = v;
  }
  const char* python_env = std::getenv("FLASHLM_PYTHON");
  const std::string python = python_env && *python_env ? python_env : "python3";
  const char* script_env = std::getenv("FLASHLM_PREPARE_DATA_SCRIPT");
  const std::string script = script_env && *script_env ? script_env : FLASHLM_PREPARE_DATA_SCRIPT;
  std::vector<std::string> argv_storage = {python, script};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  Pipe out, err;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out.fd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err.fd[1], STDERR_FILENO);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    throw flashlm::Error(fmt::format("cannot run '{}' (set FLASHLM_PYTHON to a python with the tokenizers package, "
                                     "e.g. export FLASHLM_PYTHON=$(scripts/setup-tokenizers.sh)): {}",
                                     python, std::strerror(spawned)));
  }
  out.close_end(1);
  err.close_end(1);
  // Both pipes are drained together, so a child that fills one while we wait on the other cannot stall.
  std::array<std::string, 2> text;
  std::array<pollfd, 2> fds = {pollfd{out.fd[0], POLLIN, 0}, pollfd{err.fd[0], POLLIN, 0}};
  char buf[65536];
  bool too_much = false, timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left.count() + 1, 60'000))) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0 && text[i].size() + static_cast<size_t>(n) <= kMaxOutputBytes) {
        text[i].append(buf, static_cast<size_t>(n));
      } else if (n > 0) {
        too_much = true;
      } else if (n == 0 || errno != EINTR) {
        fds[i].fd = -1;  // end of file or a read error: stop watching (the Pipe closes it)
      }
    }
  }
  // A child may close both pipes and go on running: the deadline holds for its exit too.
  int status = 0;
  for (;;) {
    const pid_t got = ::waitpid(pid, &status, timed_out ? 0 : WNOHANG);
    if (got == pid || (got < 0 && errno != EINTR)) break;
    if (got == 0 && std::chrono::steady_clock::now() >= deadline) {
      timed_out = true;
      ::kill(pid, SIGKILL);
    } else if (got == 0) {
      ::usleep(10'000);
    }
  }
  if (timed_out) {
    throw flashlm::Error(fmt::format("{} {} did not finish within {} s and was stopped (set FLASHLM_PREPARE_DATA_TIMEOUT "
                                     "to the seconds it may take)",
                                     python, script, timeout_s));
  }
  std::string message = text[1];
  while (!message.empty() && (message.back() == '\n' || message.back() == '\r')) message.pop_back();
  if (message.starts_with("error: ")) message.erase(0, 7);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127 && message.empty()) message = "the interpreter was not found";
    throw flashlm::Error(fmt::format("{} (from {} {})", message.empty() ? "failed with no message" : message, python,
                                     script));
  }
  if (too_much) throw flashlm::Error(fmt::format("{} printed more than {} bytes", script, kMaxOutputBytes));
  return text[0];
}
