// Communicator's collectives, run by CTest three ways: without mpirun (a world of one) and under
// `mpirun -np 2` and `-np 4`, with the main of mpi_test_main.cpp (see mpi_testing.h). Every rank runs every
// test; the data depend on the rank, so that each rank can check what it received from the others.
//
// FLASHLM_TEST_WORLD_SIZE (set by CTest) is the world size the launch should give.
// FLASHLM_TEST_FAIL_ON_RANK=R makes InjectedFailure fail on rank R only (tests/dist/failing_rank.cmake).
// FLASHLM_TEST_STALL_RANK=R makes rank R of StalledRank sleep while its peers wait for it in an all-reduce
// (tests/dist/stalled_rank.cmake).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "flashlm/bench.h"
#include "flashlm/device.h"
#include "flashlm/dist.h"
#include "flashlm/error.h"
#include "flashlm/tensor.h"
#include "dist/mpi_testing.h"

#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#endif

using namespace flashlm;

namespace {

Communicator& comm() { return test_world(); }

int env_or(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// ---------------------------------------------------------------------------------------------------
// The world.

TEST(Communicator, WorldHasTheLaunchedSize) {
  const int n = comm().world_size();
  EXPECT_EQ(n, env_or("FLASHLM_TEST_WORLD_SIZE", n));
  if (const char* ompi = std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_EQ(n, std::atoi(ompi));
  } else if (!std::getenv("SLURM_PROCID")) {
    EXPECT_EQ(n, 1) << "no launcher";
  }
  EXPECT_GE(comm().rank(), 0);
  EXPECT_LT(comm().rank(), n);
  EXPECT_EQ(comm().is_root(), comm().rank() == 0);
  EXPECT_GE(comm().local_size(), 1);
  EXPECT_LE(comm().local_size(), n);
  EXPECT_GE(comm().local_rank(), 0);
  EXPECT_LT(comm().local_rank(), comm().local_size());
  if (const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
    EXPECT_EQ(comm().local_rank(), std::atoi(lr));
  }
  EXPECT_EQ(comm().agree(n, "the world size"), n);
  EXPECT_TRUE(Communicator::mpi_started());
}

TEST(Communicator, LocalRanksAreDistinct) {
  // One node in CI: the local ranks are a permutation of 0..local_size-1.
  std::vector<double> seen(static_cast<size_t>(comm().world_size()), 0.0);
  std::vector<double> mine{static_cast<double>(comm().local_rank())};
  comm().all_gather(std::span<double>(mine), std::span<double>(seen));
  std::vector<int> count(static_cast<size_t>(comm().local_size()), 0);
  for (double r : seen) {
    ASSERT_GE(r, 0);
    ASSERT_LT(r, comm().local_size());
    ++count[static_cast<size_t>(r)];
  }
  if (comm().local_size() == comm().world_size()) {
    for (int c : count) EXPECT_EQ(c, 1);
  }
}

TEST(Communicator, SecondCommunicatorIsIndependent) {
  Communicator other;
  EXPECT_EQ(other.rank(), comm().rank());
  EXPECT_EQ(other.world_size(), comm().world_size());
  std::vector<float> x{1.0f};
  other.all_reduce(std::span<float>(x));
  EXPECT_EQ(x[0], static_cast<float>(comm().world_size()));
}

// The NCCL CTA limit is kept for setup_cuda(); a negative one is refused.
TEST(Communicator, NcclMaxCtasIsChecked) {
  Communicator other;
  EXPECT_EQ(other.nccl_max_ctas(), 0);  // NCCL's choice
  other.set_nccl_max_ctas(4);
  EXPECT_EQ(other.nccl_max_ctas(), 4);
  EXPECT_THROW(other.set_nccl_max_ctas(-1), Error);
}

// ---------------------------------------------------------------------------------------------------
// CPU collectives (MPI).

template <class T>
class CpuCollectives : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CpuCollectives, FloatTypes);

TYPED_TEST(CpuCollectives, AllReduceSumAndAverage) {
  using T = TypeParam;
  const int n = comm().world_size(), r = comm().rank();
  const size_t count = 1001;
  auto fill = [&](std::vector<T>& x) {
    for (size_t i = 0; i < count; ++i) x[i] = static_cast<T>(r + 1) + static_cast<T>(0.5) * static_cast<T>(i % 64);
  };
  std::vector<T> x(count);
  fill(x);
  comm().all_reduce(std::span<T>(x), ReduceOp::sum);
  for (size_t i = 0; i < count; ++i) {
    // sum over ranks of (rank + 1 + i/2) = n(n+1)/2 + n·i/2: exact in fp32 for these sizes.
    const T want = static_cast<T>(n * (n + 1) / 2) + static_cast<T>(n) * static_cast<T>(0.5) * static_cast<T>(i % 64);
    if (x[i] != want) {
      ADD_FAILURE() << "sum: x[" << i << "] = " << x[i] << ", expected " << want;
      break;
    }
  }
  fill(x);
  comm().all_reduce(std::span<T>(x), ReduceOp::avg);
  for (size_t i = 0; i < count; ++i) {
    const double want = (n + 1) / 2.0 + 0.5 * static_cast<double>(i % 64);
    if (std::abs(static_cast<double>(x[i]) - want) > 1e-6 * want) {
      ADD_FAILURE() << "avg: x[" << i << "] = " << x[i] << ", expected " << want;
      break;
    }
  }
}

TYPED_TEST(CpuCollectives, AllReduceMaxAndMin) {
  using T = TypeParam;
  const int n = comm().world_size(), r = comm().rank();
  std::vector<T> hi{static_cast<T>(r), static_cast<T>(-r)}, lo = hi;
  comm().all_reduce(std::span<T>(hi), ReduceOp::max);
  comm().all_reduce(std::span<T>(lo), ReduceOp::min);
  EXPECT_EQ(hi[0], static_cast<T>(n - 1));
  EXPECT_EQ(hi[1], static_cast<T>(0));
  EXPECT_EQ(lo[0], static_cast<T>(0));
  EXPECT_EQ(lo[1], static_cast<T>(-(n - 1)));
}

TYPED_TEST(CpuCollectives, BroadcastFromFirstAndLastRank) {
  using T = TypeParam;
  const int n = comm().world_size(), r = comm().rank();
  for (int root : {0, n - 1}) {
    std::vector<T> x(37);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<T>(100 * r + static_cast<int>(i));
    comm().broadcast(std::span<T>(x), root);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(x[i], static_cast<T>(100 * root + static_cast<int>(i))) << i;
  }
}

TYPED_TEST(CpuCollectives, AllGather) {
  using T = TypeParam;
  const int n = comm().world_size(), r = comm().rank();
  const size_t chunk = 7;
  std::vector<T> in(chunk), out(chunk * n, static_cast<T>(-1));
  for (size_t j = 0; j < chunk; ++j) in[j] = static_cast<T>(100 * r + static_cast<int>(j));
  comm().all_gather(std::span<T>(in), std::span<T>(out));
  for (int q = 0; q < n; ++q)
    for (size_t j = 0; j < chunk; ++j) EXPECT_EQ(out[q * chunk + j], static_cast<T>(100 * q + static_cast<int>(j)));

  // In place: this rank's input is its own chunk of the output.
  std::vector<T> buf(chunk * n, static_cast<T>(-1));
  for (size_t j = 0; j < chunk; ++j) buf[r * chunk + j] = static_cast<T>(100 * r + static_cast<int>(j));
  comm().all_gather(std::span<T>(buf.data() + r * chunk, chunk), std::span<T>(buf));
  EXPECT_EQ(buf, out);
}

TYPED_TEST(CpuCollectives, ReduceScatter) {
  using T = TypeParam;
  const int n = comm().world_size(), r = comm().rank();
  const size_t chunk = 5;
  auto input = [&] {
    std::vector<T> in(chunk * n);
    for (size_t k = 0; k < in.size(); ++k) in[k] = static_cast<T>(r + static_cast<int>(k));
    return in;
  };
  // Rank r's chunk: sum over ranks q of (q + r·chunk + j) = n(n-1)/2 + n·(r·chunk + j).
  auto want = [&](size_t j) { return static_cast<T>(n * (n - 1) / 2 + n * static_cast<int>(r * chunk + j)); };
  std::vector<T> in = input(), out(chunk, static_cast<T>(-1));
  comm().reduce_scatter(std::span<T>(in), std::span<T>(out), ReduceOp::sum);
  for (size_t j = 0; j < chunk; ++j) EXPECT_EQ(out[j], want(j)) << j;

  in = input();
  comm().reduce_scatter(std::span<T>(in), std::span<T>(out), ReduceOp::avg);
  for (size_t j = 0; j < chunk; ++j) EXPECT_NEAR(out[j], want(j) / static_cast<T>(n), 1e-5) << j;

  // In place: the output is this rank's chunk of the input.
  in = input();
  comm().reduce_scatter(std::span<T>(in), std::span<T>(in.data() + r * chunk, chunk), ReduceOp::sum);
  for (size_t j = 0; j < chunk; ++j) EXPECT_EQ(in[r * chunk + j], want(j)) << j;
}

// Non-blocking all-reduces complete in any order of waits, with avg's division, and overlap each other.
TEST(CpuCollectivesViews, AsyncAllReduce) {
  const int n = comm().world_size(), r = comm().rank();
  std::vector<float> a(100, float(r + 1)), b(7, float(2 * r));
  CommRequest ra = comm().all_reduce_async(TensorView::contiguous(a.data(), DType::f32, {100}), ReduceOp::sum);
  CommRequest rb = comm().all_reduce_async(TensorView::contiguous(b.data(), DType::f32, {7}), ReduceOp::avg);
  EXPECT_TRUE(ra.pending());
  comm().test(ra);  // progresses; done or not
  comm().wait(rb);
  comm().wait(ra);
  EXPECT_FALSE(ra.pending());
  for (float x : a) EXPECT_EQ(x, float(n * (n + 1) / 2));
  for (float x : b) EXPECT_FLOAT_EQ(x, float(n - 1));  // the mean of 0, 2, ..., 2(n-1)
  CommRequest empty;
  comm().wait(empty);
  EXPECT_TRUE(comm().test(empty));
}

// Chunks of different sizes (an empty one too) gathered in place.
TEST(CpuCollectivesViews, AllGatherV) {
  const int n = comm().world_size(), r = comm().rank();
  std::vector<int64_t> counts;
  for (int q = 0; q < n; ++q) counts.push_back(q == 1 ? 0 : q + 2);
  std::vector<double> x;
  for (int q = 0; q < n; ++q) {
    for (int64_t k = 0; k < counts[size_t(q)]; ++k) x.push_back(q == r ? 100.0 * q + double(k) : -1.0);
  }
  comm().all_gather_v(TensorView::contiguous(x.data(), DType::f64, {int64_t(x.size())}), counts);
  size_t at = 0;
  for (int q = 0; q < n; ++q) {
    for (int64_t k = 0; k < counts[size_t(q)]; ++k, ++at) EXPECT_EQ(x[at], 100.0 * q + double(k)) << q << " " << k;
  }
  std::vector<int64_t> wrong(counts);
  wrong[0] += 1;
  EXPECT_THROW(comm().all_gather_v(TensorView::contiguous(x.data(), DType::f64, {int64_t(x.size())}), wrong), Error);
  EXPECT_THROW(comm().all_gather_v(TensorView::contiguous(x.data(), DType::f64, {int64_t(x.size())}),
                                   std::span<const int64_t>(counts.data(), counts.size() - 1)),
               Error);
}

// all_gather_segments' case, the same on the CPU and on GPUs: three segments (one of 0 elements per rank)
// with gaps between them. x: this rank's chunks filled, the others' -1, the gaps -7 (never touched).
struct SegmentsCase {
  std::vector<Communicator::Segment> segments;
  std::vector<float> x;
  static float value(size_t segment, int rank, int64_t k) { return float(100 * segment + 10 * rank + k); }

