// The collective timeout of a job of several ranks (Communicator's failure model, include/flashlm/dist.h).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace flashlm::dist {

#ifdef FLASHLM_WITH_NCCL
class NcclComm;
#endif

// A timeout in seconds: finite and >= 0 (0: none), else an InvalidArgument naming `where`.
void check_timeout(double seconds, const char* where);
// $FLASHLM_DIST_TIMEOUT_S (seconds in [0, a week], 0: off; core/env.h) when set, else the default.
double default_timeout_s();

// A thread of its own that polls (every kPoll) whether the blocking MPI call in progress, if any, has run
// past the timeout, and asks the NCCL communicator, once there is one, whether its queued collectives have.
// Either ends the job: a rank stuck in a collective cannot throw, and its peers are stuck too. The calls it
// watches are marked with enter()/leave() by the thread that makes them (cheap: two atomic stores).
class Watchdog {
 public:
  static constexpr std::chrono::milliseconds kPoll{100};

  Watchdog(int rank, double timeout_s);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }

  // `call` names the MPI function (a string literal).
  void enter(const char* call);
  void leave() { since_ns_.store(0, std::memory_order_release); }

#ifdef FLASHLM_WITH_NCCL
  // The NCCL communicator to poll from now on (it outlives the watchdog: Communicator::Impl stops the
  // watchdog before destroying it).
  void watch(NcclComm* nccl);
#endif

 private:
  void run();
  [[noreturn]] void end_job(const std::string& what) const;

  const int rank_;
  std::atomic<double> timeout_s_;
  std::atomic<const char*> call_{""};
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> since_ns_{0};  // when the call in progress began; 0: none
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
#ifdef FLASHLM_WITH_NCCL
  NcclComm* nccl_ = nullptr;
#endif
  std::thread thread_;  // last: starts once everything above is initialised
};

// A blocking call in progress, for the watchdog (if any) from construction to destruction.
class Watched {
 public:
  Watched(Watchdog* watchdog, const char* call) : watchdog_(watchdog) {
    if (watchdog_) watchdog_->enter(call);
  }
  ~Watched() {
    if (watchdog_) watchdog_->leave();
  }
  Watched(const Watched&) = delete;
  Watched& operator=(const Watched&) = delete;

 private:
  Watchdog* watchdog_;
};

}  // namespace flashlm::dist
