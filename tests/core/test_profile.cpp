// The range profiler's bookkeeping and the allocation timeline (no timing assertions: only counts,
// names, order and consistency).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "flashlm/profile.h"
#include "flashlm/tensor.h"

using namespace flashlm;

TEST(RangeProfiler, CountsNestedRangesAndPrintsTheNvtxSumTable) {
  RangeProfiler& p = RangeProfiler::instance();
  p.reset();
  p.enable(true);
  for (int i = 0; i < 3; ++i) {
    ScopedRange outer("step");
    for (int j = 0; j < 2; ++j) ScopedRange inner("layer");
  }
  p.enable(false);
  { ScopedRange ignored("not recorded"); }
  const auto stats = p.summary();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].name, "step");  // the outer range contains the inner ones: largest total first
  EXPECT_EQ(stats[0].instances, 3);
  EXPECT_EQ(stats[1].name, "layer");
  EXPECT_EQ(stats[1].instances, 6);
  for (const auto& s : stats) {
    EXPECT_LE(s.min_ns, s.med_ns);
    EXPECT_LE(s.med_ns, s.max_ns);
    EXPECT_NEAR(s.avg_ns * double(s.instances), s.total_ns, 1e-6 * s.total_ns + 1);
  }
  const std::string table = p.nvtx_sum_table();
  for (const char* column : {"Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)",
                             "Max (ns)", "StdDev (ns)", "Style", "Range", "PushPop"}) {
    EXPECT_NE(table.find(column), std::string::npos) << column;
  }
  p.reset();
  EXPECT_TRUE(p.summary().empty());
}

// The kernel summary's statistics and its cuda_gpu_kern_sum layout, from samples given directly (CUPTI
// delivers them the same way; it needs a GPU, so the recording itself is exercised by the GPU benchmark).
TEST(KernelProfiler, SummarisesKernelsAsCudaGpuKernSum) {
  KernelProfiler& k = KernelProfiler::instance();
  k.reset();
  for (double ns : {300.0, 100.0, 200.0}) k.add("void gemm_kernel<128>(Params)", ns);
  k.add("rmsnorm_forward_kernel", 1000.0);
  const auto stats = k.summary();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].name, "rmsnorm_forward_kernel");  // largest total first
  EXPECT_EQ(stats[1].name, "void gemm_kernel<128>(Params)");
  EXPECT_EQ(stats[1].instances, 3);
  EXPECT_DOUBLE_EQ(stats[1].total_ns, 600.0);
  EXPECT_DOUBLE_EQ(stats[1].avg_ns, 200.0);
  EXPECT_DOUBLE_EQ(stats[1].med_ns, 200.0);
  EXPECT_DOUBLE_EQ(stats[1].min_ns, 100.0);
  EXPECT_DOUBLE_EQ(stats[1].max_ns, 300.0);
  EXPECT_DOUBLE_EQ(stats[1].stddev_ns, 100.0);  // sample standard deviation, as nsys
  const std::string table = k.kern_sum_table();
  for (const char* column : {"Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)",
                             "Max (ns)", "StdDev (ns)", "Name", "62.5", "37.5"}) {
    EXPECT_NE(table.find(column), std::string::npos) << column << "\n" << table;
  }
  EXPECT_EQ(table.find("Style"), std::string::npos) << "cuda_gpu_kern_sum has no Style column";
  EXPECT_EQ(table.find("dropped"), std::string::npos);
  k.count_dropped(3);  // records CUPTI could not deliver make the table say it is incomplete
  EXPECT_NE(k.kern_sum_table().find("3 kernel records dropped"), std::string::npos);
  k.reset();
  EXPECT_TRUE(k.summary().empty());
  EXPECT_EQ(k.dropped(), 0);
}

