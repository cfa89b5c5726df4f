// CPU FlashAttention-2 against the fp64 naive reference over ragged shapes, layouts, GQA, masks, head
// dims and dtypes; gradients against central finite differences; fully-masked rows; O(seq) memory.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "attention/attention_testing.h"
#include "attention/cpu_isa.h"
#include "attention/cpu_rows.h"
#include "core/cpu_simd.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

class FlashCpuVsReference : public ::testing::TestWithParam<Case> {};

void check_against_oracle(const Case& c);

// Every instruction-set variant of the kernels this CPU runs (attention/cpu_isa.h), forced in turn.
TEST_P(FlashCpuVsReference, ForwardAndBackwardMatchFp64Oracle) {
  const std::string chosen = cpu_kernel_isa();
  for (const std::string& isa : runnable_cpu_kernel_isas()) {
    SCOPED_TRACE("CPU kernels: " + isa);
    use_cpu_kernel_isa(isa);
    check_against_oracle(GetParam());
  }
  use_cpu_kernel_isa(chosen);
}

TEST(FlashCpu, UnknownKernelIsaIsAnErrorNamingTheRunnableOnes) {
  expect_error([] { use_cpu_kernel_isa("sse9"); }, {"'sse9'", "baseline"});
  EXPECT_FALSE(cpu_kernel_isa().empty());
}

void check_against_oracle(const Case& c) { expect_flash_matches_oracle(c, options_for(c.mask, AttentionImpl::flash)); }

std::vector<Case> grid() {
  std::vector<Case> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  int n = 0;
  // Ragged lengths with Nk != Nq, every mask and layout.
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 77}, {17, 17}, {17, 130}, {127, 64}, {127, 127},
                        {1000, 1000}, {1000, 333}, {65, 1000}}) {
    for (Mask m : masks) {
#ifdef __SANITIZE_ADDRESS__
      // The sanitizer build (scripts/test.sh's second run) takes one mask per 1000-row shape, rotating so that
      // the three shapes still cover every mask and every layout (1000x1000 causal BR sliced, 1000x333 full bshd,
      // 65x1000 causal TL bhsd): the nine cost it 110 s of a 2-core CI machine under ASan, the full 1000x1000
      // one 39 s, these three 30 s. The main build runs all nine; the sizes below cover the tile edges.
      if (std::max(nq, nk) >= 1000 && static_cast<int>(m) != (n / 3 + 2) % 3) {
        ++n;
        continue;
      }
#endif
      cases.push_back({2, nq, nk, 2, 2, 64, layouts[n % 3], m, DType::f32});
      ++n;
    }
  }
  // Lengths at and beside the edges of the forward's 128-query tiles and of the 64-row tiles the keys (and the
  // backward's queries) are packed in, causal in both alignments, with GQA.
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{127, 129}, {128, 128}, {129, 127}, {257, 128}, {129, 255}}) {
    for (Mask m : {Mask::top_left, Mask::bottom_right}) {
      cases.push_back({1, nq, nk, 4, 2, 64, layouts[n % 3], m, DType::f32});
      ++n;
    }
  }
  // The forward's causal-diagonal tiles, whose blocks of queries compute only the keys they see: query blocks
  // that end mid-way through a register block of keys, in both alignments, at d64 and d128.
  for (auto [nq, nk, d] : {std::tuple<int64_t, int64_t, int64_t>{300, 300, 128}, {141, 403, 128}, {403, 141, 64}}) {
    for (Mask m : {Mask::top_left, Mask::bottom_right}) {
      cases.push_back({1, nq, nk, 2, 1, d, layouts[n % 3], m, DType::f32});
      ++n;
    }
  }
  // Every head dim (with GQA and MQA along the way).
  for (int64_t d : {16, 32, 64, 128, 256}) {
    cases.push_back({1, 129, 97, 4, 2, d, layouts[d % 3], Mask::top_left, DType::f32});
    cases.push_back({2, 64, 200, 6, 1, d, layouts[(d + 1) % 3], Mask::bottom_right, DType::f32});
  }
  // Odd head dims are accepted on the CPU.
  cases.push_back({1, 33, 45, 3, 3, 40, Layout::sliced, Mask::none, DType::f32});
  // Every dtype.
  for (DType t : {DType::f64, DType::f16, DType::bf16}) {
    for (Mask m : masks) cases.push_back({2, 150, 131, 4, 2, 64, layouts[static_cast<int>(m)], m, t});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, FlashCpuVsReference, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); });

