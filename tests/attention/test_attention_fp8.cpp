// FP8 (e4m3) attention: its argument checks, the CPU forward and backward (both impls) against the fp64
// reference computed on the dequantised inputs (always run), the sm_90a forward kernel and the CUDA backward (the
// 16-bit kernels on bf16 copies) against the same reference, with per-tensor and with per-head descales (GPU tests:
// skip without a GPU, the forward's without an sm_90 one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/attention_testing.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"
#include "flashlm/dtype.h"
#include "gpu_testing.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

constexpr float kQDescale = 0.5f, kKDescale = 0.25f, kVDescale = 2.0f;

TEST(Fp8Dtype, HostConversionRoundsToNearestEvenAndSaturates) {
  // Every code decodes and encodes back to itself (NaN codes stay NaN).
  for (int b = 0; b < 256; ++b) {
    const float f = f8e4m3_t::to_float(static_cast<uint8_t>(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << b;
      EXPECT_EQ(f8e4m3_t::from_float(f) & 0x7f, 0x7f) << b;
      continue;
    }
    EXPECT_EQ(f8e4m3_t::from_float(f), b == 0x80 ? 0x80 : b) << "code " << b << " = " << f;
  }
  EXPECT_EQ(f8e4m3_t::to_float(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_t::to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(float(f8e4m3_t(1000.0f)), 448.0f);  // saturating, as __NV_SATFINITE
  EXPECT_EQ(float(f8e4m3_t(-INFINITY)), -448.0f);
  EXPECT_EQ(float(f8e4m3_t(1.0625f)), 1.0f);    // halfway between 1 and 1.125: to even
  EXPECT_EQ(float(f8e4m3_t(1.1875f)), 1.25f);   // halfway between 1.125 and 1.25: to even
  EXPECT_EQ(float(f8e4m3_t(0x1.8p-10f)), std::ldexp(1.0f, -9));  // 1.5 · 2^-10 rounds up to 2^-9
  EXPECT_EQ(float(f8e4m3_t(0x1p-11f)), 0.0f);
  EXPECT_EQ(dtype_size(DType::f8e4m3), 1u);
  EXPECT_EQ(dtype_name(DType::f8e4m3), "fp8_e4m3");
  EXPECT_EQ(parse_dtype("float8_e4m3fn"), DType::f8e4m3);
  EXPECT_EQ(parse_dtype("fp8"), DType::f8e4m3);
}

// The checks need no GPU: validation runs before any device work.
TEST(Fp8Attention, BadArgumentsAreClearErrors) {
  Tensor q = Tensor::empty({1, 8, 2, 64}, DType::f8e4m3), o = Tensor::empty({1, 8, 2, 64}, DType::bf16);
  Tensor o8 = Tensor::empty({1, 8, 2, 64}, DType::f8e4m3), lse = Tensor::empty({1, 2, 8}, DType::f32);
  fill_normal(q, 1);
  expect_error([&] { attention_forward(q, q, q, o8, lse); }, {"attention_forward", "o", "expected dtype bf16"});
  AttentionOptions bad;
  bad.k_descale = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { attention_forward(q, q, q, o, lse, bad); }, {"k_descale", "finite number > 0"});
  bad.k_descale = 0.0f;
  expect_error([&] { attention_forward(q, q, q, o, lse, bad); }, {"k_descale", "finite number > 0"});

  Tensor qb = Tensor::empty({1, 8, 2, 64}, DType::bf16), ob = Tensor::empty({1, 8, 2, 64}, DType::bf16);
  fill_normal(qb, 2);
  AttentionOptions descaled;
  descaled.v_descale = 2.0f;
  expect_error([&] { attention_forward(qb, qb, qb, ob, lse, descaled); },
               {"v_descale", "fp8_e4m3 inputs only", "bf16"});

  // The backward: dout bf16 (o's dtype), the gradients bf16 or fp32 and all one dtype, the descales as above.
  Tensor g = Tensor::empty({1, 8, 2, 64}, DType::f32), g8 = Tensor::empty({1, 8, 2, 64}, DType::f8e4m3);
  Tensor gb = Tensor::empty({1, 8, 2, 64}, DType::bf16), gh = Tensor::empty({1, 8, 2, 64}, DType::f16);
  Tensor dout = Tensor::empty({1, 8, 2, 64}, DType::bf16);
  fill_normal(dout, 3);
  expect_error([&] { attention_backward(q, q, q, o, lse, g, g, g, g); },
               {"attention_backward", "dout", "expected dtype bf16", "fp32"});
  expect_error([&] { attention_backward(q, q, q, o8, lse, dout, g, g, g); },
               {"attention_backward", "o", "expected dtype bf16"});
  expect_error([&] { attention_backward(q, q, q, o, lse, dout, g8, g8, g8); },
               {"attention_backward", "dq", "bf16 or fp32", "fp8_e4m3"});
  expect_error([&] { attention_backward(q, q, q, o, lse, dout, gh, gh, gh); }, {"dq", "bf16 or fp32", "fp16"});
  expect_error([&] { attention_backward(q, q, q, o, lse, dout, gb, g, g); }, {"dk", "differs from dq's"});
  for (float d : {-1.0f, std::numeric_limits<float>::infinity()}) {
    AttentionOptions neg;
    neg.q_descale = d;
    expect_error([&] { attention_backward(q, q, q, o, lse, dout, g, g, g, neg); },
                 {"attention_backward", "q_descale", "finite number > 0"});
    neg.q_descale = 1.0f;
    neg.v_descale = d;
    expect_error([&] { attention_forward(q, q, q, o, lse, neg); }, {"attention_forward", "v_descale", "finite number > 0"});
  }
  // The gradients may not overlap an input (here: dq is dout's memory).
  Tensor gbo = Tensor::empty({1, 8, 2, 64}, DType::bf16);
  expect_error([&] { attention_backward(q, q, q, o, lse, gbo, gbo, gb, gb); }, {"dq", "overlaps the input dout"});
}

// fp8 inputs in a layout whose rows stay 16-byte aligned (the CUDA kernels' rule; testing::make_laid_out's
// sliced view pads head_dim by 8 elements, 8 bytes here): the sliced view pads by 16.
LaidOut fp8_laid_out(Layout layout, int64_t B, int64_t N, int64_t H, int64_t D) {
  if (layout != Layout::sliced) return make_laid_out(layout, B, N, H, D, DType::f8e4m3);
  LaidOut t;
  t.storage = Tensor::empty({B, N + 3, H, D + 16}, DType::f8e4m3);
  t.view = t.storage.view().slice(1, 2, 2 + N).slice(3, 0, D);
  return t;
}

// The dequantised fp64 BSHD copy of an fp8 view: value · descale.
Tensor dequantised(const TensorView& t, double descale) {
  Tensor x = to_f64(t);
  for (int64_t i = 0; i < x.numel(); ++i) x.view().ptr<double>()[i] *= descale;
  return x;
}

struct Fp8Case {
  Case c;  // fp8 in, bf16 out; c.dtype: the gradients' dtype of the backward (bf16 or fp32), unused by the forward
  // The CUDA backward only: AttentionOptions::deterministic, and FLASHLM_ATTENTION_KERNEL=mma (the mma.sync
  // kernels on sm_90 too, where the Hopper ones would cover the problem).
  bool deterministic = false, mma = false;
  // The sm_90 forward only: FLASHLM_FP8_KEY_BLOCK for the run (ScopedFp8KeyBlock); 0 leaves the environment's.
  int key_block = 0;
};

// FLASHLM_FP8_KEY_BLOCK set to `key_block` for the scope (0: left alone), then restored: the FP8 forward reads it at
// each call. The KeyBlock192 instantiations below run the forward grids on blocks of 192 keys this way, whatever the
// environment says; the Grid ones take the environment's (a GPU run may set it to cover 192 with them too).
struct ScopedFp8KeyBlock : ScopedEnvironment {
  explicit ScopedFp8KeyBlock(int key_block)
      : ScopedEnvironment("FLASHLM_FP8_KEY_BLOCK", key_block == 0 ? std::optional<std::string>{}
                                                                    : std::to_string(key_block)) {}
};

// A forward grid on blocks of 192 keys: the grid's cases, and lengths at and around multiples of 192 (blocks
// exactly full, a last block of one key or of 191, a last query tile of one row), causal and not.
std::vector<Fp8Case> with_key_block_192(std::vector<Fp8Case> cases) {
  int n = 0;
  for (int64_t d : {64, 128}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{192, 192}, {200, 193}, {385, 383}, {64, 577}}) {
      for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
        const bool mqa = n % 2 == 1;
        cases.push_back({{2, nq, nk, mqa ? 6 : 4, mqa ? 1 : 2, d, n % 3 == 2 ? Layout::sliced : Layout::bshd, m,
                          DType::bf16}});
        ++n;
      }
    }
  }
  for (Fp8Case& f : cases) f.key_block = 192;
  return cases;
}

std::string fp8_case_name(const Fp8Case& f) {
  Case c = f.c;
  c.dtype = DType::f8e4m3;
  return case_name(c);
}
void PrintTo(const Fp8Case& f, std::ostream* os) { *os << fp8_case_name(f); }

// The naive attention with the FP8 path's roundings and nothing else: S and the softmax in fp64 from the
// dequantised inputs, P rounded to e4m3 before P·V (the row sum from the unrounded P, as the kernel keeps
// it in fp32), O rounded to bf16. [B, Nq, Hq, D] fp64.
[[maybe_unused]] Tensor naive_with_fp8_roundings(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  Tensor o = Tensor::empty({c.B, c.Nq, c.Hq, c.D}, DType::f64);
  const double* qp = q.view().ptr<double>();
  const double* kp = k.view().ptr<double>();
  const double* vp = v.view().ptr<double>();
  double* op = o.view().ptr<double>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  const int64_t offset = c.mask == Mask::bottom_right ? c.Nk - c.Nq : 0;
  std::vector<double> s(static_cast<size_t>(c.Nk)), acc(static_cast<size_t>(c.D));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h) {
      const int64_t hk = h / (c.Hq / c.Hk);
      for (int64_t i = 0; i < c.Nq; ++i) {
        const int64_t visible = c.mask == Mask::none ? c.Nk : std::clamp<int64_t>(i + offset + 1, 0, c.Nk);
        double* out = op + ((b * c.Nq + i) * c.Hq + h) * c.D;
        std::fill(acc.begin(), acc.end(), 0.0);
        double m = -INFINITY, l = 0;
        for (int64_t j = 0; j < visible; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < c.D; ++d) {
            dot += qp[((b * c.Nq + i) * c.Hq + h) * c.D + d] * kp[((b * c.Nk + j) * c.Hk + hk) * c.D + d];
          }
          s[static_cast<size_t>(j)] = scale * dot;
          m = std::max(m, s[static_cast<size_t>(j)]);
        }
        for (int64_t j = 0; j < visible; ++j) {
          const double pj = std::exp(s[static_cast<size_t>(j)] - m);
          l += pj;
          const double pq = static_cast<float>(f8e4m3_t(static_cast<float>(pj)));
          for (int64_t d = 0; d < c.D; ++d) acc[static_cast<size_t>(d)] += pq * vp[((b * c.Nk + j) * c.Hk + hk) * c.D + d];
        }
        for (int64_t d = 0; d < c.D; ++d) {
          out[d] = visible == 0 ? 0.0 : static_cast<float>(bf16_t(static_cast<float>(acc[static_cast<size_t>(d)] / l)));
        }
      }
    }
  return o;
}