  SegmentsCase(int n, int r) {
    segments = {{3, 2}, {3 + 2 * n + 1, 0}, {3 + 2 * n + 4, 5}};
    x.assign(size_t(3 + 2 * n + 4 + 5 * n + 2), -7.0f);
    for (size_t s = 0; s < segments.size(); ++s) {
      for (int q = 0; q < n; ++q) {
        for (int64_t k = 0; k < segments[s].part; ++k) {
          x[size_t(segments[s].offset + q * segments[s].part + k)] = q == r ? value(s, q, k) : -1.0f;
        }
      }
    }
  }

  void check(const std::vector<float>& got, int n) const {
    std::vector<float> want(got.size(), -7.0f);
    for (size_t s = 0; s < segments.size(); ++s) {
      for (int q = 0; q < n; ++q) {
        for (int64_t k = 0; k < segments[s].part; ++k) {
          want[size_t(segments[s].offset + q * segments[s].part + k)] = value(s, q, k);
        }
      }
    }
    EXPECT_EQ(got, want);
  }
};

TEST(CpuCollectivesViews, AllGatherSegments) {
  const int n = comm().world_size(), r = comm().rank();
  SegmentsCase c(n, r);
  const TensorView x = TensorView::contiguous(c.x.data(), DType::f32, {int64_t(c.x.size())});
  comm().all_gather_segments(x, c.segments);
  c.check(c.x, n);
  const std::vector<Communicator::Segment> overlapping = {{0, 2}, {1, 1}};
  EXPECT_THROW(comm().all_gather_segments(x, overlapping), Error);
  const std::vector<Communicator::Segment> past_the_end = {{int64_t(c.x.size()) - 1, 2}};
  EXPECT_THROW(comm().all_gather_segments(x, past_the_end), Error);
}

TEST(CpuCollectivesViews, TensorViewsAndEmptyBuffers) {
  const int n = comm().world_size();
  Tensor t = Tensor::empty({3, 4}, DType::f32, Device::cpu, "test");
  fill_value(t, 2.0);
  comm().all_reduce(t, ReduceOp::sum);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(t.view().ptr<float>()[i], 2.0f * n);
  std::vector<float> none;
  comm().all_reduce(std::span<float>(none));  // zero elements: a valid no-op collective
  comm().barrier();
}

// Argument errors are found before any communication, identically on every rank.
TEST(CpuCollectivesViews, BadArgumentsThrowNamingTheProblem) {
  const int n = comm().world_size();
  std::vector<uint16_t> half(8);
  const TensorView bf16 = TensorView::contiguous(half.data(), DType::bf16, {8});
  try {
    comm().all_reduce(bf16);
    ADD_FAILURE() << "no error for a bf16 CPU view";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype bf16 is not supported for CPU views"), std::string::npos) << e.what();
  }
  std::vector<float> a(6), b(6 * n + 1);
  EXPECT_THROW(comm().all_gather(std::span<float>(a), std::span<float>(b)), Error);
  EXPECT_THROW(comm().reduce_scatter(std::span<float>(b), std::span<float>(a)), Error);
  EXPECT_THROW(comm().broadcast(std::span<float>(a), n), Error);
  EXPECT_THROW(comm().broadcast(std::span<float>(a), -1), Error);
  // Not contiguous: every other element.
  const TensorView strided = TensorView::contiguous(a.data(), DType::f32, {3, 2}).slice(1, 0, 1);
  try {
    comm().all_reduce(strided);
    ADD_FAILURE() << "no error for a strided view";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("contiguous"), std::string::npos) << e.what();
  }
  // Overlapping in and out that are not the in-place form.
  std::vector<float> c(4 * n + 4);
  if (n > 1) {
    EXPECT_THROW(comm().all_gather(std::span<float>(c.data() + 1, 4), std::span<float>(c.data(), 4 * n)), Error);
  }
  std::vector<double> mixed(6 * n);
  EXPECT_THROW(comm().all_gather(TensorView::contiguous(a.data(), DType::f32, {6}),
                                 TensorView::contiguous(mixed.data(), DType::f64, {6 * n})),
               Error);
}

