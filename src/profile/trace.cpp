// The range profile and the allocation timeline as one Chrome trace (profile.h). In libflashlm, not the
// attention core: it needs the JSON library, which the core does without.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>

#include "flashlm/profile.h"

namespace flashlm {

std::string chrome_trace_json(const std::vector<RangeInstance>& ranges, const std::vector<MemoryEvent>& memory,
                              int64_t memory_origin_ns) {
  int64_t first = INT64_MAX;
  for (const auto& r : ranges) first = std::min(first, r.start_ns);
  for (const auto& m : memory) first = std::min(first, memory_origin_ns + static_cast<int64_t>(m.time_ms * 1e6));
  if (first == INT64_MAX) first = 0;
  const auto us = [&](int64_t ns) { return double(ns - first) / 1e3; };
  constexpr int kPid = 1, kHostTid = 1, kGpuTid = 2;
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", kPid}, {"args", {{"name", "flashlm"}}}});
  events.push_back(
      {{"name", "thread_name"}, {"ph", "M"}, {"pid", kPid}, {"tid", kHostTid}, {"args", {{"name", "host"}}}});
  events.push_back(
      {{"name", "thread_name"}, {"ph", "M"}, {"pid", kPid}, {"tid", kGpuTid}, {"args", {{"name", "GPU stream"}}}});
  for (const auto& r : ranges) {
    events.push_back({{"name", r.name}, {"cat", "range"}, {"ph", "X"}, {"pid", kPid},
                      {"tid", r.on_gpu ? kGpuTid : kHostTid}, {"ts", us(r.start_ns)},
                      {"dur", double(r.duration_ns) / 1e3}, {"args", {{"depth", r.depth}}}});
  }
  for (const auto& m : memory) {
    events.push_back({{"name", fmt::format("memory {}", device_name(m.device))}, {"cat", "memory"}, {"ph", "C"},
                      {"pid", kPid}, {"ts", us(memory_origin_ns + static_cast<int64_t>(m.time_ms * 1e6))},
                      {"args", {{"bytes", m.current_bytes}}}});
  }
  nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  return doc.dump() + "\n";
}

}  // namespace flashlm