// o and lse of an FP8 forward (`o` [B, Nq, Hq, D] and `lse` [B, Hq, Nq], fp64, BSHD) against the fp64 reference of
// the dequantised inputs `qd`, `kd`, `vd` (fp64 BSHD). Bound, derived the way SPEC §3 derives the low-precision rule.
// The reference runs on the dequantised fp8 inputs, so input rounding is no error here; what the FP8 path adds is
// (a) P rounded to e4m3 for P·V: 3 mantissa bits, relative error at most 2^-4 per element for P >= 2^-6 (absolute
// at most 2^-10 below, e4m3's subnormal spacing being 2^-9), so |ΔO_i| <= 2^-4 · Σ_j P_ij |v_j| / l_i + 2^-10 ·
// Σ_j |v_j| / l_i in the worst case and far less on average (the roundings of different keys are independent); (b)
// O rounded to bf16 (2^-8 relative); (c) fp32 (tensor-core) accumulation of S and O, orders of magnitude below
// (a). The naive attention computed with exactly the roundings (a) and (b) has an error of the same nature against
// the reference, so — FlashAttention's rule, as for fp16/bf16 — ours may be at most twice that naive error plus
// 1e-3 absolute. lse involves no e4m3 rounding of P, only the accumulation of S: 1e-3 · max(1, |lse|) plus
// 2^-10 · max_j scale · Σ_d |q_d k_jd| over the row's visible keys. That second term is (c) for FP8 operands:
// Hopper's FP8 tensor cores keep about 14 mantissa bits in the accumulator (DeepSeek-V3's report, §3.3.2; the
// FP8 GEMM tests, test_fp8_cuda.cpp, saw 1.43 · 2^-10 · Σ|terms| over k up to 4800, where a head's d is at most
// 256), and lse moves by at most the largest error of a score. It matters where the descales make the scores
// large (per-head descales of 3.7: |S| near 40, an lse error near 0.05 measured on an H200); a descale of the
// wrong head moves the scores by 10% and fails by far. Rows that see no key: lse exactly -inf and o exactly 0.
[[maybe_unused]] void expect_fp8_forward_matches_reference(const Case& c, const Tensor& o, const Tensor& lse,
                                                           const Tensor& qd, const Tensor& kd, const Tensor& vd,
                                                           const std::string& name) {
  Tensor ref_o = Tensor::empty({c.B, c.Nq, c.Hq, c.D}, DType::f64);
  Tensor ref_lse = Tensor::empty({c.B, c.Hq, c.Nq}, DType::f64);
  attention_forward(qd, kd, vd, ref_o, ref_lse, options_for(c.mask, AttentionImpl::naive));
  const Tensor lowp = naive_with_fp8_roundings(c, qd, kd, vd);

  const double naive_err = max_abs_diff(lowp.view(), ref_o.view());
  const double err = max_abs_diff(o.view(), ref_o.view());
  EXPECT_LE(err, 2 * naive_err + 1e-3) << name << " (naive-with-fp8-roundings error " << naive_err << ", max |ref| "
                                       << max_abs(ref_o.view()) << ")";
  // lse: the worst row's error over its bound (at most 1), the row reported.
  double lse_ratio = 0, worst_err = 0, worst_scores = 0;
  int64_t bad_masked = 0;
  const double* got = lse.view().ptr<const double>();
  const double* want = ref_lse.view().ptr<double>();
  const double* qp = qd.view().ptr<const double>();
  const double* kp = kd.view().ptr<const double>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  const int64_t offset = c.mask == Mask::bottom_right ? c.Nk - c.Nq : 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Nq; ++i) {
        const int64_t at = (b * c.Hq + h) * c.Nq + i;  // lse is [B, Hq, Nq]
        if (std::isinf(want[at])) {  // a row that sees no key: exactly -inf
          bad_masked += got[at] != want[at];
          continue;
        }
        const int64_t hk = h / (c.Hq / c.Hk);
        const int64_t visible = c.mask == Mask::none ? c.Nk : std::clamp<int64_t>(i + offset + 1, 0, c.Nk);
        double scores = 0;  // max_j scale · Σ_d |q_d k_jd|
        for (int64_t j = 0; j < visible; ++j) {
          double sum = 0;
          for (int64_t d = 0; d < c.D; ++d)
            sum += std::fabs(qp[((b * c.Nq + i) * c.Hq + h) * c.D + d] * kp[((b * c.Nk + j) * c.Hk + hk) * c.D + d]);
          scores = std::max(scores, scale * sum);
        }
        const double err = std::fabs(got[at] - want[at]);
        const double ratio = err / (1e-3 * std::max(1.0, std::fabs(want[at])) + 0x1p-10 * scores);
        if (std::isnan(ratio) || ratio > lse_ratio) {
          lse_ratio = std::isnan(ratio) ? INFINITY : ratio;
          worst_err = err;
          worst_scores = scores;
        }
      }
  EXPECT_LE(lse_ratio, 1.0) << "lse of " << name << ": error " << worst_err << " where max_j scale·Σ|q k| is "
                            << worst_scores;
  EXPECT_EQ(bad_masked, 0) << "rows that see no key must have lse = -inf";
  // Rows that see no key are exactly zero (the reference's are).
  int64_t nonzero = 0;
  const double* od = o.view().ptr<const double>();
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < c.Nq; ++i) {
      const int64_t visible = c.mask == Mask::none ? c.Nk : std::clamp<int64_t>(i + offset + 1, 0, c.Nk);
      if (visible > 0) continue;
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t d = 0; d < c.D; ++d) nonzero += od[((b * c.Nq + i) * c.Hq + h) * c.D + d] != 0.0;
    }
  EXPECT_EQ(nonzero, 0) << "elements of rows that see no key are not 0";
}

class Fp8VsReference : public ::testing::TestWithParam<Fp8Case> {};

// The sm_90 forward with per-tensor descales (expect_fp8_forward_matches_reference's bound), twice: the kernel has no
// atomics, so the runs must agree bitwise.
TEST_P(Fp8VsReference, MatchesFp64ReferenceOfTheSameInputs) {
  SKIP_WITHOUT_HOPPER();
  const Case c = GetParam().c;
  const ScopedFp8KeyBlock key_block(GetParam().key_block);
  const uint64_t seed = 9100 + static_cast<uint64_t>(c.Nq * 7 + c.Nk + c.D);
  LaidOut q = fp8_laid_out(c.layout, c.B, c.Nq, c.Hq, c.D), k = fp8_laid_out(c.layout, c.B, c.Nk, c.Hk, c.D),
          v = fp8_laid_out(c.layout, c.B, c.Nk, c.Hk, c.D);
  // Values spread over e4m3's range (stddev 4: normals and some subnormals of the inputs' own scale).
  fill_normal(q.view, seed, 4.0);
  fill_normal(k.view, seed + 1, 4.0);
  fill_normal(v.view, seed + 2, 4.0);
  LaidOut o = make_laid_out(c.layout, c.B, c.Nq, c.Hq, c.D, DType::bf16);
  Tensor lse = Tensor::empty({c.B, c.Hq, c.Nq}, DType::f32);

  AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
  opt.q_descale = kQDescale;
  opt.k_descale = kKDescale;
  opt.v_descale = kVDescale;
  const LaidOut dq = to_device(q), dk = to_device(k), dv = to_device(v);
  std::vector<Tensor> o_runs, lse_runs;
  for (int run = 0; run < 2; ++run) {
    fill_value(o.view, std::numeric_limits<double>::quiet_NaN());  // poison: an unwritten element fails
    fill_value(lse, std::numeric_limits<double>::quiet_NaN());
    LaidOut d_o = to_device(o);
    Tensor d_lse = Tensor::empty({c.B, c.Hq, c.Nq}, DType::f32, Device::cuda);
    copy_into(d_lse.view(), lse.view());
    attention_forward(dq.view, dk.view, dv.view, d_o.view, d_lse, opt);
    copy_back(o, d_o);
    copy_into(lse.view(), d_lse.view());
    o_runs.push_back(to_f64(o.view));
    lse_runs.push_back(to_f64(lse.view()));
  }
  expect_fp8_forward_matches_reference(c, o_runs[0], lse_runs[0], dequantised(q.view, kQDescale),
                                       dequantised(k.view, kKDescale), dequantised(v.view, kVDescale),
                                       fp8_case_name(GetParam()));
  // Bitwise agreement of the two runs (NaN-free by now, or the bounds above failed).
  EXPECT_EQ(max_abs_diff(o_runs[0].view(), o_runs[1].view()), 0.0) << "o differs between runs: a race";
  EXPECT_EQ(std::memcmp(lse_runs[0].view().data, lse_runs[1].view().data, static_cast<size_t>(c.B * c.Hq * c.Nq) * 8),
            0)
      << "lse differs between runs: a race";
}

std::vector<Fp8Case> fp8_grid() {
  std::vector<Fp8Case> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  int n = 0;
  for (int64_t d : {64, 128}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 77}, {17, 130}, {127, 64}, {128, 128}, {300, 129},
                          {1000, 333}, {65, 1000}, {257, 513}}) {
      for (Mask m : masks) {
        // GQA (4 query heads on 2) and MQA (6 on 1) in turn.
        const bool mqa = n % 2 == 1;
        cases.push_back({{2, nq, nk, mqa ? 6 : 4, mqa ? 1 : 2, d, layouts[n % 3], m, DType::bf16}});
        ++n;
      }
    }
  }
  // More work items (query-tile pairs: batch · heads · pairs) than an H200 has multiprocessors (132), so
  // that persistent blocks take several and the K/V ring runs on from one item into the next.
  cases.push_back({{4, 256, 300, 40, 8, 128, Layout::bshd, Mask::bottom_right, DType::bf16}});
  cases.push_back({{4, 200, 520, 40, 8, 64, Layout::bhsd, Mask::none, DType::bf16}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, Fp8VsReference, ::testing::ValuesIn(fp8_grid()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(KeyBlock192, Fp8VsReference, ::testing::ValuesIn(with_key_block_192(fp8_grid())),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_case_name(info.param); });

// No queries: nothing is written. No keys: O is zero and logsumexp -inf (outputs start poisoned).
TEST(Fp8Attention, EmptySequences) {
  SKIP_WITHOUT_HOPPER();
  for (int64_t d : {64, 128}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{0, 70}, std::pair<int64_t, int64_t>{70, 0}}) {
      Tensor q = Tensor::empty({2, nq, 4, d}, DType::f8e4m3, Device::cuda);
      Tensor k = Tensor::empty({2, nk, 2, d}, DType::f8e4m3, Device::cuda), v = Tensor::empty({2, nk, 2, d}, DType::f8e4m3, Device::cuda);
      Tensor o = Tensor::empty({2, nq, 4, d}, DType::bf16, Device::cuda), lse = Tensor::empty({2, 4, nq}, DType::f32, Device::cuda);
      for (const Tensor* t : {&q, &k, &v}) fill_normal(*t, 5);
      fill_value(o, 7.0);
      fill_value(lse, 7.0);
      attention_forward(q, k, v, o, lse);
      const std::string what = fmt::format("d {} nq {} nk {}", d, nq, nk);
      Tensor h = to_f64(o.view());
      for (int64_t i = 0; i < h.view().numel(); ++i) ASSERT_EQ(h.view().ptr<double>()[i], 0.0) << what;
      Tensor l = to_f64(lse.view());
      for (int64_t i = 0; i < l.view().numel(); ++i) ASSERT_EQ(l.view().ptr<double>()[i], -INFINITY) << what;
    }
  }
}