#ifndef FLASHLM_WITH_CUDA
TEST(CpuCollectivesViews, CudaViewWithoutCudaIsAnError) {
  std::vector<float> a(4);
  TensorView v = TensorView::contiguous(a.data(), DType::f32, {4});
  v.device = Device::cuda;
  try {
    comm().all_reduce(v);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without NCCL"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm().setup_cuda(), Error);
}
#endif

// ---------------------------------------------------------------------------------------------------
// agree() and first_error().

TEST(Agree, SameValueIsReturned) { EXPECT_EQ(comm().agree(123456789012345, "a big number"), 123456789012345); }

TEST(Agree, DifferentValuesNameTheRanks) {
  const int n = comm().world_size(), r = comm().rank();
  if (n == 1) {
    EXPECT_EQ(comm().agree(r, "the batch size"), 0);
    return;
  }
  try {
    comm().agree(r == 0 ? 8 : 16, "the batch size");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "ranks disagree on the batch size: rank 0 has 8, rank 1 has 16");
  }
  // Only the last rank differs: that rank is named.
  try {
    comm().agree(r == n - 1 ? -1 : 7, "the step");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "ranks disagree on the step: rank 0 has 7, rank " + std::to_string(n - 1) + " has -1");
  }
}

// agree_settings(): every rank throws the same SettingsMismatch naming the lowest rank that differs and
// every setting in which it differs.
std::vector<RunSetting> settings_of(int64_t steps, double lr, const std::string& ddp) {
  return {{"steps", std::to_string(steps)}, {"optimizer.lr_max", fmt::format("{}", lr)}, {"ddp.variant", ddp}};
}

