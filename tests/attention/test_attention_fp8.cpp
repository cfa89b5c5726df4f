// The FP8 (e4m3) attention forward: its argument checks (CPU, always run) and the sm_90a kernel against
// the fp64 reference computed from the same fp8 inputs (GPU tests: skip without an sm_90 GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
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
  expect_error([&] { attention_forward(q, q, q, o, lse); }, {"attention_forward", "q", "fp8_e4m3", "only on cuda"});
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

  Tensor g = Tensor::empty({1, 8, 2, 64}, DType::f8e4m3), gq = Tensor::empty({1, 8, 2, 64}, DType::f8e4m3);
  expect_error([&] { attention_backward(q, q, q, o, lse, o, gq, g, g); },
               {"attention_backward", "fp8_e4m3 has a forward only"});
}

// fp8 inputs in a layout whose rows stay 16-byte aligned (the CUDA kernels' rule; testing::make_laid_out's
// sliced view pads head_dim by 8 elements, 8 bytes here): the sliced view pads by 16.
[[maybe_unused]] LaidOut fp8_laid_out(Layout layout, int64_t B, int64_t N, int64_t H, int64_t D) {
  if (layout != Layout::sliced) return make_laid_out(layout, B, N, H, D, DType::f8e4m3);
  LaidOut t;
  t.storage = Tensor::empty({B, N + 3, H, D + 16}, DType::f8e4m3);
  t.view = t.storage.view().slice(1, 2, 2 + N).slice(3, 0, D);
  return t;
}

// The dequantised fp64 BSHD copy of an fp8 view: value · descale.
[[maybe_unused]] Tensor dequantised(const TensorView& t, double descale) {
  Tensor x = to_f64(t);
  for (int64_t i = 0; i < x.numel(); ++i) x.view().ptr<double>()[i] *= descale;
  return x;
}

struct Fp8Case {
  Case c;  // c.dtype unused (fp8 in, bf16 out)
};
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

class Fp8VsReference : public ::testing::TestWithParam<Fp8Case> {};

// Bound, derived the way SPEC §3 derives the low-precision rule. The fp64 reference runs on the dequantised
// fp8 inputs, so input rounding is no error here; what the FP8 path adds is (a) P rounded to e4m3 for P·V:
// 3 mantissa bits, relative error at most 2^-4 per element for P >= 2^-6 (absolute at most 2^-10 below,
// e4m3's subnormal spacing being 2^-9), so |ΔO_i| <= 2^-4 · Σ_j P_ij |v_j| / l_i + 2^-10 · Σ_j |v_j| / l_i
// in the worst case and far less on average (the roundings of different keys are independent); (b) O
// rounded to bf16 (2^-8 relative); (c) fp32 (tensor-core) accumulation of S and O, orders of magnitude
// below (a). The naive attention computed with exactly the roundings (a) and (b) has an error of the same
// nature against the reference, so — FlashAttention's rule, as for fp16/bf16 — ours may be at most twice
// that naive error plus 1e-3 absolute. lse involves no e4m3 rounding of P (only (c) on S): 1e-3 · max(1, |lse|).
TEST_P(Fp8VsReference, MatchesFp64ReferenceOfTheSameInputs) {
  SKIP_WITHOUT_GPU();
#ifndef FLASHLM_WITH_SM90
  GTEST_SKIP() << "built without the sm_90a kernels";
#else
  if (!on_sm90()) GTEST_SKIP() << "not an sm_90 GPU";
  const Case c = GetParam().c;
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
  for (int run = 0; run < 2; ++run) {  // twice: the kernel has no atomics, so the runs must agree bitwise
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

  const Tensor qd = dequantised(q.view, kQDescale), kd = dequantised(k.view, kKDescale), vd = dequantised(v.view, kVDescale);
  Tensor ref_o = Tensor::empty({c.B, c.Nq, c.Hq, c.D}, DType::f64), ref_lse = Tensor::empty({c.B, c.Hq, c.Nq}, DType::f64);
  attention_forward(qd, kd, vd, ref_o, ref_lse, options_for(c.mask, AttentionImpl::naive));
  const Tensor lowp = naive_with_fp8_roundings(c, qd, kd, vd);

  const double naive_err = max_abs_diff(lowp.view(), ref_o.view());
  const double err = max_abs_diff(o_runs[0].view(), ref_o.view());
  EXPECT_LE(err, 2 * naive_err + 1e-3) << fp8_case_name(GetParam()) << " (naive-with-fp8-roundings error "
                                       << naive_err << ", max |ref| " << max_abs(ref_o.view()) << ")";
  double lse_err = 0;
  int64_t bad_masked = 0;
  const double* got = lse_runs[0].view().ptr<double>();
  const double* want = ref_lse.view().ptr<double>();
  for (int64_t i = 0; i < ref_lse.numel(); ++i) {
    if (std::isinf(want[i])) {  // a row that sees no key: exactly -inf
      bad_masked += got[i] != want[i];
      continue;
    }
    const double d = std::fabs(got[i] - want[i]) / std::max(1.0, std::fabs(want[i]));
    lse_err = std::isnan(d) ? INFINITY : std::max(lse_err, d);
  }
  EXPECT_LE(lse_err, 1e-3) << "lse of " << fp8_case_name(GetParam());
  EXPECT_EQ(bad_masked, 0) << "rows that see no key must have lse = -inf";
  // Rows that see no key are exactly zero (the reference's are).
  const int64_t offset = c.mask == Mask::bottom_right ? c.Nk - c.Nq : 0;
  int64_t nonzero = 0;
  const double* od = o_runs[0].view().ptr<double>();
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < c.Nq; ++i) {
      const int64_t visible = c.mask == Mask::none ? c.Nk : std::clamp<int64_t>(i + offset + 1, 0, c.Nk);
      if (visible > 0) continue;
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t d = 0; d < c.D; ++d) nonzero += od[((b * c.Nq + i) * c.Hq + h) * c.D + d] != 0.0;
    }
  EXPECT_EQ(nonzero, 0) << "elements of rows that see no key are not 0";
  // Bitwise agreement of the two runs (NaN-free by now, or the bounds above failed).
  EXPECT_EQ(max_abs_diff(o_runs[0].view(), o_runs[1].view()), 0.0) << "o differs between runs: a race";
  EXPECT_EQ(std::memcmp(lse_runs[0].view().data, lse_runs[1].view().data, static_cast<size_t>(ref_lse.numel()) * 8), 0)
      << "lse differs between runs: a race";
#endif
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

// No queries: nothing is written. No keys: O is zero and logsumexp -inf (outputs start poisoned).
TEST(Fp8Attention, EmptySequences) {
  SKIP_WITHOUT_GPU();
#ifndef FLASHLM_WITH_SM90
  GTEST_SKIP() << "built without the sm_90a kernels";
#else
  if (!on_sm90()) GTEST_SKIP() << "not an sm_90 GPU";
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
#endif
}

// What an fp8 call refuses on the GPU: a head dim without a kernel, and any impl but flash.
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
}

}  // namespace