// Central finite differences of L = Σ O ∘ W (so dO = W) in fp64, for both implementations.
class FiniteDifferences : public ::testing::TestWithParam<std::tuple<AttentionImpl, Mask>> {};

TEST_P(FiniteDifferences, GradientsMatchCentralDifferences) {
  const auto [impl, mask] = GetParam();
  const Case c{1, 7, 9, 4, 2, 8, Layout::bhsd, mask, DType::f64};
  AttentionOptions opt = options_for(mask, impl);
  opt.scale = 0.7;  // a custom scale, so the scale's use in the gradients is checked too
  Problem p(c, c.layout, DType::f64, 42);
  p.run(opt);

  expect_gradients_match_central_differences(p, opt);
}

INSTANTIATE_TEST_SUITE_P(
    Impls, FiniteDifferences,
    ::testing::Combine(::testing::Values(AttentionImpl::flash, AttentionImpl::naive),
                       ::testing::Values(Mask::none, Mask::top_left, Mask::bottom_right)),
    [](const auto& info) {
      const Mask m = std::get<1>(info.param);
      return std::string(attention_impl_name(std::get<0>(info.param))) +
             (m == Mask::none ? "_full" : m == Mask::top_left ? "_causalTL" : "_causalBR");
    });

TEST(FlashCpu, FullyMaskedRowsGiveZeroOutputNegInfLseAndZeroGradients) {
  // Bottom-right alignment with more queries than keys: queries 0..5 see no key.
  const Case c{1, 10, 4, 2, 1, 32, Layout::bshd, Mask::bottom_right, DType::f32};
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    Problem p(c, c.layout, c.dtype, 5);
    p.run(options_for(c.mask, impl));
    const TensorView& o = p.o.view;
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < 10; ++i) {
        const float lse = p.lse.view().ptr<float>()[h * 10 + i];
        const float* orow = o.ptr<float>() + i * o.stride(1) + h * o.stride(2);
        const float* dqrow = p.dq.view.ptr<float>() + i * o.stride(1) + h * o.stride(2);
        if (i < 6) {
          EXPECT_EQ(lse, -std::numeric_limits<float>::infinity()) << attention_impl_name(impl) << " row " << i;
          for (int d = 0; d < 32; ++d) {
            EXPECT_EQ(orow[d], 0.0f);
            EXPECT_EQ(dqrow[d], 0.0f);
          }
        } else {
          EXPECT_TRUE(std::isfinite(lse));
        }
      }
    }
    EXPECT_TRUE(all_finite_or_neg_inf(p.dk.view));
    EXPECT_TRUE(all_finite_or_neg_inf(p.dv.view));
  }
}