std::string mismatch_of(const std::vector<RunSetting>& mine) {
  try {
    comm().agree_settings(mine);
  } catch (const SettingsMismatch& e) {
    return e.what();
  }
  return "";
}

TEST(AgreeSettings, EqualSettingsPass) {
  EXPECT_NO_THROW(comm().agree_settings(settings_of(10, 3e-3, "bucketed")));
  EXPECT_NO_THROW(comm().agree_settings(std::vector<RunSetting>{}));
}

TEST(AgreeSettings, TheLowestDifferingRankAndEverySettingAreNamed) {
  const int n = comm().world_size(), r = comm().rank();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  // Ranks 1.. differ from rank 0 in two settings; rank 1 is named.
  EXPECT_EQ(mismatch_of(r == 0 ? settings_of(10, 3e-3, "flat") : settings_of(10 + r, 1e-3, "flat")),
            "rank 1's run configuration differs from rank 0's in steps (rank 0: 10, rank 1: 11), optimizer.lr_max "
            "(rank 0: 0.003, rank 1: 0.001)");
  // Only the last rank differs, in the last setting.
  const std::string last = std::to_string(n - 1);
  EXPECT_EQ(mismatch_of(settings_of(5, 0.5, r == n - 1 ? "async" : "flat")),
            "rank " + last + "'s run configuration differs from rank 0's in ddp.variant (rank 0: flat, rank " + last +
                ": async)");
  // A value that differs in its last bit.
  const double lr = r == 0 ? 0.1 : std::nextafter(0.1, 1.0);
  EXPECT_NE(mismatch_of(settings_of(5, lr, "flat")).find("optimizer.lr_max (rank 0: 0.1, rank 1: 0.10000000000000002)"),
            std::string::npos);
}

