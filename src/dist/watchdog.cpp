#include "dist/watchdog.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "core/env.h"
#include "flashlm/dist.h"
#ifdef FLASHLM_WITH_NCCL
#include "dist/nccl.h"
#endif

namespace flashlm::dist {

namespace {

constexpr double kDefaultTimeoutS = 600.0;

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void check_timeout(double seconds, const char* where) {
  FLASHLM_CHECK_ARG(std::isfinite(seconds) && seconds >= 0,
                    "{}: collective timeout {} s, expected a finite number >= 0 (0: no timeout)", where, seconds);
}

double default_timeout_s() {
  return env_number(kDistTimeout).value_or(kDefaultTimeoutS);
}

Watchdog::Watchdog(int rank, double timeout_s) : rank_(rank), timeout_s_(timeout_s), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Watchdog::enter(const char* call) {
  call_.store(call, std::memory_order_relaxed);
  calls_.fetch_add(1, std::memory_order_relaxed);
  since_ns_.store(steady_ns(), std::memory_order_release);
}

#ifdef FLASHLM_WITH_NCCL
void Watchdog::watch(NcclComm* nccl) {
  std::lock_guard lock(mu_);
  nccl_ = nccl;
}
#endif

void Watchdog::run() {
  std::unique_lock lock(mu_);
  while (!wake_.wait_for(lock, kPoll, [this] { return stop_; })) {
    const double timeout = timeout_s_.load(std::memory_order_relaxed);
    if (timeout <= 0) continue;
    const int64_t since = since_ns_.load(std::memory_order_acquire);
    if (since != 0 && double(steady_ns() - since) > timeout * 1e9) {
      end_job(fmt::format("{} (collective call {} of this rank) did not finish within {} s", call_.load(),
                          calls_.load(), timeout));
    }
#ifdef FLASHLM_WITH_NCCL
    if (nccl_) {
      if (const std::string stalled = nccl_->watchdog_poll(timeout); !stalled.empty()) end_job(stalled);
    }
#endif
  }
}

void Watchdog::end_job(const std::string& what) const {
  std::fprintf(stderr,
               "error: rank %d: %s: a rank stalled, died or called other collectives than its peers (the collective "
               "timeout: --collective-timeout-s or $FLASHLM_DIST_TIMEOUT_S); ending the job\n",
               rank_, what.c_str());
  std::fflush(stderr);
  Communicator::abort(1);
}

}  // namespace flashlm::dist