TEST(MemoryTimeline, RecordsAllocationsReleasesTagsAndPhases) {
  memory_timeline_start();
  memory_set_phase("forward");
  {
    Tensor a = Tensor::empty({256}, DType::f32, Device::cpu, "activations");
    memory_set_phase("backward");
    Tensor g = Tensor::empty({128}, DType::f64, Device::cpu, "gradients");
  }
  const auto events = memory_timeline_stop();
  std::vector<MemoryEvent> sized;
  for (const auto& e : events) {
    if (e.delta_bytes != 0) sized.push_back(e);
  }
  ASSERT_EQ(sized.size(), 4u);
  EXPECT_EQ(sized[0].tag, "activations");
  EXPECT_EQ(sized[0].phase, "forward");
  EXPECT_EQ(sized[0].delta_bytes, 1024);
  EXPECT_EQ(sized[1].tag, "gradients");
  EXPECT_EQ(sized[1].phase, "backward");
  EXPECT_EQ(sized[1].current_bytes, sized[0].current_bytes + 1024);
  EXPECT_EQ(sized[2].delta_bytes + sized[3].delta_bytes, -2048);  // both released, in reverse order
  EXPECT_EQ(sized[3].current_bytes, sized[0].current_bytes - 1024);
  for (size_t i = 1; i < events.size(); ++i) EXPECT_GE(events[i].time_ms, events[i - 1].time_ms);
  memory_set_phase("");
  // Not recording any more: nothing is logged.
  Tensor after = Tensor::empty({16}, DType::f32);
  EXPECT_TRUE(memory_timeline_stop().empty());
}

// The Chrome trace: recorded ranges become complete events (microseconds, nested within their parents'
// spans on the host track) and the memory timeline a counter per device, all on one clock that starts at 0.
TEST(ChromeTrace, RangesAndMemoryBecomeTraceEvents) {
  RangeProfiler& p = RangeProfiler::instance();
  p.reset();
  const int64_t origin = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  memory_timeline_start();
  p.enable(true);
  for (int i = 0; i < 2; ++i) {
    ScopedRange outer("step");
    Buffer b = Buffer::allocate(4096, Device::cpu, "trace test");
    ScopedRange inner("layer");
  }
  p.enable(false);
  const std::vector<MemoryEvent> memory = memory_timeline_stop();
  const std::vector<RangeInstance>& ranges = p.instances();
  ASSERT_EQ(ranges.size(), 4u);
  ASSERT_GE(memory.size(), 4u);  // two allocations, two releases

  const nlohmann::json doc = nlohmann::json::parse(chrome_trace_json(ranges, memory, origin));
  const auto& events = doc.at("traceEvents");
  std::vector<nlohmann::json> steps, layers, counters;
  for (const auto& e : events) {
    const std::string ph = e.at("ph");
    if (ph == "X" && e.at("name") == "step") steps.push_back(e);
    if (ph == "X" && e.at("name") == "layer") layers.push_back(e);
    if (ph == "C") counters.push_back(e);
  }
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(counters.size(), memory.size());
  double earliest = 1e300;
  for (const auto& e : events) {
    if (e.contains("ts")) earliest = std::min(earliest, e.at("ts").get<double>());
  }
  EXPECT_EQ(earliest, 0.0);
  for (size_t i = 0; i < 2; ++i) {
    const double s0 = steps[i].at("ts"), s1 = s0 + steps[i].at("dur").get<double>();
    const double l0 = layers[i].at("ts"), l1 = l0 + layers[i].at("dur").get<double>();
    EXPECT_LE(s0, l0);  // the layer lies inside its step
    EXPECT_LE(l1, s1 + 1e-3);
    EXPECT_EQ(steps[i].at("tid"), layers[i].at("tid"));
    EXPECT_EQ(steps[i].at("args").at("depth"), 0);
    EXPECT_EQ(layers[i].at("args").at("depth"), 1);
  }
  EXPECT_LE(steps[0].at("ts").get<double>() + steps[0].at("dur").get<double>(), steps[1].at("ts").get<double>());
  // The counter follows the timeline's bytes, in order, on the same clock as the ranges: each allocation
  // lies inside the step that made it.
  for (size_t i = 0; i < counters.size(); ++i) {
    EXPECT_EQ(counters[i].at("name"), "memory cpu");
    EXPECT_EQ(counters[i].at("args").at("bytes").get<int64_t>(), memory[i].current_bytes);
    if (i > 0) {
      EXPECT_GE(counters[i].at("ts").get<double>(), counters[i - 1].at("ts").get<double>());
    }
  }
  for (const auto& c : counters) {
    const double t = c.at("ts");
    const bool inside = std::any_of(steps.begin(), steps.end(), [&](const nlohmann::json& s) {
      const double s0 = s.at("ts"), s1 = s0 + s.at("dur").get<double>();
      return t >= s0 - 50 && t <= s1 + 50;  // 50 us: the two clocks' origins differ by one call
    });
    EXPECT_TRUE(inside) << t;
  }
  p.reset();
  EXPECT_TRUE(p.instances().empty());
}