TEST(AgreeSettings, DifferentListsAreNamed) {
  const int n = comm().world_size(), r = comm().rank();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  std::vector<RunSetting> mine = settings_of(10, 3e-3, "flat");
  if (r > 0) mine.push_back({"zero1", "true"});
  EXPECT_EQ(mismatch_of(mine),
            "rank 1's run configuration differs from rank 0's in the number of settings (rank 0: 3, rank 1: 4)");
  mine = settings_of(10, 3e-3, "flat");
  if (r > 0) mine[1].name = "optimizer.lr_min";
  EXPECT_EQ(mismatch_of(mine), "rank 1's run configuration differs from rank 0's in the list of settings (setting 2 "
                               "is optimizer.lr_max on rank 0, optimizer.lr_min on rank 1)");
  // Settings are not confused by where one ends and the next begins.
  EXPECT_NE(mismatch_of({{"a", r == 0 ? "bc" : "b"}, {r == 0 ? "d" : "cd", "e"}}), "");
}

// ---------------------------------------------------------------------------------------------------
// The collective timeout.

TEST(CollectiveTimeout, IsValidated) {
  const double before = comm().timeout();
  EXPECT_GT(before, 0);  // 600 s unless FLASHLM_DIST_TIMEOUT_S says otherwise
  for (double bad : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    try {
      comm().set_timeout(bad);
      ADD_FAILURE() << "timeout " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expected a finite number >= 0 (0: no timeout)"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(comm().timeout(), before);
  comm().set_timeout(0);
  EXPECT_EQ(comm().timeout(), 0);
  comm().set_timeout(before);
}

TEST(CollectiveTimeout, AWaitWithinTheTimeoutPasses) {
  const double before = comm().timeout();
  comm().set_timeout(5.0);  // ample for ranks oversubscribing CI's two cores
  comm().barrier();
  // The last rank arrives late, within the timeout: the others wait and the all-reduce completes.
  if (comm().rank() == comm().world_size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  double x = 1;
  comm().all_reduce(std::span<double>(&x, 1));
  EXPECT_EQ(x, comm().world_size());
  comm().set_timeout(before);
}

TEST(CollectiveTimeout, StalledRank) {
  const int target = env_or("FLASHLM_TEST_STALL_RANK", -1);
  if (target < 0) GTEST_SKIP() << "set FLASHLM_TEST_STALL_RANK to make one rank stall (ends the job)";
  comm().set_timeout(1.0);
  comm().barrier();
  // Far longer than the timeout and than stalled_rank.cmake waits: only the peers' watchdog ends this.
  if (comm().rank() == target) std::this_thread::sleep_for(std::chrono::seconds(120));
  double x = 1;
  comm().all_reduce(std::span<double>(&x, 1));
  ADD_FAILURE() << "rank " << comm().rank() << ": the all-reduce returned although rank " << target << " stalled";
}

TEST(FirstError, EveryRankLearnsTheLowestFailingRank) {
  const int n = comm().world_size(), r = comm().rank();
  EXPECT_EQ(comm().first_error(""), "");
  const std::string got = comm().first_error(r == n - 1 ? "out of memory" : "");
  EXPECT_EQ(got, "rank " + std::to_string(n - 1) + ": out of memory");
  const std::string both = comm().first_error("failed on " + std::to_string(r));
  EXPECT_EQ(both, "rank 0: failed on 0");
}

// ---------------------------------------------------------------------------------------------------
// allreduce-bench as a library function.

TEST(AllReduceBench, ParsesSizes) {
  EXPECT_EQ(parse_byte_size("1048576"), 1048576);
  EXPECT_EQ(parse_byte_size("1MB"), 1000000);
  EXPECT_EQ(parse_byte_size("10mb"), 10000000);
  EXPECT_EQ(parse_byte_size("1GB"), 1000000000);
  EXPECT_EQ(parse_byte_size("64KB"), 64000);
  EXPECT_EQ(parse_byte_size("4k"), 4000);
  EXPECT_EQ(parse_byte_size("1MiB"), 1 << 20);
  EXPECT_EQ(parse_byte_size("64KiB"), 65536);
  EXPECT_EQ(parse_byte_size("2gib"), int64_t{2} << 30);
  EXPECT_EQ(parse_byte_size("512B"), 512);
  for (const char* bad : {"12XB", "", "MB", "0", "0MB", "-1MB", "1.5MB", "1 MB", "1MBB", "99999999999999GB"}) {
    EXPECT_THROW(parse_byte_size(bad), Error) << bad;
  }
  EXPECT_EQ(format_byte_size(1000000), "1 MB");
  EXPECT_EQ(format_byte_size(1 << 20), "1 MiB");
  EXPECT_EQ(format_byte_size(65536), "64 KiB");
  EXPECT_EQ(format_byte_size(1000000000), "1 GB");
  EXPECT_EQ(format_byte_size(1001), "1001 B");
}

TEST(AllReduceBench, SmallSweepOnTheCpu) {
  AllReduceBenchConfig cfg;
  // 2 bytes: less than one fp32 element; 1 PiB: more than any host has (oom on every rank, and the sweep
  // goes on).
  cfg.sizes = {4000, 1 << 20, 2, int64_t{1} << 50};
  cfg.dtypes = {DType::f32, DType::f64};
  cfg.warmup = 1;
  cfg.iters = 3;
  const auto records = run_allreduce_bench(comm(), cfg);
  ASSERT_EQ(records.size(), 8u);
  const int n = comm().world_size();
  for (const auto& rec : records) {
    EXPECT_EQ(rec.world_size, n);
    EXPECT_EQ(rec.backend, "mpi");
    if (rec.elements == 0) {
      EXPECT_EQ(rec.status, "error");
      continue;
    }
    if (rec.bytes == int64_t{1} << 50) {
      EXPECT_EQ(rec.status, "oom") << rec.message;
      EXPECT_EQ(rec.message.rfind("rank 0: ", 0), 0u) << rec.message;
      EXPECT_FALSE(rec.median_ms.has_value());
      continue;
    }
    EXPECT_EQ(rec.status, "ok") << rec.message;
    ASSERT_TRUE(rec.median_ms && rec.mean_ms && rec.min_ms && rec.algbw_gbps && rec.busbw_gbps);
    EXPECT_GE(*rec.median_ms, *rec.min_ms);
    EXPECT_NEAR(*rec.algbw_gbps, rec.bytes / (*rec.median_ms * 1e-3) / 1e9, 1e-9 * *rec.algbw_gbps);
    EXPECT_NEAR(*rec.busbw_gbps, *rec.algbw_gbps * 2.0 * (n - 1) / n, 1e-9 * *rec.algbw_gbps);
  }
  EXPECT_EQ(records[0].bytes, 4000);
  EXPECT_EQ(records[4].elements, 500);  // 4000 bytes of fp64
  const std::string md = format_allreduce_bench(records, ReportFormat::md, cfg, comm());
  EXPECT_NE(md.find("busbw GB/s"), std::string::npos) << md;
  const std::string csv = format_allreduce_bench(records, ReportFormat::csv, cfg, comm());
  EXPECT_EQ(csv.rfind("backend,world_size,dtype,size,bytes,median_ms", 0), 0u) << csv;
}

TEST(AllReduceBench, RanksMustRunTheSameSweep) {
  const int n = comm().world_size(), r = comm().rank();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  AllReduceBenchConfig cfg;
  cfg.sizes = {r == 0 ? int64_t{1000} : int64_t{2000}};
  cfg.iters = 1;
  try {
    run_allreduce_bench(comm(), cfg);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks disagree on the message sizes"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------------
// GPU collectives (NCCL): skipped without NCCL or without a GPU per local rank.

#ifdef FLASHLM_WITH_CUDA
// Every rank's `local` flag, or-ed: for decisions all ranks must take together.
bool any_rank(bool local) {
  double v = local ? 1.0 : 0.0;
  comm().all_reduce(std::span<double>(&v, 1), ReduceOp::max);
  return v > 0;
}

bool gpus_for_every_rank() {
  const bool ok = Communicator::nccl_built() && cuda_device_count() >= comm().local_size();
  return !any_rank(!ok);
}

template <class T>
std::vector<T> to_host(const Tensor& t) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  cuda_copy(out.data(), t.data(), t.bytes());
  return out;
}

template <class T>
Tensor to_device(const std::vector<T>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, dtype_of<T>(), Device::cuda, "test");
  cuda_copy(t.data(), v.data(), t.bytes());
  return t;
}

template <class T>
class GpuCollectives : public ::testing::Test {};
using GpuTypes = ::testing::Types<float, bf16_t, fp16_t>;
TYPED_TEST_SUITE(GpuCollectives, GpuTypes);

TYPED_TEST(GpuCollectives, AllReduceBroadcastAllGatherReduceScatter) {
  using T = TypeParam;
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  const int n = comm().world_size(), r = comm().rank();
  const int device = comm().setup_cuda();
  EXPECT_EQ(device, comm().local_rank() % cuda_device_count());
  EXPECT_NE(comm().cuda_stream(), nullptr);
  auto v = [](int x) { return T(static_cast<float>(x)); };
  auto f = [](T x) { return static_cast<float>(x); };
  // Small integers: exact in bf16 and fp16 whatever the order of the sums.
  const size_t count = 1000;
  std::vector<T> x(count);
  for (size_t i = 0; i < count; ++i) x[i] = v(r + 1 + static_cast<int>(i % 4));
  Tensor dx = to_device(x);
  comm().all_reduce(dx, ReduceOp::sum);
  comm().synchronize();
  auto got = to_host<T>(dx);
  for (size_t i = 0; i < count; ++i) {
    if (f(got[i]) != static_cast<float>(n * (n + 1) / 2 + n * static_cast<int>(i % 4))) {
      ADD_FAILURE() << "all_reduce: [" << i << "] = " << f(got[i]);
      break;
    }
  }
  dx = to_device(x);
  comm().all_reduce(dx, ReduceOp::max);
  comm().wait(nullptr);  // the legacy default stream (cuda_copy) waits for the collective
  got = to_host<T>(dx);
  EXPECT_EQ(f(got[0]), static_cast<float>(n + 0));

  std::vector<T> b(64, v(r));
  Tensor db = to_device(b);
  comm().broadcast(db, n - 1);
  comm().synchronize();
  for (T e : to_host<T>(db)) EXPECT_EQ(f(e), static_cast<float>(n - 1));

  const size_t chunk = 32;
  std::vector<T> in(chunk, v(r + 1));
  Tensor din = to_device(in);
  Tensor dout = Tensor::empty({static_cast<int64_t>(chunk * n)}, dtype_of<T>(), Device::cuda, "test");
  comm().all_gather(din, dout);
  comm().synchronize();
  got = to_host<T>(dout);
  for (int q = 0; q < n; ++q) EXPECT_EQ(f(got[q * chunk]), static_cast<float>(q + 1));

  std::vector<T> rs(chunk * n, v(1));
  Tensor drs = to_device(rs);
  Tensor dpart = Tensor::empty({static_cast<int64_t>(chunk)}, dtype_of<T>(), Device::cuda, "test");
  comm().reduce_scatter(drs, dpart, ReduceOp::sum);
  comm().synchronize();
  for (T e : to_host<T>(dpart)) EXPECT_EQ(f(e), static_cast<float>(n));
}

// The asynchronous all-reduce of a CUDA view is queued like all_reduce; all_gather_v broadcasts each chunk.
TEST(GpuCollectivesExtra, AsyncAllReduceAndAllGatherV) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  const int n = comm().world_size(), r = comm().rank();
  comm().setup_cuda();
  Tensor dx = to_device(std::vector<float>(100, float(r + 1)));
  CommRequest request = comm().all_reduce_async(dx, ReduceOp::avg);
  EXPECT_FALSE(request.pending());  // GPU work is asynchronous to the host anyway
  comm().synchronize();
  for (float e : to_host<float>(dx)) EXPECT_FLOAT_EQ(e, float(n + 1) / 2);
  std::vector<int64_t> counts;
  std::vector<float> x;
  for (int q = 0; q < n; ++q) {
    counts.push_back(q == 1 ? 0 : q + 3);
    for (int64_t k = 0; k < counts.back(); ++k) x.push_back(q == r ? float(10 * q + k) : -1.0f);
  }
  Tensor dv = to_device(x);
  comm().all_gather_v(dv, counts);
  comm().synchronize();
  const std::vector<float> got = to_host<float>(dv);
  size_t at = 0;
  for (int q = 0; q < n; ++q) {
    for (int64_t k = 0; k < counts[size_t(q)]; ++k, ++at) EXPECT_EQ(got[at], float(10 * q + k)) << q << " " << k;
  }
}

// One NCCL group of in-place all-gathers, one per segment.
TEST(GpuCollectivesExtra, AllGatherSegments) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  const int n = comm().world_size(), r = comm().rank();
  comm().setup_cuda();
  SegmentsCase c(n, r);
  Tensor dx = to_device(c.x);
  comm().all_gather_segments(dx, c.segments);
  comm().synchronize();
  c.check(to_host<float>(dx), n);
}

// An NCCL communicator limited to 2 CTAs (ncclConfig_t maxCTAs) reduces correctly; once it exists, its limit
// cannot change.
TEST(GpuCollectivesSetup, MaxCtasConfig) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  const int n = comm().world_size(), r = comm().rank();
  Communicator c;
  c.set_nccl_max_ctas(2);
  c.setup_cuda();
  Tensor dx = to_device(std::vector<float>(1 << 20, float(r + 1)));
  c.all_reduce(dx, ReduceOp::sum);
  c.synchronize();
  const std::vector<float> got = to_host<float>(dx);
  EXPECT_EQ(std::count(got.begin(), got.end(), float(n * (n + 1) / 2)), int64_t(got.size()));
  EXPECT_THROW(c.set_nccl_max_ctas(3), Error);
  c.set_nccl_max_ctas(2);  // unchanged: fine
}