// FLASHLM_FP8_KEY_BLOCK other than auto, 128 or 192 is an error naming the variable (read at each forward, before
// anything is launched).
TEST(Fp8Attention, UnknownKeyBlockIsAnError) {
  SKIP_WITHOUT_HOPPER();
  const ScopedFp8KeyBlock scoped(256);
  Tensor q = Tensor::empty({1, 64, 2, 128}, DType::f8e4m3, Device::cuda);
  Tensor k = Tensor::empty({1, 64, 2, 128}, DType::f8e4m3, Device::cuda);
  Tensor o = Tensor::empty({1, 64, 2, 128}, DType::bf16, Device::cuda);
  Tensor lse = Tensor::empty({1, 2, 64}, DType::f32, Device::cuda);
  fill_normal(q, 5);
  fill_normal(k, 6);
  expect_error([&] { attention_forward(q, k, k, o, lse); }, {"FLASHLM_FP8_KEY_BLOCK: unknown value '256'"});
}

// What an fp8 call refuses on the GPU: a head dim without a kernel (the forward's are 64 and 128; the
// backward's the 16-bit backward's, 16 to 256, unpadded), and any impl but flash.
TEST(Fp8Attention, GpuRefusesWhatItHasNoKernelFor) {
  SKIP_WITHOUT_GPU();
  Tensor q = Tensor::empty({1, 8, 2, 32}, DType::f8e4m3, Device::cuda);
  Tensor o = Tensor::empty({1, 8, 2, 32}, DType::bf16, Device::cuda), lse = Tensor::empty({1, 2, 8}, DType::f32, Device::cuda);
  expect_error([&] { attention_forward(q, q, q, o, lse); }, {"attention_forward", "q", "head_dim 32"});
  Tensor q64 = Tensor::empty({1, 8, 2, 64}, DType::f8e4m3, Device::cuda);
  Tensor o64 = Tensor::empty({1, 8, 2, 64}, DType::bf16, Device::cuda);
  AttentionOptions naive;
  naive.impl = AttentionImpl::naive;
  expect_error([&] { attention_forward(q64, q64, q64, o64, lse, naive); }, {"naive", "fp8_e4m3"});
  if (!on_sm90()) {
    expect_error([&] { attention_forward(q64, q64, q64, o64, lse); }, {"fp8_e4m3", "sm_90"});
  }
  Tensor g = Tensor::empty({1, 8, 2, 64}, DType::bf16, Device::cuda), dout = Tensor::empty({1, 8, 2, 64}, DType::bf16, Device::cuda);
  expect_error([&] { attention_backward(q64, q64, q64, o64, lse, dout, g, g, g, naive); },
               {"attention_backward", "the naive attention kernels do not take dtype fp8_e4m3"});
  Tensor q48 = Tensor::empty({1, 8, 2, 48}, DType::f8e4m3, Device::cuda);
  Tensor b48 = Tensor::empty({1, 8, 2, 48}, DType::bf16, Device::cuda);
  Tensor g48 = Tensor::empty({1, 8, 2, 48}, DType::bf16, Device::cuda), dk48 = Tensor::empty({1, 8, 2, 48}, DType::bf16, Device::cuda);
  Tensor dv48 = Tensor::empty({1, 8, 2, 48}, DType::bf16, Device::cuda);
  expect_error([&] { attention_backward(q48, q48, q48, b48, lse, b48, g48, dk48, dv48); },
               {"attention_backward", "q: head_dim 48 has no cuda backward kernel for fp8_e4m3",
                "compiled for head dims 16, 32, 64, 128, 256"});
  // The variants the fp8 kernels lack, in the backward as in the forward: by the option's name.
  AttentionOptions window;
  window.window_size_left = 4;
  expect_error([&] { attention_backward(q64, q64, q64, o64, lse, dout, g, g, g, window); },
               {"attention_backward", "window_size_left/window_size_right", "the fp8 attention kernels"});
  AttentionOptions softcap;
  softcap.softcap = 20;
  expect_error([&] { attention_backward(q64, q64, q64, o64, lse, dout, g, g, g, softcap); },
               {"attention_backward", "softcap", "the fp8 attention kernels"});
  // Gradients in a dtype the fp8 backward does not write (the common checks, as on the CPU).
  Tensor h = Tensor::empty({1, 8, 2, 64}, DType::f16, Device::cuda);
  expect_error([&] { attention_backward(q64, q64, q64, o64, lse, dout, h, h, h); },
               {"attention_backward", "dq", "bf16 or fp32"});
}

// ---- The CPU: forward and backward, both impls, against the fp64 reference of the dequantised inputs. ----

// q and k as FP8 recipes store them, spread over the range with a small descale (amax / 448-like), v with a
// descale above 1; none a power of two, so that dequantising rounds in fp32.
constexpr float kCpuQDescale = 0.037f, kCpuKDescale = 0.026f, kCpuVDescale = 2.5f;

// Random e4m3 inputs (never zeros) with the range's ends mixed in: normals of stddev `stddev`, then a few
// elements at ±448 and ±416 (the two largest magnitudes) and more at subnormals (2^-9 .. 7 · 2^-9), placed by
// the element's index so that every tensor, layout and shape gets some.
void fill_fp8(const TensorView& t, uint64_t seed, double stddev) {
  fill_normal(t, seed, stddev);
  auto* bits = static_cast<uint8_t*>(t.data);
  for_each_offset(t, [&](int64_t offset, int64_t n) {
    const auto sign = static_cast<uint8_t>(n % 2 == 0 ? 0x00 : 0x80);
    if (n % 101 == 7) bits[offset] = static_cast<uint8_t>(sign | (n % 3 == 0 ? 0x7d : 0x7e));
    else if (n % 13 == 2) bits[offset] = static_cast<uint8_t>(sign | (1 + n % 7));
    else if ((bits[offset] & 0x7f) == 0) bits[offset] = static_cast<uint8_t>(sign | 0x38);  // 0 becomes ±1
  });
}

// Everything one fp8 call reads and writes: q, k, v e4m3 in `layout` (rows 16-byte aligned, as CUDA needs), o and
// dout bf16, the gradients in `grad` (bf16 or fp32), lse fp32; the outputs poisoned with NaN.
struct Fp8Problem {
  LaidOut q, k, v, o, dout, dq, dk, dv;
  Tensor lse;
  Fp8Problem(const Case& c, DType grad, uint64_t seed)
      : q(fp8_laid_out(c.layout, c.B, c.Nq, c.Hq, c.D)),
        k(fp8_laid_out(c.layout, c.B, c.Nk, c.Hk, c.D)),
        v(fp8_laid_out(c.layout, c.B, c.Nk, c.Hk, c.D)),
        o(make_laid_out(c.layout, c.B, c.Nq, c.Hq, c.D, DType::bf16)),
        dout(make_laid_out(c.layout, c.B, c.Nq, c.Hq, c.D, DType::bf16)),
        dq(make_laid_out(c.layout, c.B, c.Nq, c.Hq, c.D, grad)),
        dk(make_laid_out(c.layout, c.B, c.Nk, c.Hk, c.D, grad)),
        dv(make_laid_out(c.layout, c.B, c.Nk, c.Hk, c.D, grad)),
        lse(Tensor::empty({c.B, c.Hq, c.Nq}, DType::f32)) {
    // q and k of stddev 24 and 40 (dequantised ~0.9 and ~1: scores of order 1, softmaxes neither flat nor
    // one-hot; ±448 dequantises to 16.6 and 11.6), v of stddev 4 (dequantised 10, ±448 to 1120).
    fill_fp8(q.view, seed, 24.0);
    fill_fp8(k.view, seed + 1, 40.0);
    fill_fp8(v.view, seed + 2, 4.0);
    fill_normal(dout.view, seed + 3);
  }
  // The same inputs (the same bits) with gradients in `grad`.
  Fp8Problem(const Fp8Problem& src, const Case& c, DType grad) : Fp8Problem(c, grad, 0) {
    for (auto [to, from] : {std::pair{&q, &src.q}, {&k, &src.k}, {&v, &src.v}, {&dout, &src.dout}}) {
      copy_into(to->view, from->view);
    }
  }
  // NaN in every output: an element the call forgets to write fails the comparison.
  void poison() {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (auto* t : {&o, &dq, &dk, &dv}) fill_value(t->view, nan);
    fill_value(lse, nan);
  }
  void run(AttentionOptions opt) {
    opt.q_descale = kCpuQDescale;
    opt.k_descale = kCpuKDescale;
    opt.v_descale = kCpuVDescale;
    poison();
    attention_forward(q.view, k.view, v.view, o.view, lse, opt);
    attention_backward(q.view, k.view, v.view, o.view, lse, dout.view, dq.view, dk.view, dv.view, opt);
  }
  // The fp64 reference problem (BSHD): the dequantised q, k, v and dout (bf16, exact in fp64), run by the naive
  // fp64 attention with `naive`'s options.
  Problem reference(const Case& c, const AttentionOptions& naive) const {
    Case c64 = c;
    c64.dtype = DType::f64;
    Problem ref(c64, Layout::bshd, DType::f64, 0);
    copy_into(ref.q.view, dequantised(q.view, kCpuQDescale));
    copy_into(ref.k.view, dequantised(k.view, kCpuKDescale));
    copy_into(ref.v.view, dequantised(v.view, kCpuVDescale));
    copy_into(ref.dout.view, dout.view);
    ref.run(naive);
    return ref;
  }
};

// An Fp8Problem's tensors (host or device) as the C ABI's, and its forward and backward through it.
struct CCall {
  flashlm_tensor q, k, v, o, lse, dout, dq, dk, dv;
  template <class Fp8Tensors>  // an Fp8Problem, or its device copies (Fp8OnDevice)
  explicit CCall(const Fp8Tensors& p)
      : q(c_tensor(p.q.view)), k(c_tensor(p.k.view)), v(c_tensor(p.v.view)), o(c_tensor(p.o.view)),
        lse(c_tensor(p.lse.view())), dout(c_tensor(p.dout.view)), dq(c_tensor(p.dq.view)), dk(c_tensor(p.dk.view)),
        dv(c_tensor(p.dv.view)) {}
  flashlm_status forward(const flashlm_attention_options& opt) const {
    return flashlm_attention_forward(&q, &k, &v, &o, &lse, &opt);
  }
  flashlm_status backward(const flashlm_attention_options& opt) const {
    return flashlm_attention_backward(&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv, &opt);
  }
};