// A NaN in a value row sends its key tile through the forward's per-pair fallback (P V over the visible pairs
// only): the rows that do not see it, and the other columns of those that do, must still match the fp64 oracle,
// at a head dim that is not a whole
// number of the micro-kernel's column panels (the packed V tile padded), under every instruction-set variant.
TEST(FlashCpu, RowsNotSeeingANanValueMatchTheOracleThroughThePerPairFallback) {
  const Case c{1, 150, 150, 2, 1, 48, Layout::bshd, Mask::top_left, DType::f32};
  constexpr int64_t kNanKey = 100, kNanDim = 5;  // queries 0..99 do not see it; 100.. get NaN in column 5 only
  const std::string chosen = cpu_kernel_isa();
  for (const std::string& isa : runnable_cpu_kernel_isas()) {
    SCOPED_TRACE("CPU kernels: " + isa);
    use_cpu_kernel_isa(isa);
    Problem ours(c, c.layout, c.dtype, 77);
    const TensorView& v = ours.v.view;
    v.ptr<float>()[kNanKey * v.stride(1) + kNanDim] = std::numeric_limits<float>::quiet_NaN();
    ours.run(options_for(c.mask, AttentionImpl::flash));
    Problem ref(ours, c);
    ref.run(options_for(c.mask, AttentionImpl::naive));
    const TensorView &got = ours.o.view, &want = ref.o.view;
    for (int64_t i = 0; i < c.Nq; ++i) {
      for (int64_t h = 0; h < c.Hq; ++h) {
        for (int64_t d = 0; d < c.D; ++d) {
          const float g = got.ptr<float>()[i * got.stride(1) + h * got.stride(2) + d];
          const double w = want.ptr<double>()[i * want.stride(1) + h * want.stride(2) + d];
          if (i >= kNanKey && d == kNanDim) {
            EXPECT_TRUE(std::isnan(g)) << "o[" << i << "][" << h << "][" << d << "]";
          } else {
            EXPECT_NEAR(g, w, 1e-5) << "o[" << i << "][" << h << "][" << d << "]";
          }
        }
      }
    }
  }
  use_cpu_kernel_isa(chosen);
}

// The softmax's fp32 exp against libm's fp64 exp: a few ulp over its whole range (random arguments, the
// clamp and rounding boundaries), and the special values SPEC §2's masking relies on.
TEST(CpuSimd, ExpFp32MatchesLibmWithinAFewUlp) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-87.0f, 88.0f), softmax(-30.0f, 0.0f);
  std::vector<float> args;
  for (int i = 0; i < 20000; ++i) args.push_back(i % 2 ? wide(rng) : softmax(rng));
  for (float a : {0.0f, -0.0f, 1e-8f, -1e-8f, 0.3465f, -0.3466f, 1.0f, -1.0f, -87.29f, 88.69f, -87.0f, 88.0f}) {
    args.push_back(a);
  }
  std::vector<float> got(args.size()), got_nonpositive(args.size());