TEST(GpuCollectivesSetup, MoreLocalRanksThanGpusIsAClearError) {
  const int visible = Communicator::nccl_built() ? cuda_device_count() : 0;
  if (any_rank(!(visible > 0 && visible < comm().local_size()))) {
    GTEST_SKIP() << "needs NCCL and fewer GPUs than local ranks";
  }
  Communicator c;  // a fresh one: setup_cuda() fails before NCCL is created
  try {
    c.setup_cuda();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks on this node but"), std::string::npos) << e.what();
  }
}

// The watchdog's GPU side (run by hand on a node with two GPUs, see stalled_rank.cmake): rank R sleeps
// while its peers' NCCL all-reduce waits for it and they block in cudaDeviceSynchronize, outside any
// flashlm call; their watchdog's probe event must end the job ("the NCCL collectives on cuda:D up to ...").
TEST(CollectiveTimeout, StalledRankOnGpus) {
  const int target = env_or("FLASHLM_TEST_STALL_RANK", -1);
  if (target < 0) GTEST_SKIP() << "set FLASHLM_TEST_STALL_RANK to make one rank stall (ends the job)";
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one GPU per local rank";
  comm().setup_cuda();
  Tensor x = to_device(std::vector<float>(1024, 1.0f));
  comm().all_reduce(x, ReduceOp::sum);  // connects NCCL's peers (the first collective) while all are here
  comm().synchronize();
  comm().set_timeout(1.0);
  comm().barrier();
  if (comm().rank() == target) std::this_thread::sleep_for(std::chrono::seconds(120));
  comm().all_reduce(x, ReduceOp::sum);
  cuda_synchronize();
  ADD_FAILURE() << "rank " << comm().rank() << ": the GPU all-reduce finished although rank " << target
                << " stalled";
}
#else
TEST(GpuCollectives, SkippedWithoutCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }
#endif

// ---------------------------------------------------------------------------------------------------

TEST(FailurePropagation, InjectedFailure) {
  const int target = env_or("FLASHLM_TEST_FAIL_ON_RANK", -1);
  if (target < 0) GTEST_SKIP() << "set FLASHLM_TEST_FAIL_ON_RANK to make this test fail on one rank";
  comm().barrier();
  if (comm().rank() == target) ADD_FAILURE() << "injected failure on rank " << target;
}

}  // namespace