// o, lse and the gradients of two runs of the same inputs, bit for bit.
void expect_same_outputs(const Fp8Problem& a, const Fp8Problem& b) {
  for (auto [name, x, y] : {std::tuple{"o", &a.o, &b.o}, {"dq", &a.dq, &b.dq}, {"dk", &a.dk, &b.dk},
                            {"dv", &a.dv, &b.dv}}) {
    EXPECT_EQ(max_abs_diff(x->view, y->view), 0.0) << name;
  }
  EXPECT_EQ(max_abs_diff(a.lse, b.lse), 0.0) << "lse";
}

// Every element of `got` within the rounding of one conversion of `want` to got's dtype: |got - want| <= u · |want|
// + the dtype's smallest subnormal (a value below the dtype's range rounds to it or to 0), u = 2^-8 for bf16 (its
// unit roundoff 2^-9, twice for the conversion through fp32) and 2^-23 for fp32.
void expect_rounded_once(const TensorView& got, const TensorView& want, const std::string& what) {
  const double u = got.dtype == DType::bf16 ? 0x1p-8 : 0x1p-23;
  const double tiny = got.dtype == DType::bf16 ? 0x1p-133 : 0x1p-149;
  Tensor a = to_f64(got), b = to_f64(want);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.view().ptr<double>()[i], y = b.view().ptr<double>()[i];
    const bool ok = x == y || std::fabs(x - y) <= u * std::fabs(y) + tiny;  // x == y: -inf lse
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements beyond one rounding, the first [" << first << "] "
                    << (first >= 0 ? a.view().ptr<double>()[first] : 0.0) << " against "
                    << (first >= 0 ? b.view().ptr<double>()[first] : 0.0);
}

// The max over the elements of |got - want| less the element's allowance (`allowed` like want, or empty for none);
// infinite where an element is NaN (the poison of an element left unwritten).
double error_beyond_allowance(const TensorView& got_view, const TensorView& want_view, const TensorView& allowed) {
  const Tensor got = to_f64(got_view), want = to_f64(want_view);
  double err = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double d = std::fabs(got.view().ptr<double>()[i] - want.view().ptr<double>()[i]) -
                     (allowed.numel() > 0 ? allowed.ptr<const double>()[i] : 0.0);
    err = std::isnan(d) ? INFINITY : std::max(err, d);
  }
  return err;
}

std::string fp8_cpu_case_name(const Fp8Case& f) { return fp8_case_name(f) + "_grad_" + std::string(dtype_name(f.c.dtype)); }

class Fp8CpuVsReference : public ::testing::TestWithParam<Fp8Case> {};

// The naive impl computes in fp64 on the dequantised values, the reference's very arithmetic: its o, lse and
// gradients are the reference's rounded once to their dtypes. The flash impl computes in fp32 (the dequantised
// values rounded once to fp32) and its backward reads o in bf16, as the 16-bit paths read their o: bounded by
// SPEC §3's low-precision rule, twice the error of the naive attention in the same precision (bf16 o, bf16
// gradients) plus 1e-3, and for dq and dk delta_rounding_allowance beyond it: Delta = rowsum(dO∘O) reads o's
// bf16 values (2^-9 relative each) and, where o is large (v's ±448 · 2.5), that error in every dS = P∘(dP -
// Delta) outgrows a rounding of the gradients (measured: with o in fp32 the flash gradients are within 1e-6
// relative). The fp32 gradients take the same bound, fp32 storage not undoing o's rounding; that they are the
// bf16 gradients before their rounding is checked exactly. lse: fp32 scores, 1e-4 relative; -inf exactly where
// the reference has it.
TEST_P(Fp8CpuVsReference, MatchesFp64ReferenceOfTheDequantisedInputs) {
  const Case c = GetParam().c;
  const std::string name = fp8_cpu_case_name(GetParam());
  const AttentionOptions naive = options_for(c.mask, AttentionImpl::naive);
  const AttentionOptions flash = options_for(c.mask, AttentionImpl::flash);

  Fp8Problem ours_flash(c, c.dtype, 7000 + static_cast<uint64_t>(c.Nq * 7 + c.Nk + c.D));
  ours_flash.run(flash);
  Fp8Problem ours_naive(ours_flash, c, c.dtype);
  ours_naive.run(naive);
  Fp8Problem naive_bf16(ours_flash, c, DType::bf16);  // the low-precision baseline: bf16 o and gradients
  naive_bf16.run(naive);
  const Problem ref = ours_flash.reference(c, options_for(c.mask, AttentionImpl::naive));

  expect_rounded_once(ours_naive.o.view, ref.o.view, "naive o of " + name);
  expect_rounded_once(ours_naive.lse, ref.lse, "naive lse of " + name);
  expect_rounded_once(ours_naive.dq.view, ref.dq.view, "naive dq of " + name);
  expect_rounded_once(ours_naive.dk.view, ref.dk.view, "naive dk of " + name);
  expect_rounded_once(ours_naive.dv.view, ref.dv.view, "naive dv of " + name);

  // dq and dk also get delta_rounding_allowance, element by element: the error beyond it is held to the rule.
  const DeltaRoundingAllowance allowance = delta_rounding_allowance(c, ref, DType::bf16);
  const Tensor none = Tensor::empty({0}, DType::f64);
  struct Item {
    const char* what;
    const TensorView &got, &want, &lowp, &allowed;
  };
  for (const Item& t : {Item{"o", ours_flash.o.view, ref.o.view, naive_bf16.o.view, none.view()},
                        Item{"dq", ours_flash.dq.view, ref.dq.view, naive_bf16.dq.view, allowance.dq.view()},
                        Item{"dk", ours_flash.dk.view, ref.dk.view, naive_bf16.dk.view, allowance.dk.view()},
                        Item{"dv", ours_flash.dv.view, ref.dv.view, naive_bf16.dv.view, none.view()}}) {
    const double low = max_abs_diff(t.lowp, t.want);
    const double err = error_beyond_allowance(t.got, t.want, t.allowed);
    EXPECT_LE(err, tolerance(DType::bf16, low, max_abs(t.want)))
        << "flash " << t.what << " of " << name << " (beyond the Delta allowance; naive bf16 error " << low
        << ", max |ref| " << max_abs(t.want) << ")";
  }
  Tensor lse_ours = to_f64(ours_flash.lse), lse_ref = to_f64(ref.lse);
  int64_t bad = 0;
  for (int64_t i = 0; i < lse_ref.numel(); ++i) {
    const double a = lse_ours.view().ptr<double>()[i], b = lse_ref.view().ptr<double>()[i];
    bad += std::isinf(b) ? a != b : !(std::fabs(a - b) <= 1e-4 * std::max(1.0, std::fabs(b)));
  }
  EXPECT_EQ(bad, 0) << "flash lse of " << name << ": elements off the reference";

  if (c.dtype == DType::f32) {  // the fp32 gradients rounded to bf16 are the bf16 run's, bit for bit
    Fp8Problem flash_bf16(ours_flash, c, DType::bf16);
    flash_bf16.run(flash);
    for (auto [what, f32, b16] : {std::tuple{"dq", &ours_flash.dq, &flash_bf16.dq},
                                  {"dk", &ours_flash.dk, &flash_bf16.dk}, {"dv", &ours_flash.dv, &flash_bf16.dv}}) {
      LaidOut rounded = make_laid_out(Layout::bshd, b16->view.size(0), b16->view.size(1), b16->view.size(2),
                                      b16->view.size(3), DType::bf16);
      copy_into(rounded.view, f32->view);
      EXPECT_EQ(max_abs_diff(rounded.view, b16->view), 0.0) << "flash " << what << " of " << name;
    }
  }
}

std::vector<Fp8Case> fp8_cpu_grid() {
  std::vector<Fp8Case> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  const int64_t head_dims[] = {16, 64, 40};  // the CPU takes any head dim, not only the GPU kernel's 64 and 128
  int n = 0;
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 17}, {17, 130}, {130, 17}, {33, 33}}) {
    for (Mask m : masks) {
      const bool mqa = n % 2 == 1;  // GQA (4 query heads on 2) and MQA (3 on 1) in turn
      const DType grad = n % 2 == 0 ? DType::bf16 : DType::f32;
      cases.push_back({{2, nq, nk, mqa ? 3 : 4, mqa ? 1 : 2, head_dims[n % 3], layouts[(n + n / 3) % 3], m, grad}});
      ++n;
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, Fp8CpuVsReference, ::testing::ValuesIn(fp8_cpu_grid()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_cpu_case_name(info.param); });

// ---- Per-head descales (AttentionOptions::*_descale_heads) on the CPU. ----

// fp32 [batch, heads_k] descales, element (b, hk) = base · (1 + 0.37 b + 0.23 hk): distinct per head, none a
// power of two.
Tensor head_descales(int64_t batch, int64_t heads_k, double base) {
  Tensor t = Tensor::empty({batch, heads_k}, DType::f32);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads_k; ++h) {
      t.view().ptr<float>()[b * heads_k + h] = static_cast<float>(base * (1.0 + 0.37 * double(b) + 0.23 * double(h)));
    }
  }
  return t;
}

// The fp64 BSHD copy of an fp8 [batch, seq, heads, dim] view, head h of batch b times descales(b, h / group).
Tensor dequantised_per_head(const TensorView& t, const Tensor& descales, int64_t group) {
  Tensor x = to_f64(t);
  const int64_t B = t.size(0), N = t.size(1), H = t.size(2), D = t.size(3), hk = descales.view().size(1);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h) {
        const double d = double(descales.view().ptr<const float>()[b * hk + h / group]);
        for (int64_t e = 0; e < D; ++e) x.view().ptr<double>()[((b * N + n) * H + h) * D + e] *= d;
      }
    }
  }
  return x;
}

// A copy of t (fp32 [batch, heads_k]) on `device`.
Tensor copied_to(const Tensor& t, Device device) {
  Tensor out = Tensor::empty({t.view().size(0), t.view().size(1)}, DType::f32, device);
  copy_into(out.view(), t.view());
  return out;
}

struct PerHeadDescales {
  Tensor q, k, v;
  PerHeadDescales(int64_t batch, int64_t heads_k)
      : q(head_descales(batch, heads_k, kCpuQDescale)),
        k(head_descales(batch, heads_k, kCpuKDescale)),
        v(head_descales(batch, heads_k, kCpuVDescale)) {}
  // The same descales in `device`'s memory.
  PerHeadDescales(const PerHeadDescales& host, Device device)
      : q(copied_to(host.q, device)), k(copied_to(host.k, device)), v(copied_to(host.v, device)) {}
  AttentionOptions on(AttentionOptions opt) const {
    opt.q_descale_heads = q.view();
    opt.k_descale_heads = k.view();
    opt.v_descale_heads = v.view();
    return opt;
  }
};