#pragma omp simd
  for (size_t i = 0; i < args.size(); ++i) {  // the vector variants, as the kernels call them
    got[i] = exp_fp32(args[i]);
    got_nonpositive[i] = exp_fp32_nonpositive(args[i] < 0 ? args[i] : -args[i]);
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const double want = std::exp(double(args[i]));
    // Above 88.38 the exponent is clamped to 127 and the polynomial runs past ln2/2: a little less accurate.
    const double tolerance = (args[i] < 88.3f ? 4e-7 : 1e-6) * want;
    EXPECT_LE(std::abs(got[i] - want), tolerance) << "exp_fp32(" << args[i] << ") = " << got[i] << ", libm " << want;
    EXPECT_EQ(got[i], exp_fp32(args[i])) << "the scalar and vector variants differ at " << args[i];
    const float neg = args[i] < 0 ? args[i] : -args[i];  // the softmax's variant, on its domain
    const double want_neg = std::exp(double(neg)), tolerance_neg = 4e-7 * want_neg + 2e-38;  // 0 below e^-87.3
    EXPECT_LE(std::abs(got_nonpositive[i] - want_neg), tolerance_neg)
        << "exp_fp32_nonpositive(" << neg << ") = " << got_nonpositive[i] << ", libm " << want_neg;
    EXPECT_EQ(got_nonpositive[i], exp_fp32_nonpositive(neg)) << "the scalar and vector variants differ at " << neg;
  }
  EXPECT_EQ(exp_fp32_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(exp_fp32_nonpositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(exp_fp32_nonpositive(-100.0f), 0.0f);
  EXPECT_TRUE(std::isnan(exp_fp32_nonpositive(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(exp_fp32(0.0f), 1.0f);
  EXPECT_EQ(exp_fp32(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(exp_fp32(-100.0f), 0.0f);
  EXPECT_EQ(exp_fp32(100.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(exp_fp32(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(exp_fp32(std::numeric_limits<float>::quiet_NaN())));
}

// The softmax rows' reductions run whole kLanes-wide steps, then a scalar tail (whole_lanes): every length
// from 0 to past three steps, and the forward's key tile (512, where the tail is empty), with the row's
// largest element last, in the tail where there is one.
TEST(CpuSimd, RowReductionsTakeEveryLength) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> scores(-8.0f, 0.0f);
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n <= 3 * kLanes + 1; ++n) lengths.push_back(n);
  lengths.push_back(512);
  for (int64_t n : lengths) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = scores(rng);
    if (n > 0) x.back() = 1.0f;
    const float want_max = n > 0 ? 1.0f : -std::numeric_limits<float>::infinity();
    EXPECT_EQ(row_max(x.data(), n), want_max) << "n " << n;
    EXPECT_EQ(row_max_skipping_nan(x.data(), n), want_max) << "n " << n;
    std::vector<float> p = x;
    double want_sum = 0;
    for (float& e : x) {
      e = exp_nonpositive(e - 1.0f);
      want_sum += e;
    }
    const float sum = exp_shifted_sum(p.data(), n, 1.0f);
    EXPECT_NEAR(sum, want_sum, 1e-5 * (want_sum + 1)) << "n " << n;
    // Within the exponentials' error: an AVX-512 build takes exp_fp32_nonpositive_x16, not bitwise the same.
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(p[size_t(i)], x[size_t(i)], 1e-6f * x[size_t(i)]) << n << " " << i;
  }
}

TEST(FlashCpu, BackwardIsBitwiseDeterministic) {
  const Case c{2, 300, 257, 4, 2, 64, Layout::bhsd, Mask::top_left, DType::f32};
  Problem a(c, c.layout, c.dtype, 9), b(c, c.layout, c.dtype, 9);
  a.run(options_for(c.mask, AttentionImpl::flash));
  b.run(options_for(c.mask, AttentionImpl::flash));
  EXPECT_EQ(max_abs_diff(a.dq.view, b.dq.view), 0.0);
  EXPECT_EQ(max_abs_diff(a.dk.view, b.dk.view), 0.0);
  EXPECT_EQ(max_abs_diff(a.dv.view, b.dv.view), 0.0);
}

// Extra memory of one forward + backward (everything the call allocates beyond its arguments).
int64_t extra_bytes(AttentionImpl impl, int64_t n) {
  const Case c{1, n, n, 2, 2, 64, Layout::bshd, Mask::none, DType::f32};
  Problem p(c, c.layout, c.dtype, 3);
  const int64_t base = memory_stats(Device::cpu).current_bytes;
  memory_reset_peak(Device::cpu);
  p.run(options_for(c.mask, impl));
  return memory_stats(Device::cpu).peak_bytes - base;
}

TEST(FlashCpu, ExtraMemoryGrowsLinearlyWhileNaiveGrowsQuadratically) {
  const int64_t flash_1k = extra_bytes(AttentionImpl::flash, 1024), flash_2k = extra_bytes(AttentionImpl::flash, 2048);
  const int64_t naive_1k = extra_bytes(AttentionImpl::naive, 1024), naive_2k = extra_bytes(AttentionImpl::naive, 2048);
  // flash: the sequence-sized buffers are linear in it: per row and head, Delta (one fp32) and the backward's
  // packed copies of Q, dO, K (as stored and transposed) and V (transposed), head_dim fp32 each; per row and
  // thread, the backward's dQ accumulator (head_dim fp32) and logsumexp (one fp32) of the head it works on.
  // Plus one finite flag (a byte) per 128-row tile of each of the five packed tensors, each set of flags one
  // allocation rounded up to the allocator's 64 bytes: at most 5 · 64 bytes more at 2048 rows and 2 heads.
  const int64_t per_row = 2 * (1 + 5 * 64) + cpu_threads() * (64 + 1);
  const int64_t flag_bytes = 5 * 64;
  EXPECT_LE(flash_2k - flash_1k, 1024 * 4 * per_row + flag_bytes) << flash_1k << " -> " << flash_2k;
  // naive: S and P are seq² per head: doubling seq quadruples them.
  EXPECT_GE(naive_2k, 3.9 * double(naive_1k)) << naive_1k << " -> " << naive_2k;
}

}  // namespace
