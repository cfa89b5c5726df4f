#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/check.h"
#include "flashlm/profile.h"

#ifdef FLASHLM_WITH_NVTX
#include <nvtx3/nvToolsExt.h>
#endif
#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace flashlm {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

RangeProfiler& RangeProfiler::instance() {
  static RangeProfiler profiler;
  return profiler;
}

void RangeProfiler::enable(bool on) {
  if (!on) read_pending();
  enabled_ = on;
  on_gpu_ = false;
}

void RangeProfiler::enable(bool on, void* cuda_stream) {
#ifdef FLASHLM_WITH_CUDA
  if (!on) read_pending();
  enabled_ = on;
  on_gpu_ = on;
  stream_ = cuda_stream;
  if (on) {
    // The origin: recorded once the stream is idle and waited for, so that its GPU time is the host's now.
    if (origin_event_ == nullptr) origin_event_ = take_event();
    auto stream = static_cast<cudaStream_t>(stream_);
    FLASHLM_CUDA_CHECK(cudaStreamSynchronize(stream), "cudaStreamSynchronize (range profiler)");
    FLASHLM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(origin_event_), stream),
                       "cudaEventRecord (range profiler)");
    FLASHLM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(origin_event_)),
                       "cudaEventSynchronize (range profiler)");
    origin_ns_ = now_ns();
  }
#else
  (void)cuda_stream;
  FLASHLM_CHECK(!on, "RangeProfiler: GPU timing needs a CUDA build");
  enable(false);
#endif
}

void RangeProfiler::reset() {
  read_pending();
  open_.clear();
  samples_.clear();
  instances_.clear();
  dropped_instances_ = 0;
}

void* RangeProfiler::take_event() {
#ifdef FLASHLM_WITH_CUDA
  if (!free_events_.empty()) {
    void* e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  FLASHLM_CUDA_CHECK(cudaEventCreate(&e), "cudaEventCreate (range profiler)");
  return e;
#else
  return nullptr;
#endif
}

void RangeProfiler::push(std::string_view name) {
#ifdef FLASHLM_WITH_NVTX
  nvtxRangePushA(std::string(name).c_str());
#endif
  if (!enabled_) return;
  void* start_event = nullptr;
#ifdef FLASHLM_WITH_CUDA
  if (on_gpu_) {
    start_event = take_event();
    FLASHLM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_event), static_cast<cudaStream_t>(stream_)),
                       "cudaEventRecord (range profiler)");
  }
#endif
  open_.push_back({std::string(name), now_ns(), start_event});
}

void RangeProfiler::pop() {
#ifdef FLASHLM_WITH_NVTX
  nvtxRangePop();
#endif
  if (!enabled_ || open_.empty()) return;
  Open o = std::move(open_.back());
  open_.pop_back();
#ifdef FLASHLM_WITH_CUDA
  if (o.start_event != nullptr) {
    void* end_event = take_event();
    FLASHLM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(end_event), static_cast<cudaStream_t>(stream_)),
                       "cudaEventRecord (range profiler)");
    pending_.push_back({std::move(o.name), o.start_event, end_event, static_cast<int>(open_.size())});
    if (pending_.size() >= 4096) read_pending();  // bounded: events are reused once read
    return;
  }
#endif
  const int64_t end = now_ns();
  add_sample(o.name, double(end - o.start_ns));
  add_instance({std::move(o.name), o.start_ns, end - o.start_ns, static_cast<int>(open_.size()), false});
}

void RangeProfiler::read_pending() {
#ifdef FLASHLM_WITH_CUDA
  for (Pending& p : pending_) {
    auto start = static_cast<cudaEvent_t>(p.start_event), end = static_cast<cudaEvent_t>(p.end_event);
    FLASHLM_CUDA_CHECK(cudaEventSynchronize(end), "cudaEventSynchronize (range profiler)");
    float ms = 0;
    FLASHLM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end), "cudaEventElapsedTime (range profiler)");
    add_sample(p.name, double(ms) * 1e6);
    float since_origin_ms = 0;
    FLASHLM_CUDA_CHECK(cudaEventElapsedTime(&since_origin_ms, static_cast<cudaEvent_t>(origin_event_), start),
                       "cudaEventElapsedTime (range profiler)");
    add_instance({std::move(p.name), origin_ns_ + static_cast<int64_t>(double(since_origin_ms) * 1e6),
                  static_cast<int64_t>(double(ms) * 1e6), p.depth, true});
    free_events_.push_back(p.start_event);
    free_events_.push_back(p.end_event);
  }