// The fp64 reference problem (BSHD) of `p`'s inputs with per-head descales `d` (host memory): q, k and v
// dequantised head by head, dout as it is, run by the naive fp64 attention with c's mask.
Problem per_head_reference(const Case& c, const Fp8Problem& p, const PerHeadDescales& d) {
  Case c64 = c;
  c64.dtype = DType::f64;
  Problem ref(c64, Layout::bshd, DType::f64, 0);
  copy_into(ref.q.view, dequantised_per_head(p.q.view, d.q, c.Hq / c.Hk));
  copy_into(ref.k.view, dequantised_per_head(p.k.view, d.k, 1));
  copy_into(ref.v.view, dequantised_per_head(p.v.view, d.v, 1));
  copy_into(ref.dout.view, p.dout.view);
  ref.run(options_for(c.mask, AttentionImpl::naive));
  return ref;
}

// The naive impl on per-head descales against the fp64 reference of the inputs dequantised head by head: o,
// lse and the gradients rounded once (the naive impl's arithmetic is the reference's, in fp64, on the
// dequantised copies), over GQA and MQA groups, both causal alignments and three layouts.
TEST(Fp8AttentionCpu, PerHeadDescalesMatchTheReferenceOfHeadByHeadDequantisedInputs) {
  for (const Fp8Case& f : fp8_cpu_grid()) {
    const Case& c = f.c;
    const std::string name = fp8_cpu_case_name(f);
    const PerHeadDescales d(c.B, c.Hk);
    Fp8Problem ours(c, c.dtype, 9100 + static_cast<uint64_t>(c.Nq * 5 + c.Nk + c.D));
    ours.poison();
    const AttentionOptions opt = d.on(options_for(c.mask, AttentionImpl::naive));
    attention_forward(ours.q.view, ours.k.view, ours.v.view, ours.o.view, ours.lse, opt);
    attention_backward(ours.q.view, ours.k.view, ours.v.view, ours.o.view, ours.lse, ours.dout.view, ours.dq.view,
                       ours.dk.view, ours.dv.view, opt);
    const Problem ref = per_head_reference(c, ours, d);
    expect_rounded_once(ours.o.view, ref.o.view, "o of " + name);
    expect_rounded_once(ours.lse, ref.lse, "lse of " + name);
    expect_rounded_once(ours.dq.view, ref.dq.view, "dq of " + name);
    expect_rounded_once(ours.dk.view, ref.dk.view, "dk of " + name);
    expect_rounded_once(ours.dv.view, ref.dv.view, "dv of " + name);
  }
}

// Per-head descales that are all one value give the per-tensor descale's bits, both impls, both passes.
TEST(Fp8AttentionCpu, UniformPerHeadDescalesAreThePerTensorOnes) {
  const Case c{2, 17, 130, 4, 2, 64, Layout::bhsd, Mask::bottom_right, DType::bf16};
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash}) {
    Fp8Problem scalar(c, DType::bf16, 77);
    scalar.run(options_for(c.mask, impl));
    Fp8Problem heads(scalar, c, DType::bf16);
    heads.poison();
    Tensor q = Tensor::empty({c.B, c.Hk}, DType::f32), k = Tensor::empty({c.B, c.Hk}, DType::f32),
           v = Tensor::empty({c.B, c.Hk}, DType::f32);
    fill_value(q, kCpuQDescale);
    fill_value(k, kCpuKDescale);
    fill_value(v, kCpuVDescale);
    AttentionOptions opt = options_for(c.mask, impl);
    opt.q_descale_heads = q.view();
    opt.k_descale_heads = k.view();
    opt.v_descale_heads = v.view();
    attention_forward(heads.q.view, heads.k.view, heads.v.view, heads.o.view, heads.lse, opt);
    attention_backward(heads.q.view, heads.k.view, heads.v.view, heads.o.view, heads.lse, heads.dout.view,
                       heads.dq.view, heads.dk.view, heads.dv.view, opt);
    SCOPED_TRACE(std::string(attention_impl_name(impl)));
    expect_same_outputs(heads, scalar);
  }
}

// The C ABI (version 6) passes the per-head descales: the same bits as the C++ call, a bad one named.
TEST(Fp8AttentionCpu, PerHeadDescalesThroughTheCAbi) {
  const Case c{2, 17, 33, 4, 2, 32, Layout::bshd, Mask::top_left, DType::f32};
  const PerHeadDescales d(c.B, c.Hk);
  Fp8Problem api(c, DType::f32, 31), abi(api, c, DType::f32);
  const AttentionOptions flash = options_for(c.mask, AttentionImpl::flash);
  api.poison();
  attention_forward(api.q.view, api.k.view, api.v.view, api.o.view, api.lse, d.on(flash));
  attention_backward(api.q.view, api.k.view, api.v.view, api.o.view, api.lse, api.dout.view, api.dq.view,
                     api.dk.view, api.dv.view, d.on(flash));

  EXPECT_EQ(flashlm_abi_version(), 6);
  flashlm_attention_options opt = flashlm_attention_options_default();
  EXPECT_EQ(opt.q_descale_heads, nullptr);
  EXPECT_EQ(opt.k_descale_heads, nullptr);
  EXPECT_EQ(opt.v_descale_heads, nullptr);
  opt.causal = 1;
  const flashlm_tensor qd = c_tensor(d.q.view()), kd = c_tensor(d.k.view()), vd = c_tensor(d.v.view());
  opt.q_descale_heads = &qd;
  opt.k_descale_heads = &kd;
  opt.v_descale_heads = &vd;
  abi.poison();
  const CCall call(abi);
  ASSERT_EQ(call.forward(opt), FLASHLM_OK) << flashlm_last_error();
  ASSERT_EQ(call.backward(opt), FLASHLM_OK) << flashlm_last_error();
  expect_same_outputs(api, abi);
  opt.v_descale = 2.0f;  // beside v's per-head descales: one or the other
  EXPECT_EQ(call.forward(opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("v_descale_heads"), std::string::npos) << flashlm_last_error();
}

TEST(Fp8Attention, PerHeadDescalesBadArgumentsAreClearErrors) {
  Tensor q = Tensor::empty({2, 8, 4, 64}, DType::f8e4m3), k = Tensor::empty({2, 8, 2, 64}, DType::f8e4m3);
  Tensor o = Tensor::empty({2, 8, 4, 64}, DType::bf16), lse = Tensor::empty({2, 4, 8}, DType::f32);
  fill_normal(q, 1);
  fill_normal(k, 2);
  Tensor good = Tensor::empty({2, 2}, DType::f32);
  fill_value(good, 0.5);
  AttentionOptions opt;
  opt.k_descale_heads = good.view();
  attention_forward(q, k, k, o, lse, opt);  // the good one runs

  Tensor per_q_head = Tensor::empty({2, 4}, DType::f32), flat = Tensor::empty({4}, DType::f32);
  Tensor f64 = Tensor::empty({2, 2}, DType::f64);
  fill_value(per_q_head, 0.5);
  fill_value(flat, 0.5);
  fill_value(f64, 0.5);
  AttentionOptions bad;
  bad.q_descale_heads = per_q_head.view();
  expect_error([&] { attention_forward(q, k, k, o, lse, bad); },
               {"attention_forward", "q_descale_heads", "expected shape [2, 2] (batch, heads_k)", "[2, 4]"});
  bad.q_descale_heads = flat.view();
  expect_error([&] { attention_forward(q, k, k, o, lse, bad); }, {"q_descale_heads", "[batch, heads_k]"});
  bad.q_descale_heads = f64.view();
  expect_error([&] { attention_forward(q, k, k, o, lse, bad); }, {"q_descale_heads", "expected dtype fp32"});
  bad = {};
  bad.v_descale_heads = good.view();
  bad.v_descale = 2.0f;
  expect_error([&] { attention_forward(q, k, k, o, lse, bad); }, {"v_descale_heads", "per-tensor descale 2"});
  for (float x : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    Tensor one_bad = Tensor::empty({2, 2}, DType::f32);
    fill_value(one_bad, 0.5);
    one_bad.view().ptr<float>()[3] = x;
    AttentionOptions o1;
    o1.k_descale_heads = one_bad.view();
    expect_error([&] { attention_forward(q, k, k, o, lse, o1); },
                 {"k_descale_heads", "batch 1 head 1", "finite number > 0"});
  }
  // Not fp8: refused by name whatever the shape.
  Tensor qb = Tensor::empty({2, 8, 4, 64}, DType::bf16), kb = Tensor::empty({2, 8, 2, 64}, DType::bf16);
  fill_normal(qb, 3);
  fill_normal(kb, 4);
  AttentionOptions on16;
  on16.q_descale_heads = good.view();
  expect_error([&] { attention_forward(qb, kb, kb, o, lse, on16); },
               {"q_descale_heads", "fp8_e4m3 inputs only", "bf16"});
  // An output may not overlap them (here: lse's first elements are the descales).
  fill_value(lse, 0.5);
  AttentionOptions overlap;
  overlap.q_descale_heads = TensorView::contiguous(lse.data(), DType::f32, {2, 2}, Device::cpu);
  expect_error([&] { attention_forward(q, k, k, o, lse, overlap); }, {"lse", "overlaps the input q_descale_heads"});
}

// ---- The CUDA backward: the 16-bit flash kernels on exact bf16 copies, descales in their scale factors. ----

std::string fp8_cuda_case_name(const Fp8Case& f) {
  return fp8_cpu_case_name(f) + (f.deterministic ? "_deterministic" : "") + (f.mma ? "_mma" : "");
}

// Device copies of a host Fp8Problem's inputs (o and lse as the host holds them) and of its gradients, poisoned.
struct Fp8OnDevice {
  LaidOut q, k, v, o, dout, dq, dk, dv;
  Tensor lse;
  explicit Fp8OnDevice(Fp8Problem& host)
      : q(to_device(host.q)), k(to_device(host.k)), v(to_device(host.v)), o(to_device(host.o)),
        dout(to_device(host.dout)), dq(poisoned(host.dq)), dk(poisoned(host.dk)), dv(poisoned(host.dv)),
        lse(Tensor::empty({host.lse.view().size(0), host.lse.view().size(1), host.lse.view().size(2)}, DType::f32,
                          Device::cuda)) {
    copy_into(lse.view(), host.lse.view());
  }
  static LaidOut poisoned(LaidOut& host) {
    fill_value(host.view, std::numeric_limits<double>::quiet_NaN());  // an element the call forgets fails
    return to_device(host);
  }
  static AttentionOptions options(Mask mask, bool deterministic) {
    AttentionOptions opt = options_for(mask, AttentionImpl::flash);
    opt.q_descale = kCpuQDescale;
    opt.k_descale = kCpuKDescale;
    opt.v_descale = kCpuVDescale;
    opt.deterministic = deterministic;
    return opt;
  }
  void backward(const AttentionOptions& opt) {
    attention_backward(q.view, k.view, v.view, o.view, lse, dout.view, dq.view, dk.view, dv.view, opt);
  }
  void copy_gradients_back(Fp8Problem& host) const {
    copy_back(host.dq, dq);
    copy_back(host.dk, dk);
    copy_back(host.dv, dv);
  }
};

// Each of dq, dk, dv within the CPU flash backward's bound (Fp8CpuVsReference above: the low-precision rule
// against the naive attention with bf16 gradients, dq and dk beyond delta_rounding_allowance, o being bf16), in
// cuda_flash_tolerance's form, which adds 4 bf16 unit roundoffs of the result's scale for the kernels' bf16 P
// and dS in their GEMMs. fp32 gradients take the same bound: they hold the bf16 kernels' values. `naive_bf16` (an
// Fp8Problem or a Problem) holds the low-precision baseline's gradients.
template <class Baseline>
void expect_gradients_within_bound(const Case& c, const Fp8Problem& ours, const Baseline& naive_bf16,
                                   const Problem& ref, const std::string& name) {
  const DeltaRoundingAllowance allowance = delta_rounding_allowance(c, ref, DType::bf16);
  const Tensor none = Tensor::empty({0}, DType::f64);
  struct Item {
    const char* what;
    const TensorView &got, &want, &lowp, &allowed;
  };
  for (const Item& t : {Item{"dq", ours.dq.view, ref.dq.view, naive_bf16.dq.view, allowance.dq.view()},
                        Item{"dk", ours.dk.view, ref.dk.view, naive_bf16.dk.view, allowance.dk.view()},
                        Item{"dv", ours.dv.view, ref.dv.view, naive_bf16.dv.view, none.view()}}) {
    const double low = max_abs_diff(t.lowp, t.want);
    const double err = error_beyond_allowance(t.got, t.want, t.allowed);
    EXPECT_LE(err, cuda_flash_tolerance(DType::bf16, low, max_abs(t.want)))
        << "cuda " << t.what << " of " << name << " (beyond the Delta allowance; naive bf16 error " << low
        << ", max |ref| " << max_abs(t.want) << ")";
  }
}

// The CUDA backward of `host` (its inputs, o and lse) with `opt` (flash, f's deterministic mode and kernel choice),
// its gradients copied into host's; where deterministic, run again on fresh copies: no atomics, the same bits.
void backward_on_device(const Fp8Case& f, Fp8Problem& host, const AttentionOptions& opt, const std::string& name) {
  Fp8OnDevice dev(host);
  with_kernel_choice(f.mma ? "mma" : "auto", [&] { dev.backward(opt); });
  dev.copy_gradients_back(host);
  if (!f.deterministic) return;
  Fp8Problem again(host, f.c, f.c.dtype);
  copy_into(again.o.view, host.o.view);
  copy_into(again.lse.view(), host.lse.view());
  Fp8OnDevice dev2(again);
  with_kernel_choice(f.mma ? "mma" : "auto", [&] { dev2.backward(opt); });
  dev2.copy_gradients_back(again);
  for (auto [what, a, b] : {std::tuple{"dq", &host.dq, &again.dq}, {"dk", &host.dk, &again.dk},
                            {"dv", &host.dv, &again.dv}}) {
    EXPECT_EQ(max_abs_diff(a->view, b->view), 0.0) << "deterministic " << what << " of " << name;
  }
}

class Fp8CudaBackwardVsReference : public ::testing::TestWithParam<Fp8Case> {};

// The CUDA backward against the fp64 reference of the dequantised inputs, fed the o and lse of the CPU's naive
// FP8 forward (the reference's rounded once to bf16 and fp32), so that the bound is the CPU flash backward's and
// the test reads on every GPU, at every backward head dim (the sm_90 forward, head dims 64 and 128 only, is
// chained to it below).
TEST_P(Fp8CudaBackwardVsReference, MatchesFp64ReferenceOfTheDequantisedInputs) {
  SKIP_WITHOUT_GPU();
  const Fp8Case& f = GetParam();
  const Case c = f.c;
  const std::string name = fp8_cuda_case_name(f);
  const AttentionOptions naive = options_for(c.mask, AttentionImpl::naive);
  Fp8Problem ours(c, c.dtype, 8000 + static_cast<uint64_t>(c.Nq * 7 + c.Nk + c.D));
  ours.run(naive);  // o and lse (and gradients, which the device's overwrite)
  Fp8Problem naive_bf16(ours, c, DType::bf16);
  naive_bf16.run(naive);
  const Problem ref = ours.reference(c, naive);

  backward_on_device(f, ours, Fp8OnDevice::options(c.mask, f.deterministic), name);
  expect_gradients_within_bound(c, ours, naive_bf16, ref, name);
}

// Ragged sizes (Nq = 1, 17, 127, Nk != Nq), the three layouts (the sliced view included), no mask and both causal
// alignments, GQA and MQA, bf16 and fp32 gradients, every backward head dim; on sm_90 the Hopper kernels take
// d64 and d128 (where they cover the views), and every third case forces mma.sync there; some deterministic.
std::vector<Fp8Case> fp8_cuda_backward_grid() {
  std::vector<Fp8Case> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  int n = 0;
  for (int64_t d : {64, 128, 32, 256}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 77}, {17, 130}, {127, 64}, {200, 129}}) {
      for (Mask m : masks) {
        if (d >= 256 && nq > 17) continue;  // the largest kernel on a few shapes: the fp64 reference is slow
        const bool mqa = n % 2 == 1;  // GQA (4 query heads on 2) and MQA (3 on 1) in turn
        const DType grad = (n / 2) % 2 == 0 ? DType::bf16 : DType::f32;
        Fp8Case f{{2, nq, nk, mqa ? 3 : 4, mqa ? 1 : 2, d, layouts[(n + n / 3) % 3], m, grad}};
        f.mma = n % 3 == 2;
        f.deterministic = n % 5 == 4;
        cases.push_back(f);
        ++n;
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, Fp8CudaBackwardVsReference, ::testing::ValuesIn(fp8_cuda_backward_grid()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_cuda_case_name(info.param); });

// The sm_90 forward and the CUDA backward chained, as training runs them: the backward's recomputed P must be the
// forward's (its scale carries q_descale·k_descale as the forward's does, and the forward's lse normalises it).
// Against the CPU flash backward given the very o and lse the GPU forward wrote, which computes those gradients
// in fp32: the GPU's may differ by its bf16 gradients, P and dS, the bound of the grid above without the Delta
// allowance (both read the same bf16 o).
TEST(Fp8AttentionCuda, ForwardThenBackwardMatchesTheCpuBackwardOfTheSameForward) {
  SKIP_WITHOUT_HOPPER();
  for (int64_t d : kFp8ForwardHeadDims) {
    for (Mask m : {Mask::none, Mask::bottom_right}) {
      const Case c{2, 150, 201, 4, 2, d, Layout::bhsd, m, DType::f32};
      const std::string name = fmt::format("d {}{}", d, m == Mask::none ? "" : " causal bottom-right");
      Fp8Problem gpu(c, DType::f32, 91 + static_cast<uint64_t>(d));
      Fp8OnDevice dev(gpu);
      const AttentionOptions opt = dev.options(m, false);
      attention_forward(dev.q.view, dev.k.view, dev.v.view, dev.o.view, dev.lse, opt);
      dev.backward(opt);
      dev.copy_gradients_back(gpu);
      copy_back(gpu.o, dev.o);
      copy_into(gpu.lse.view(), dev.lse.view());

      Fp8Problem cpu(gpu, c, DType::f32);  // the same inputs, and the GPU forward's o and lse
      copy_into(cpu.o.view, gpu.o.view);
      copy_into(cpu.lse.view(), gpu.lse.view());
      AttentionOptions cpu_opt = opt;
      attention_backward(cpu.q.view, cpu.k.view, cpu.v.view, cpu.o.view, cpu.lse, cpu.dout.view, cpu.dq.view,
                         cpu.dk.view, cpu.dv.view, cpu_opt);
      Fp8Problem naive_bf16(gpu, c, DType::bf16);  // the size of a bf16 rounding of these gradients
      naive_bf16.run(options_for(m, AttentionImpl::naive));
      const Problem ref = naive_bf16.reference(c, options_for(m, AttentionImpl::naive));
      for (auto [what, got, want, lowp, exact] :
           {std::tuple{"dq", &gpu.dq, &cpu.dq, &naive_bf16.dq, &ref.dq}, {"dk", &gpu.dk, &cpu.dk, &naive_bf16.dk, &ref.dk},
            {"dv", &gpu.dv, &cpu.dv, &naive_bf16.dv, &ref.dv}}) {
        const double low = max_abs_diff(lowp->view, exact->view);
        const double err = max_abs_diff(got->view, want->view);
        EXPECT_LE(err, cuda_flash_tolerance(DType::bf16, low, max_abs(want->view)))
            << "cuda " << what << " of " << name << " against the cpu's of the same o and lse (naive bf16 error "
            << low << ", max " << max_abs(want->view) << ")";
      }
    }
  }
}

// The C ABI's backward on device tensors: the C++ API's gradients, bit for bit (deterministic: no atomics).
TEST(Fp8AttentionCuda, CAbiRunsTheBackward) {
  SKIP_WITHOUT_GPU();
  const Case c{2, 37, 50, 4, 2, 64, Layout::bshd, Mask::bottom_right, DType::f32};
  Fp8Problem host(c, DType::f32, 78);
  host.run(options_for(c.mask, AttentionImpl::naive));  // o and lse for the backward
  Fp8OnDevice api(host), abi(host);
  api.backward(api.options(c.mask, true));
  flashlm_attention_options opt = flashlm_attention_options_default();
  opt.causal = 1;
  opt.causal_align = FLASHLM_BOTTOM_RIGHT;
  opt.deterministic = 1;
  opt.q_descale = kCpuQDescale;
  opt.k_descale = kCpuKDescale;
  opt.v_descale = kCpuVDescale;
  const flashlm_tensor q = c_tensor(abi.q.view), k = c_tensor(abi.k.view), v = c_tensor(abi.v.view);
  const flashlm_tensor o = c_tensor(abi.o.view), lse = c_tensor(abi.lse.view()), dout = c_tensor(abi.dout.view);
  const flashlm_tensor dq = c_tensor(abi.dq.view), dk = c_tensor(abi.dk.view), dv = c_tensor(abi.dv.view);
  ASSERT_EQ(flashlm_attention_backward(&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv, &opt), FLASHLM_OK)
      << flashlm_last_error();
  Fp8Problem from_api(host, c, DType::f32), from_abi(host, c, DType::f32);
  api.copy_gradients_back(from_api);
  abi.copy_gradients_back(from_abi);
  for (auto [name, a, b] : {std::tuple{"dq", &from_api.dq, &from_abi.dq}, {"dk", &from_api.dk, &from_abi.dk},
                            {"dv", &from_api.dv, &from_abi.dv}}) {
    EXPECT_EQ(max_abs_diff(a->view, b->view), 0.0) << name;
    EXPECT_TRUE(all_finite_or_neg_inf(a->view)) << name << ": the poison survived";
  }
  // A bad descale is FLASHLM_INVALID_ARGUMENT with the message naming it, as on the CPU.
  opt.v_descale = -1.0f;
  EXPECT_EQ(flashlm_attention_backward(&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv, &opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("v_descale"), std::string::npos) << flashlm_last_error();
}

// No queries: the keys get zero dk and dv. No keys: dq = 0. On the GPU, the gradients poisoned first.
TEST(Fp8AttentionCuda, BackwardOfEmptySequences) {
  SKIP_WITHOUT_GPU();
  for (DType grad : {DType::bf16, DType::f32}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{0, 70}, std::pair<int64_t, int64_t>{70, 0}}) {
      const Case c{2, nq, nk, 4, 2, 64, Layout::bshd, Mask::none, grad};
      Fp8Problem host(c, grad, 3);
      host.run(options_for(Mask::none, AttentionImpl::naive));
      Fp8OnDevice dev(host);
      dev.backward(dev.options(Mask::none, false));
      dev.copy_gradients_back(host);
      const std::string what = fmt::format("{} gradients, nq {} nk {}", dtype_name(grad), nq, nk);
      for (const TensorView* t : {&host.dq.view, &host.dk.view, &host.dv.view}) {
        Tensor x = to_f64(*t);
        for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(x.view().ptr<double>()[i], 0.0) << what;
      }
    }
  }
}