#endif
  pending_.clear();
}

void RangeProfiler::add_sample(const std::string& name, double ns) {
  auto it = std::find_if(samples_.begin(), samples_.end(), [&](const auto& s) { return s.first == name; });
  if (it == samples_.end()) {
    samples_.emplace_back(name, std::vector<double>{});
    it = samples_.end() - 1;
  }
  it->second.push_back(ns);
}

void RangeProfiler::add_instance(RangeInstance instance) {
  if (instances_.size() < kMaxInstances) {
    instances_.push_back(std::move(instance));
  } else {
    ++dropped_instances_;
  }
}

const std::vector<RangeInstance>& RangeProfiler::instances() {
  read_pending();
  return instances_;
}

std::vector<RangeStats> summarize_samples(const std::vector<std::pair<std::string, std::vector<double>>>& samples) {
  std::vector<RangeStats> out;
  for (const auto& [name, v] : samples) {
    if (v.empty()) continue;
    RangeStats s;
    s.name = name;
    s.instances = int64_t(v.size());
    std::vector<double> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    for (double x : v) s.total_ns += x;
    s.avg_ns = s.total_ns / double(v.size());
    const size_t n = sorted.size();
    s.med_ns = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    s.min_ns = sorted.front();
    s.max_ns = sorted.back();
    double var = 0;
    for (double x : v) var += (x - s.avg_ns) * (x - s.avg_ns);
    s.stddev_ns = n > 1 ? std::sqrt(var / double(n - 1)) : 0.0;  // sample standard deviation, as nsys
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const RangeStats& a, const RangeStats& b) { return a.total_ns > b.total_ns; });
  return out;
}

std::string format_stats_table(const std::vector<RangeStats>& stats, std::string_view style,
                               std::string_view name_header) {
  double all = 0;
  for (const auto& s : stats) all += s.total_ns;
  const std::string style_head = style.empty() ? "" : fmt::format("  {:>7}", "Style");
  const std::string style_rule = style.empty() ? "" : fmt::format("  {:->7}", "");
  const std::string style_cell = style.empty() ? "" : fmt::format("  {:>7}", style);
  std::string out = fmt::format(" {:>8}  {:>15}  {:>9}  {:>15}  {:>15}  {:>13}  {:>13}  {:>13}{}  {}\n", "Time (%)",
                                "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)",
                                "StdDev (ns)", style_head, name_header);
  out += fmt::format(" {:->8}  {:->15}  {:->9}  {:->15}  {:->15}  {:->13}  {:->13}  {:->13}{}  {:->20}\n", "", "", "",
                     "", "", "", "", "", style_rule, "");
  for (const auto& s : stats) {
    out += fmt::format(" {:>8.1f}  {:>15.0f}  {:>9}  {:>15.1f}  {:>15.1f}  {:>13.0f}  {:>13.0f}  {:>13.1f}{}  {}\n",
                       all > 0 ? 100.0 * s.total_ns / all : 0.0, s.total_ns, s.instances, s.avg_ns, s.med_ns,
                       s.min_ns, s.max_ns, s.stddev_ns, style_cell, s.name);
  }
  return out;
}

std::vector<RangeStats> RangeProfiler::summary() {
  read_pending();
  return summarize_samples(samples_);
}

std::string RangeProfiler::nvtx_sum_table() { return format_stats_table(summary(), "PushPop", "Range"); }

ScopedRange::ScopedRange(std::string_view name) { RangeProfiler::instance().push(name); }
ScopedRange::~ScopedRange() { RangeProfiler::instance().pop(); }

}  // namespace flashlm