// The gradients are those of the dequantised values (value = stored · descale): the fp8 backward's fp32 gradients
// against the fp64 reference's on the dequantised inputs, which are checked here against central differences
// of L = Σ O ∘ dO in fp64 with the dequantised values perturbed. A gradient of the stored values would be
// off by the descale (0.037, 0.026, 2.5), far beyond the bound.
TEST(Fp8AttentionCpu, GradientsOfTheDequantisedValuesMatchFiniteDifferences) {
  for (Mask m : {Mask::none, Mask::bottom_right}) {
    const Case c{1, 3, 5, 2, 1, 4, Layout::bshd, m, DType::f32};
    for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash}) {
      Fp8Problem ours(c, DType::f32, 51);
      ours.run(options_for(m, impl));
      Problem ref = ours.reference(c, options_for(m, AttentionImpl::naive));
      // fp64 central differences of step 1e-6: about 1e-10 · |L| of rounding, held to 1e-7 of the gradients' scale.
      const double scale = std::max({1.0, max_abs(ref.dq.view), max_abs(ref.dk.view), max_abs(ref.dv.view)});
      expect_gradients_match_central_differences(ref, options_for(m, AttentionImpl::naive), 1e-7 * scale);
      const std::string what = std::string(attention_impl_name(impl)) + (m == Mask::none ? "" : " causal");
      for (auto [name, got, want] : {std::tuple{"dq", &ours.dq, &ref.dq}, {"dk", &ours.dk, &ref.dk},
                                     {"dv", &ours.dv, &ref.dv}}) {
        // naive: one fp32 rounding; flash: fp32 arithmetic and o's bf16 rounding in Delta (see above).
        const double tol = impl == AttentionImpl::naive ? 0x1p-23 * std::max(1.0, max_abs(want->view))
                                                        : 0x1p-7 * std::max(1.0, max_abs(want->view));
        EXPECT_LE(max_abs_diff(got->view, want->view), tol) << name << " of " << what;
      }
    }
  }
}

// The C ABI takes the same calls (its dtype codes and descales): the C++ API's results, bit for bit.
TEST(Fp8AttentionCpu, CAbiRunsForwardAndBackward) {
  const Case c{2, 17, 30, 4, 2, 24, Layout::bhsd, Mask::bottom_right, DType::f32};
  Fp8Problem api(c, DType::f32, 77);
  api.run(options_for(c.mask, AttentionImpl::flash));
  Fp8Problem abi(api, c, DType::f32);
  abi.poison();
  flashlm_attention_options opt = flashlm_attention_options_default();
  opt.causal = 1;
  opt.causal_align = FLASHLM_BOTTOM_RIGHT;
  opt.q_descale = kCpuQDescale;
  opt.k_descale = kCpuKDescale;
  opt.v_descale = kCpuVDescale;
  const CCall call(abi);
  EXPECT_EQ(call.q.dtype, FLASHLM_FP8_E4M3);
  ASSERT_EQ(call.forward(opt), FLASHLM_OK) << flashlm_last_error();
  ASSERT_EQ(call.backward(opt), FLASHLM_OK) << flashlm_last_error();
  expect_same_outputs(api, abi);
  // A bad descale is FLASHLM_INVALID_ARGUMENT with the message naming it.
  opt.k_descale = 0.0f;
  EXPECT_EQ(call.forward(opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("k_descale"), std::string::npos) << flashlm_last_error();
}

// No queries: nothing is written, the keys get zero dk and dv. No keys: o = 0, lse = -inf, dq = 0.
TEST(Fp8AttentionCpu, EmptySequences) {
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{0, 9}, std::pair<int64_t, int64_t>{9, 0}}) {
      const Case c{2, nq, nk, 4, 2, 24, Layout::bshd, Mask::none, DType::bf16};
      Fp8Problem p(c, DType::bf16, 3);
      p.run(options_for(Mask::none, impl));
      const std::string what = fmt::format("{} nq {} nk {}", attention_impl_name(impl), nq, nk);
      for (const TensorView* t : {&p.o.view, &p.dq.view, &p.dk.view, &p.dv.view}) {
        Tensor x = to_f64(*t);  // element by element: a NaN left by the poison fails too
        for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(x.view().ptr<double>()[i], 0.0) << what;
      }
      Tensor l = to_f64(p.lse.view());
      for (int64_t i = 0; i < l.numel(); ++i) EXPECT_EQ(l.view().ptr<double>()[i], -INFINITY) << what;
    }
  }
}

// ---- Per-head descales on CUDA: the FP8 forward reads each tile's descales at its start; the backward runs the
// 16-bit kernels on bf16 copies of the values dequantised head by head, after a bf16 forward on them
// (attention.cpp, fp8_backward_cuda). ----

// Ragged sizes, no mask and both causal alignments, the three layouts, GQA (4 query heads on 2) and MQA (6 on 1) in
// turn at the forward's head dims, and more work items than an H200 has multiprocessors (132), so that persistent
// blocks take tiles of several batches and key heads, each tile with its own descales.
std::vector<Fp8Case> fp8_per_head_forward_grid() {
  std::vector<Fp8Case> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  int n = 0;
  for (int64_t d : kFp8ForwardHeadDims) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 77}, {17, 130}, {127, 64}, {300, 129}, {65, 1000}}) {
      for (Mask m : masks) {
        const bool mqa = n % 2 == 1;
        cases.push_back({{2, nq, nk, mqa ? 6 : 4, mqa ? 1 : 2, d, layouts[(n + n / 3) % 3], m, DType::bf16}});
        ++n;
      }
    }
  }
  cases.push_back({{4, 256, 300, 40, 8, 128, Layout::bshd, Mask::bottom_right, DType::bf16}});
  cases.push_back({{3, 200, 520, 12, 12, 64, Layout::bhsd, Mask::none, DType::bf16}});
  return cases;
}

class Fp8PerHeadCudaForward : public ::testing::TestWithParam<Fp8Case> {};

// The sm_90 forward with per-head descales against the fp64 reference of the inputs dequantised head by head, within
// expect_fp8_forward_matches_reference's bound: a tile that took another batch's or key head's descales (factors
// 1 + 0.37 b + 0.23 hk apart) is far outside it. Outputs poisoned first.
TEST_P(Fp8PerHeadCudaForward, MatchesFp64ReferenceOfHeadByHeadDequantisedInputs) {
  SKIP_WITHOUT_HOPPER();
  const Case c = GetParam().c;
  const ScopedFp8KeyBlock key_block(GetParam().key_block);
  const PerHeadDescales host(c.B, c.Hk), device(host, Device::cuda);
  Fp8Problem p(c, DType::bf16, 9300 + static_cast<uint64_t>(c.Nq * 7 + c.Nk + c.D));
  p.poison();
  Fp8OnDevice dev(p);
  attention_forward(dev.q.view, dev.k.view, dev.v.view, dev.o.view, dev.lse,
                    device.on(options_for(c.mask, AttentionImpl::flash)));
  copy_back(p.o, dev.o);
  copy_into(p.lse.view(), dev.lse.view());
  expect_fp8_forward_matches_reference(c, to_f64(p.o.view), to_f64(p.lse.view()),
                                       dequantised_per_head(p.q.view, host.q, c.Hq / c.Hk),
                                       dequantised_per_head(p.k.view, host.k, 1),
                                       dequantised_per_head(p.v.view, host.v, 1), fp8_case_name(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Grid, Fp8PerHeadCudaForward, ::testing::ValuesIn(fp8_per_head_forward_grid()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_case_name(info.param); });
INSTANTIATE_TEST_SUITE_P(KeyBlock192, Fp8PerHeadCudaForward,
                         ::testing::ValuesIn(with_key_block_192(fp8_per_head_forward_grid())),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_case_name(info.param); });

// Per-head descales equal in every head give the per-tensor forward's bits on the GPU (the kernel forms a tile's
// factors as make_params forms the per-tensor ones), given for all three tensors or for one beside the others'
// scalars; at both key blocks.
TEST(Fp8PerHeadCuda, UniformDescalesGiveThePerTensorForwardBits) {
  SKIP_WITHOUT_HOPPER();
  for (const auto& [key_block, d] : {std::pair<int, int64_t>{128, 64}, {128, 128}, {192, 64}, {192, 128}}) {
    SCOPED_TRACE(fmt::format("FLASHLM_FP8_KEY_BLOCK={}", key_block));
    const ScopedFp8KeyBlock scoped(key_block);
    const Case c{2, 130, 257, 4, 2, d, Layout::bhsd, Mask::bottom_right, DType::bf16};  // every row sees a key
    Fp8Problem scalar(c, DType::bf16, 57 + static_cast<uint64_t>(d));
    scalar.poison();
    const AttentionOptions per_tensor = Fp8OnDevice::options(c.mask, false);
    {
      Fp8OnDevice dev(scalar);
      attention_forward(dev.q.view, dev.k.view, dev.v.view, dev.o.view, dev.lse, per_tensor);
      copy_back(scalar.o, dev.o);
      copy_into(scalar.lse.view(), dev.lse.view());
    }
    const auto uniform = [&](float value) {
      Tensor t = Tensor::empty({c.B, c.Hk}, DType::f32);
      fill_value(t, value);
      return copied_to(t, Device::cuda);
    };
    const Tensor q = uniform(kCpuQDescale), k = uniform(kCpuKDescale), v = uniform(kCpuVDescale);
    for (int which = 0; which < 4; ++which) {  // q's, k's or v's per head, the others per tensor; then all three
      AttentionOptions opt = per_tensor;
      if (which == 0 || which == 3) {
        opt.q_descale = 1.0f;
        opt.q_descale_heads = q.view();
      }
      if (which == 1 || which == 3) {
        opt.k_descale = 1.0f;
        opt.k_descale_heads = k.view();
      }
      if (which == 2 || which == 3) {
        opt.v_descale = 1.0f;
        opt.v_descale_heads = v.view();
      }
      Fp8Problem heads(scalar, c, DType::bf16);
      heads.poison();
      Fp8OnDevice dev(heads);
      attention_forward(dev.q.view, dev.k.view, dev.v.view, dev.o.view, dev.lse, opt);
      copy_back(heads.o, dev.o);
      copy_into(heads.lse.view(), dev.lse.view());
      EXPECT_EQ(max_abs_diff(heads.o.view, scalar.o.view), 0.0) << "o, d " << d << ", case " << which;
      EXPECT_EQ(max_abs_diff(heads.lse, scalar.lse), 0.0) << "lse, d " << d << ", case " << which;
    }
  }
}

class Fp8PerHeadCudaBackward : public ::testing::TestWithParam<Fp8Case> {};

// The CUDA backward with per-head descales against the fp64 reference of the inputs dequantised head by head. It
// runs the 16-bit kernels on the dequantised values rounded once to bf16 (2^-9 relative), after a bf16 forward on
// them: SPEC §3's low-precision baseline is then the naive attention on those bf16 inputs with bf16 gradients (its
// error against the reference holds the inputs' rounding), and the bound expect_gradients_within_bound's beyond it
// (the kernels' bf16 P and dS, o's rounding in Delta). The CPU forward's o and lse are passed, as the per-tensor
// grid passes them; this route recomputes its own. The per-tensor grid's cases: every backward head dim, bf16 and
// fp32 gradients, mma.sync forced on some, deterministic runs repeated bit for bit.
TEST_P(Fp8PerHeadCudaBackward, MatchesFp64ReferenceOfHeadByHeadDequantisedInputs) {
  SKIP_WITHOUT_GPU();
  const Fp8Case& f = GetParam();
  const Case c = f.c;
  const std::string name = fp8_cuda_case_name(f);
  const PerHeadDescales host(c.B, c.Hk), device(host, Device::cuda);
  Fp8Problem ours(c, c.dtype, 8300 + static_cast<uint64_t>(c.Nq * 7 + c.Nk + c.D));
  const AttentionOptions naive = options_for(c.mask, AttentionImpl::naive);
  ours.poison();
  attention_forward(ours.q.view, ours.k.view, ours.v.view, ours.o.view, ours.lse, host.on(naive));
  const Problem ref = per_head_reference(c, ours, host);
  Case cb = c;
  cb.dtype = DType::bf16;
  Problem bf16_inputs(cb, Layout::bshd, DType::bf16, 0);
  for (auto [to, from] : {std::pair{&bf16_inputs.q, &ref.q}, {&bf16_inputs.k, &ref.k}, {&bf16_inputs.v, &ref.v},
                          {&bf16_inputs.dout, &ref.dout}}) {
    copy_into(to->view, from->view);
  }
  bf16_inputs.run(naive);

  AttentionOptions opt = device.on(options_for(c.mask, AttentionImpl::flash));
  opt.deterministic = f.deterministic;
  backward_on_device(f, ours, opt, name);
  expect_gradients_within_bound(c, ours, bf16_inputs, ref, name);
}

INSTANTIATE_TEST_SUITE_P(Grid, Fp8PerHeadCudaBackward, ::testing::ValuesIn(fp8_cuda_backward_grid()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return fp8_cuda_case_name(info.param); });

// The C ABI on device tensors and device descales: the C++ API's o and lse (an sm_90 GPU) and gradients (any GPU;
// deterministic, no atomics), bit for bit.
TEST(Fp8PerHeadCuda, CAbiGivesTheCppApisBits) {
  SKIP_WITHOUT_GPU();
  const Case c{2, 37, 50, 4, 2, 64, Layout::bshd, Mask::bottom_right, DType::f32};
  const PerHeadDescales host(c.B, c.Hk), device(host, Device::cuda);
  Fp8Problem p(c, DType::f32, 79);
  p.poison();
  attention_forward(p.q.view, p.k.view, p.v.view, p.o.view, p.lse, host.on(options_for(c.mask, AttentionImpl::naive)));
  Fp8OnDevice api(p), abi(p);
  AttentionOptions opt = device.on(options_for(c.mask, AttentionImpl::flash));
  opt.deterministic = true;
  flashlm_attention_options copt = flashlm_attention_options_default();
  copt.causal = 1;
  copt.causal_align = FLASHLM_BOTTOM_RIGHT;
  copt.deterministic = 1;
  const flashlm_tensor qd = c_tensor(device.q.view()), kd = c_tensor(device.k.view()), vd = c_tensor(device.v.view());
  copt.q_descale_heads = &qd;
  copt.k_descale_heads = &kd;
  copt.v_descale_heads = &vd;
  const CCall call(abi);
#ifdef FLASHLM_WITH_SM90
  const bool forward = on_sm90();
#else
  const bool forward = false;
#endif
  if (forward) {
    attention_forward(api.q.view, api.k.view, api.v.view, api.o.view, api.lse, opt);
    ASSERT_EQ(call.forward(copt), FLASHLM_OK) << flashlm_last_error();
  }
  api.backward(opt);
  ASSERT_EQ(call.backward(copt), FLASHLM_OK) << flashlm_last_error();
  Fp8Problem from_api(p, c, DType::f32), from_abi(p, c, DType::f32);
  for (auto [host_side, dev] : {std::pair{&from_api, &api}, {&from_abi, &abi}}) {
    copy_back(host_side->o, dev->o);
    copy_into(host_side->lse.view(), dev->lse.view());
    dev->copy_gradients_back(*host_side);
  }
  expect_same_outputs(from_api, from_abi);
  for (const TensorView* t : {&from_api.dq.view, &from_api.dk.view, &from_api.dv.view}) {
    EXPECT_TRUE(all_finite_or_neg_inf(*t)) << "the poison survived";
  }
}

// Per-head descales on the GPU are checked as on the CPU where the check needs no values (shape, dtype, device, a
// scalar beside them); their values are device memory, which is never read on the host (as ALiBi slopes and sinks
// are not), so a NaN among them is no error: it reaches, as NaN (SPEC §2), the outputs of its batch's key head and
// of that head's query heads, and no others.
TEST(Fp8PerHeadCuda, BadDescalesAreRefusedAndANanReachesItsHeadsOnly) {
  SKIP_WITHOUT_GPU();
  const Case c{2, 33, 40, 4, 2, 64, Layout::bshd, Mask::none, DType::bf16};
  Fp8Problem p(c, DType::bf16, 81);
  p.poison();
  attention_forward(p.q.view, p.k.view, p.v.view, p.o.view, p.lse, options_for(c.mask, AttentionImpl::naive));
  Fp8OnDevice dev(p);
  const auto forward = [&](const AttentionOptions& opt) {
    attention_forward(dev.q.view, dev.k.view, dev.v.view, dev.o.view, dev.lse, opt);
  };
  const auto backward = [&](const AttentionOptions& opt) { dev.backward(opt); };
  Tensor per_q_head = Tensor::empty({2, 4}, DType::f32, Device::cuda), on_host = Tensor::empty({2, 2}, DType::f32);
  Tensor f64 = Tensor::empty({2, 2}, DType::f64, Device::cuda), good = Tensor::empty({2, 2}, DType::f32, Device::cuda);
  for (const Tensor* t : {&per_q_head, &on_host, &f64, &good}) fill_value(*t, 0.5);
  for (const auto& [fn, call] : {std::pair<std::string, std::function<void(const AttentionOptions&)>>{
                                     "attention_forward", forward},
                                 {"attention_backward", backward}}) {
    AttentionOptions bad;
    bad.q_descale_heads = per_q_head.view();
    expect_error([&] { call(bad); }, {fn, "q_descale_heads", "expected shape [2, 2] (batch, heads_k)", "[2, 4]"});
    bad.q_descale_heads = on_host.view();
    expect_error([&] { call(bad); }, {fn, "q_descale_heads", "on cpu but q is on cuda"});
    bad.q_descale_heads = f64.view();
    expect_error([&] { call(bad); }, {fn, "q_descale_heads", "expected dtype fp32"});
    bad = {};
    bad.v_descale_heads = good.view();
    bad.v_descale = 2.0f;
    expect_error([&] { call(bad); }, {fn, "v_descale_heads", "per-tensor descale 2"});
  }

  // A NaN at (batch 1, key head 1): the query heads 2 and 3 of batch 1 and key head 1 of batch 1 are NaN.
  Tensor with_nan = Tensor::empty({2, 2}, DType::f32);
  fill_value(with_nan, 0.5);
  with_nan.view().ptr<float>()[1 * 2 + 1] = std::numeric_limits<float>::quiet_NaN();
  const Tensor nan_on_device = copied_to(with_nan, Device::cuda);
  AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
  opt.k_descale_heads = nan_on_device.view();
  // Elements of a [B, N, H, D] view that are NaN, counted apart for the heads that should be and the others.
  const auto nan_counts = [&](const TensorView& t, int64_t heads_per_bad_head) {
    const Tensor x = to_f64(t);
    const int64_t N = t.size(1), H = t.size(2), D = t.size(3);
    std::pair<int64_t, int64_t> bad_heads_nan{0, 0}, others_nan{0, 0};  // (NaN, all) of each
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < H; ++h) {
          auto& counts = b == 1 && h / heads_per_bad_head == 1 ? bad_heads_nan : others_nan;
          for (int64_t e = 0; e < D; ++e) {
            counts.first += std::isnan(x.view().ptr<double>()[((b * N + n) * H + h) * D + e]);
            ++counts.second;
          }
        }
    return std::pair{bad_heads_nan, others_nan};
  };
  const auto expect_nan_in_bad_heads_only = [&](const TensorView& t, int64_t heads_per_bad_head, const char* what) {
    const auto [bad_heads, others] = nan_counts(t, heads_per_bad_head);
    EXPECT_EQ(bad_heads.first, bad_heads.second) << what << ": elements of the NaN descale's heads not NaN";
    EXPECT_EQ(others.first, 0) << what << ": NaN beyond the NaN descale's heads";
  };
#ifdef FLASHLM_WITH_SM90
  if (on_sm90()) {
    forward(opt);
    copy_back(p.o, dev.o);
    expect_nan_in_bad_heads_only(p.o.view, c.Hq / c.Hk, "o");
  }
#endif
  backward(opt);
  dev.copy_gradients_back(p);
  expect_nan_in_bad_heads_only(p.dq.view, c.Hq / c.Hk, "dq");
  expect_nan_in_bad_heads_only(p.dk.view, 1, "dk");
  expect_nan_in_bad_heads_only(p.dv.view, 1, "dv");
}

}  // namespace
