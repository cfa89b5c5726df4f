// Attention variants on the CPU: sliding window (flash-attn's window_size), soft-capping, ALiBi (alibi_slopes),
// attention sinks (learnable_sink) and a head dim of v's own (head_dim_v). The fp64 reference against a direct
// transcription of the definitions, the CPU flash path against the reference (fp32, bf16, fp16, fp64) over ragged
// shapes, both alignments, layouts, GQA and the window's edges, gradients (the sink's too) against central
// finite differences, rows that see no key, huge sinks, and the bad arguments.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_testing.h"
#include "flashlm/attention.h"
#include "flashlm/flashlm.h"
#include "gpu_testing.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

struct Variant {
  int64_t left = -1, right = -1;
  double softcap = 0;
  double scale = 0;  // 0: the default 1/sqrt(D)
  bool bottom_right = false;  // the window's alignment without causal (with causal the mask says it)
};

std::string variant_name(const Variant& v) {
  std::string s = fmt::format("_w{}_{}", v.left, v.right);
  if (v.softcap > 0) s += fmt::format("_cap{}", v.softcap);
  if (v.scale > 0) s += fmt::format("_scale{}", v.scale);
  if (v.bottom_right) s += "_BR";
  for (char& ch : s) {
    if (ch == '-') ch = 'm';
    if (ch == '.') ch = 'p';
  }
  return s;
}

AttentionOptions variant_options(Mask mask, AttentionImpl impl, const Variant& v) {
  AttentionOptions o = options_for(mask, impl);
  o.window_size_left = v.left;
  o.window_size_right = v.right;
  o.softcap = v.softcap;
  if (v.scale > 0) o.scale = v.scale;
  if (v.bottom_right) o.align = CausalAlign::bottom_right;
  return o;
}

struct VariantCase {
  Case c;
  Variant v;
};

std::string variant_case_name(const VariantCase& vc) { return case_name(vc.c) + variant_name(vc.v); }
void PrintTo(const VariantCase& vc, std::ostream* os) { *os << variant_case_name(vc); }

// The definitions written out, in fp64 on BSHD fp64 tensors: query i sees key j iff
// i + offset - left <= j <= i + offset + right (right = 0 with causal), the score softcap · tanh(s / softcap)
// - slope(b, h) · |i + offset - j| (slopes: null, or [Hq] when !per_batch_slopes, else [B, Hq]), and sink(h)
// (sinks: null or [Hq]) in the denominator: o = Σ_j exp(s_j) v_j / (Σ_j exp(s_j) + exp(sink)),
// lse = log(Σ_j exp(s_j) + exp(sink)); v of head dim Dv.
void definition_forward(const Case& c, const Variant& v, const Problem& p, std::vector<double>& o,
                        std::vector<double>& lse, const float* slopes = nullptr, bool per_batch_slopes = false,
                        const float* sinks = nullptr) {
  const int64_t Dv = value_dim(c);
  const int64_t off = c.mask == Mask::bottom_right || v.bottom_right ? c.Nk - c.Nq : 0;
  const int64_t right = c.mask != Mask::none ? 0 : v.right;
  const double scale = v.scale > 0 ? v.scale : 1 / std::sqrt(double(c.D));
  const double* q = p.q.view.ptr<const double>();
  const double* k = p.k.view.ptr<const double>();
  const double* val = p.v.view.ptr<const double>();
  o.assign(size_t(c.B * c.Nq * c.Hq * Dv), 0.0);
  lse.assign(size_t(c.B * c.Hq * c.Nq), -INFINITY);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      const int64_t hk = h / (c.Hq / c.Hk);
      for (int64_t i = 0; i < c.Nq; ++i) {
        std::vector<double> s;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < c.Nk; ++j) {
          if ((v.left >= 0 && j < i + off - v.left) || (right >= 0 && j > i + off + right)) continue;
          double x = 0;
          for (int64_t d = 0; d < c.D; ++d) {
            x += q[((b * c.Nq + i) * c.Hq + h) * c.D + d] * k[((b * c.Nk + j) * c.Hk + hk) * c.D + d];
          }
          x *= scale;
          if (v.softcap > 0) x = v.softcap * std::tanh(x / v.softcap);
          if (slopes) x -= double(slopes[(per_batch_slopes ? b * c.Hq : 0) + h]) * double(std::llabs(i + off - j));
          s.push_back(x);
          keys.push_back(j);
        }
        const double sink = sinks ? double(sinks[h]) : -INFINITY;
        if (s.empty() && sink == -INFINITY) continue;
        double m = sink, sum = 0;
        for (double x : s) m = std::max(m, x);
        for (double x : s) sum += std::exp(x - m);
        sum += std::exp(sink - m);
        lse[size_t((b * c.Hq + h) * c.Nq + i)] = m + std::log(sum);
        for (size_t n = 0; n < s.size(); ++n) {
          const double w = std::exp(s[n] - m) / sum;
          for (int64_t d = 0; d < Dv; ++d) {
            o[size_t(((b * c.Nq + i) * c.Hq + h) * Dv + d)] += w * val[((b * c.Nk + keys[n]) * c.Hk + hk) * Dv + d];
          }
        }
      }
    }
  }
}

std::vector<Variant> edge_variants() {
  return {
      {0, 0},            // window 0: each query sees its diagonal key only
      {3, -1},           // left only
      {-1, 5},           // right only
      {4, 2},            // both sides
      {5000, 5000},      // a window at least the sequence: the full mask
      {2, -1, 0.05},     // softcap tiny: every score nearly ±softcap
      {-1, -1, 1e4},     // softcap huge: nearly no cap
      {-1, -1, 2.0, 3.0},  // large scores (scale 3) well into tanh's saturation
      {3, 1, 0, 0, true},  // bottom-right without causal
      {-1, 2, 0.7, 0, true},
  };
}

class ReferenceVsDefinition : public ::testing::TestWithParam<VariantCase> {};

TEST_P(ReferenceVsDefinition, ForwardMatches) {
  const VariantCase vc = GetParam();
  const Case& c = vc.c;
  Problem p(c, Layout::bshd, DType::f64, 77);
  p.forward(variant_options(c.mask, AttentionImpl::naive, vc.v));
  std::vector<double> o, lse;
  definition_forward(c, vc.v, p, o, lse);
  const double* got_o = p.o.view.ptr<const double>();
  for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(got_o[i], o[i], 1e-12) << "o[" << i << "]";
  Tensor got_lse = to_f64(p.lse);
  for (size_t i = 0; i < lse.size(); ++i) {
    const double g = got_lse.view().ptr<double>()[i];
    if (std::isinf(lse[i])) ASSERT_EQ(g, lse[i]) << "lse[" << i << "]";
    else ASSERT_NEAR(g, lse[i], 1e-12) << "lse[" << i << "]";
  }
}

std::vector<VariantCase> definition_grid() {
  std::vector<VariantCase> cases;
  int n = 0;
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  for (const Variant& v : edge_variants()) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{9, 13}, {13, 6}}) {
      cases.push_back({{1, nq, nk, 4, 2, 8, Layout::bshd, masks[n++ % 3], DType::f64}, v});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Variants, ReferenceVsDefinition, ::testing::ValuesIn(definition_grid()),
                         [](const auto& info) { return variant_case_name(info.param); });

class FlashVsReference : public ::testing::TestWithParam<VariantCase> {};

TEST_P(FlashVsReference, ForwardAndBackwardMatchFp64Oracle) {
  const VariantCase vc = GetParam();
  expect_flash_matches_oracle(vc.c, variant_options(vc.c.mask, AttentionImpl::flash, vc.v), variant_name(vc.v));
}

std::vector<VariantCase> flash_grid() {
  std::vector<VariantCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  const std::vector<Variant> edges = edge_variants();
  int n = 0;
  // Ragged lengths (Nq = 1, 17, 127; Nk != Nq) through every edge variant, masks and layouts in turn, GQA.
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 77}, {17, 17}, {17, 130}, {127, 64}}) {
    for (size_t e = n % 2; e < edges.size(); e += 2) {
      cases.push_back({{1, nq, nk, 4, 2, 32, layouts[n % 3], masks[n % 3], DType::f32}, edges[e]});
      ++n;
    }
  }
  // Past the tiles (the forward's 256 x 512, the backward's 64 x 64): tiles wholly outside the band skipped in
  // both passes, band edges inside a tile, in both alignments.
  cases.push_back({{1, 700, 1100, 2, 1, 64, Layout::bshd, Mask::bottom_right, DType::f32}, {100, 0}});
  cases.push_back({{1, 600, 600, 2, 2, 64, Layout::bhsd, Mask::none, DType::f32}, {64, 64, 5.0}});
  cases.push_back({{1, 1100, 700, 2, 1, 64, Layout::sliced, Mask::top_left, DType::f32}, {300, -1}});
  cases.push_back({{1, 1, 1100, 2, 1, 64, Layout::bshd, Mask::bottom_right, DType::f32}, {50, -1}});
  cases.push_back({{1, 127, 127, 2, 2, 128, Layout::bshd, Mask::none, DType::f32}, {-1, 0, 1.0}});
  // A window that leaves rows empty: top-left, queries from Nk + left on see no key (O = 0, lse = -inf).
  cases.push_back({{2, 40, 10, 2, 2, 16, Layout::bhsd, Mask::none, DType::f32}, {2, -1}});
  // ... and bottom-right with more queries than keys and a right bound: the first rows see none.
  cases.push_back({{1, 50, 20, 2, 1, 16, Layout::bshd, Mask::none, DType::f32}, {-1, 3, 0.5, 0, true}});
  // Low precision (SPEC's rule) and fp64.
  for (DType t : {DType::bf16, DType::f16, DType::f64}) {
    cases.push_back({{1, 150, 131, 4, 2, 64, layouts[n % 3], masks[n % 3], t}, {20, 7, 3.0}});
    ++n;
  }
  cases.push_back({{1, 300, 700, 2, 1, 64, Layout::bshd, Mask::bottom_right, DType::bf16}, {128, 0, 30.0}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Variants, FlashVsReference, ::testing::ValuesIn(flash_grid()),
                         [](const auto& info) { return variant_case_name(info.param); });

// Gradients of both implementations against central finite differences in fp64.
class VariantFiniteDifferences : public ::testing::TestWithParam<std::tuple<AttentionImpl, VariantCase>> {};

TEST_P(VariantFiniteDifferences, GradientsMatchCentralDifferences) {
  const auto& [impl, vc] = GetParam();
  Problem p(vc.c, vc.c.layout, DType::f64, 42);
  expect_gradients_match_central_differences(p, variant_options(vc.c.mask, impl, vc.v));
}

std::vector<VariantCase> finite_difference_cases() {
  return {
      {{1, 7, 9, 4, 2, 8, Layout::bhsd, Mask::none, DType::f64}, {2, 1}},
      {{1, 7, 9, 2, 1, 8, Layout::bshd, Mask::bottom_right, DType::f64}, {3, -1}},
      {{1, 9, 6, 2, 2, 8, Layout::sliced, Mask::top_left, DType::f64}, {1, -1, 0.8}},
      {{1, 8, 8, 2, 1, 8, Layout::bshd, Mask::none, DType::f64}, {-1, -1, 0.5, 2.0}},
      {{1, 9, 5, 2, 2, 8, Layout::bhsd, Mask::none, DType::f64}, {1, 0, 1.5}},  // rows 6.. see no key
      {{1, 6, 9, 2, 1, 8, Layout::bshd, Mask::none, DType::f64}, {2, 2, 0, 0, true}},
  };
}

INSTANTIATE_TEST_SUITE_P(Variants, VariantFiniteDifferences,
                         ::testing::Combine(::testing::Values(AttentionImpl::flash, AttentionImpl::naive),
                                            ::testing::ValuesIn(finite_difference_cases())),
                         [](const auto& info) {
                           return std::string(attention_impl_name(std::get<0>(info.param))) + "_" +
                                  variant_case_name(std::get<1>(info.param));
                         });

TEST(AttentionVariants, RowsTheWindowLeavesEmptyGiveZeroOutputNegInfLseAndZeroGradients) {
  // Top-left, left 2, right 0: query i sees keys [i - 2, i]; queries 12.. see none of the 10 keys.
  const Case c{1, 16, 10, 2, 1, 16, Layout::bshd, Mask::none, DType::f32};
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    SCOPED_TRACE(std::string(attention_impl_name(impl)));
    Problem p(c, c.layout, c.dtype, 5);
    p.run(variant_options(c.mask, impl, {2, 0, 1.0}));
    Tensor o = to_f64(p.o.view), dq = to_f64(p.dq.view), lse = to_f64(p.lse);
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t i = 0; i < c.Nq; ++i) {
        const double l = lse.view().ptr<double>()[h * c.Nq + i];
        if (i >= 12) {
          EXPECT_EQ(l, -INFINITY) << "lse of row " << i;
        } else {
          EXPECT_TRUE(std::isfinite(l)) << "lse of row " << i;
        }
        for (int64_t d = 0; d < c.D && i >= 12; ++d) {
          EXPECT_EQ(o.view().ptr<double>()[(i * c.Hq + h) * c.D + d], 0.0) << "o of row " << i;
          EXPECT_EQ(dq.view().ptr<double>()[(i * c.Hq + h) * c.D + d], 0.0) << "dq of row " << i;
        }
      }
    }
    EXPECT_TRUE(all_finite_or_neg_inf(p.dk.view) && all_finite_or_neg_inf(p.dv.view));
  }
}

TEST(AttentionVariants, BadWindowAndSoftcapAreRefusedWithTheirName) {
  const Case c{1, 8, 8, 2, 2, 16, Layout::bshd, Mask::none, DType::f32};
  Problem p(c, c.layout, c.dtype, 3);
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    AttentionOptions o = options_for(Mask::none, impl);
    o.window_size_left = -2;
    expect_error([&] { p.forward(o); }, {"attention_forward", "window_size_left", "-2"});
    expect_error([&] { p.backward(o); }, {"attention_backward", "window_size_left"});
    o = options_for(Mask::top_left, impl);
    o.window_size_right = -7;
    expect_error([&] { p.forward(o); }, {"window_size_right", "-7"});
    for (double cap : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      o = options_for(Mask::none, impl);
      o.softcap = cap;
      expect_error([&] { p.forward(o); }, {"attention_forward", "softcap", ">= 0"});
      expect_error([&] { p.backward(o); }, {"attention_backward", "softcap"});
    }
  }
}

// The C ABI's options carry the window and softcap (ABI 4): the same results as the C++ API, bit for bit, the
// defaults mean none, and a bad value is FLASHLM_INVALID_ARGUMENT naming it.
TEST(AttentionVariants, CAbiCarriesTheWindowAndSoftcap) {
  const Case c{1, 20, 30, 2, 1, 16, Layout::bshd, Mask::bottom_right, DType::f32};
  const Variant v{5, -1, 2.5};
  Problem api(c, c.layout, c.dtype, 11), abi(c, c.layout, c.dtype, 11);
  api.run(variant_options(c.mask, AttentionImpl::flash, v));

  flashlm_attention_options opt = flashlm_attention_options_default();
  EXPECT_EQ(opt.window_size_left, -1);
  EXPECT_EQ(opt.window_size_right, -1);
  EXPECT_EQ(opt.softcap, 0.0);
  opt.causal = 1;
  opt.causal_align = FLASHLM_BOTTOM_RIGHT;
  opt.window_size_left = v.left;
  opt.softcap = v.softcap;
  const flashlm_tensor q = c_tensor(abi.q.view), k = c_tensor(abi.k.view), vv = c_tensor(abi.v.view);
  const flashlm_tensor o = c_tensor(abi.o.view), lse = c_tensor(abi.lse.view()), dout = c_tensor(abi.dout.view);
  const flashlm_tensor dq = c_tensor(abi.dq.view), dk = c_tensor(abi.dk.view), dv = c_tensor(abi.dv.view);
  ASSERT_EQ(flashlm_attention_forward(&q, &k, &vv, &o, &lse, &opt), FLASHLM_OK) << flashlm_last_error();
  ASSERT_EQ(flashlm_attention_backward(&q, &k, &vv, &o, &lse, &dout, &dq, &dk, &dv, &opt), FLASHLM_OK)
      << flashlm_last_error();
  for (auto [name, a, b] : {std::tuple{"o", &api.o, &abi.o}, {"dq", &api.dq, &abi.dq}, {"dk", &api.dk, &abi.dk},
                            {"dv", &api.dv, &abi.dv}}) {
    EXPECT_EQ(max_abs_diff(a->view, b->view), 0.0) << name;
  }
  opt.window_size_right = -3;
  EXPECT_EQ(flashlm_attention_forward(&q, &k, &vv, &o, &lse, &opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("window_size_right"), std::string::npos) << flashlm_last_error();
  opt.window_size_right = -1;
  opt.softcap = -1;
  EXPECT_EQ(flashlm_attention_forward(&q, &k, &vv, &o, &lse, &opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("softcap"), std::string::npos) << flashlm_last_error();
}


// ---- ALiBi, sinks and head_dim_v ----

struct Extras {
  int alibi = 0;  // 0: none; 1: slopes [Hq]; 2: slopes [B, Hq]
  int sink = 0;   // 0: none; 1: moderate sinks N(0, 1.5²); 2: the extremes per head (1e4, -inf, 30, -30, ...)
  Variant window = {};
};

std::string extras_name(const Extras& e) {
  std::string s;
  if (e.alibi) s += e.alibi == 1 ? "_alibi" : "_alibiB";
  if (e.sink) s += e.sink == 1 ? "_sink" : "_sinkX";
  if (e.window.left >= 0 || e.window.right >= 0 || e.window.softcap > 0 || e.window.bottom_right) {
    s += variant_name(e.window);
  }
  return s;
}

// The slopes and sinks of a case (deterministic, fp32) and the options that point at them.
struct ExtraInputs {
  Tensor slopes, sinks;
  AttentionOptions options;
};

ExtraInputs extra_inputs(const Case& c, const Extras& e, AttentionImpl impl) {
  ExtraInputs in;
  in.options = variant_options(c.mask, impl, e.window);
  if (e.alibi) {
    const int64_t rows = e.alibi == 2 ? c.B : 1;
    in.slopes = e.alibi == 2 ? Tensor::empty({c.B, c.Hq}, DType::f32) : Tensor::empty({c.Hq}, DType::f32);
    float* s = in.slopes.view().ptr<float>();
    // The ALiBi paper's geometric slopes 2^(-8 (h + 1) / H), scaled per batch entry where they are per batch.
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t h = 0; h < c.Hq; ++h) {
        s[b * c.Hq + h] = float(std::exp2(-8.0 * double(h + 1) / double(c.Hq)) * (1.0 + 0.75 * double(b)));
      }
    }
    in.options.alibi_slopes = in.slopes.view();
  }
  if (e.sink) {
    in.sinks = Tensor::empty({c.Hq}, DType::f32);
    float* s = in.sinks.view().ptr<float>();
    const float extremes[] = {1e4f, -INFINITY, 30.0f, -30.0f, 2.5f, -1.0f};
    for (int64_t h = 0; h < c.Hq; ++h) {
      s[h] = e.sink == 1 ? float(1.5 * std::sin(1.7 * double(h) + 0.3) + 0.5) : extremes[h % 6];
    }
    in.options.learnable_sink = in.sinks.view();
  }
  return in;
}

struct ExtraCase {
  Case c;
  Extras e;
};

std::string extra_case_name(const ExtraCase& x) { return case_name(x.c) + extras_name(x.e); }
void PrintTo(const ExtraCase& x, std::ostream* os) { *os << extra_case_name(x); }

class ExtrasReferenceVsDefinition : public ::testing::TestWithParam<ExtraCase> {};

TEST_P(ExtrasReferenceVsDefinition, ForwardMatches) {
  const ExtraCase x = GetParam();
  const Case& c = x.c;
  const ExtraInputs in = extra_inputs(c, x.e, AttentionImpl::naive);
  Problem p(c, Layout::bshd, DType::f64, 78);
  p.forward(in.options);
  std::vector<double> o, lse;
  definition_forward(c, x.e.window, p, o, lse, x.e.alibi ? in.slopes.view().ptr<const float>() : nullptr,
                     x.e.alibi == 2, x.e.sink ? in.sinks.view().ptr<const float>() : nullptr);
  const double* got_o = p.o.view.ptr<const double>();
  for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(got_o[i], o[i], 1e-12) << "o[" << i << "]";
  Tensor got_lse = to_f64(p.lse);
  for (size_t i = 0; i < lse.size(); ++i) {
    const double g = got_lse.view().ptr<double>()[i];
    if (std::isinf(lse[i])) ASSERT_EQ(g, lse[i]) << "lse[" << i << "]";
    else ASSERT_NEAR(g, lse[i], 1e-12 * std::max(1.0, std::fabs(lse[i]))) << "lse[" << i << "]";
  }
}

std::vector<ExtraCase> extras_definition_grid() {
  std::vector<ExtraCase> cases;
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  int n = 0;
  for (Extras e : {Extras{1, 0}, Extras{2, 0}, Extras{0, 1}, Extras{0, 2}, Extras{1, 1}, Extras{2, 2, {2, 1, 3.0}},
                   Extras{1, 1, {3, -1, 0, 0, true}}, Extras{0, 1, {1, 0}}, Extras{0, 0}}) {
    for (auto [nq, nk, dv] : {std::tuple<int64_t, int64_t, int64_t>{9, 13, 0}, {13, 6, 12}, {7, 7, 4}}) {
      cases.push_back({{2, nq, nk, 4, 2, 8, Layout::bshd, masks[n++ % 3], DType::f64, dv}, e});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Extras, ExtrasReferenceVsDefinition, ::testing::ValuesIn(extras_definition_grid()),
                         [](const auto& info) { return extra_case_name(info.param); });

class ExtrasFlashVsReference : public ::testing::TestWithParam<ExtraCase> {};

TEST_P(ExtrasFlashVsReference, ForwardAndBackwardMatchFp64Oracle) {
  const ExtraCase x = GetParam();
  const ExtraInputs in = extra_inputs(x.c, x.e, AttentionImpl::flash);
  expect_flash_matches_oracle(x.c, in.options, extras_name(x.e));
}

std::vector<ExtraCase> extras_flash_grid() {
  std::vector<ExtraCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  const std::vector<Extras> extras{{1, 0}, {2, 0}, {0, 1}, {0, 2}, {2, 1}, {1, 2, {20, 0}}, {0, 1, {6, 3, 2.0}},
                                   {1, 0, {-1, -1, 5.0}}, {2, 1, {4, -1, 0, 0, true}}};
  int n = 0;
  // Ragged lengths through every mode, masks, layouts and head dims (d_v = d_qk, 128 / 192, 32 / 64, 64 / 32) in
  // turn, GQA, a batch of two (per-batch slopes).
  const std::pair<int64_t, int64_t> dims[] = {{32, 0}, {48, 16}, {64, 32}, {32, 64}, {24, 40}};
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 77}, {17, 17}, {17, 130}, {127, 64}, {70, 300}}) {
    for (size_t e = n % 2; e < extras.size(); e += 2) {
      const auto [d, dv] = dims[n % 5];
      cases.push_back({{2, nq, nk, 4, 2, d, layouts[n % 3], masks[n % 3], DType::f32, dv}, extras[e]});
      ++n;
    }
  }
  // d_qk ≠ d_v alone, past the tiles, DeepSeek's 192 / 128 among them, both passes.
  cases.push_back({{1, 300, 600, 2, 1, 192, Layout::bshd, Mask::bottom_right, DType::f32, 128}, {}});
  cases.push_back({{1, 130, 130, 4, 2, 192, Layout::bhsd, Mask::none, DType::bf16, 128}, {}});
  cases.push_back({{1, 65, 90, 2, 2, 64, Layout::sliced, Mask::top_left, DType::f32, 32}, {}});
  cases.push_back({{1, 65, 90, 2, 1, 32, Layout::bshd, Mask::none, DType::f64, 64}, {}});
  // Past the tiles with every feature: tiles skipped, band edges inside tiles.
  cases.push_back({{1, 700, 1100, 2, 1, 64, Layout::bshd, Mask::bottom_right, DType::f32, 48}, {1, 1, {100, 0}}});
  cases.push_back({{2, 600, 520, 4, 2, 64, Layout::bhsd, Mask::none, DType::f32}, {2, 2, {64, 64, 5.0}}});
  // Rows that see no key with sinks: o = 0, lse = the sink (top-left window leaving the last queries bare, and
  // bottom-right with more queries than keys and a right bound).
  cases.push_back({{2, 40, 10, 2, 2, 16, Layout::bhsd, Mask::none, DType::f32}, {0, 1, {2, -1}}});
  cases.push_back({{1, 50, 20, 4, 1, 16, Layout::bshd, Mask::none, DType::f32, 8}, {1, 2, {-1, 3, 0.5, 0, true}}});
  cases.push_back({{1, 30, 12, 2, 2, 16, Layout::bshd, Mask::top_left, DType::f32}, {1, 1}});  // causal TL, Nq > Nk
  // Low precision (SPEC's rule) and fp64.
  for (DType t : {DType::bf16, DType::f16, DType::f64}) {
    cases.push_back({{2, 150, 131, 4, 2, 64, layouts[n % 3], masks[n % 3], t, 32}, {2, 1, {20, 7, 3.0}}});
    ++n;
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Extras, ExtrasFlashVsReference, ::testing::ValuesIn(extras_flash_grid()),
                         [](const auto& info) { return extra_case_name(info.param); });

class ExtrasFiniteDifferences : public ::testing::TestWithParam<std::tuple<AttentionImpl, ExtraCase>> {};

TEST_P(ExtrasFiniteDifferences, GradientsMatchCentralDifferences) {
  const auto& [impl, x] = GetParam();
  const ExtraInputs in = extra_inputs(x.c, x.e, impl);
  Problem p(x.c, x.c.layout, DType::f64, 43);
  expect_gradients_match_central_differences(p, in.options);
}

std::vector<ExtraCase> extras_finite_difference_cases() {
  return {
      {{2, 7, 9, 4, 2, 8, Layout::bhsd, Mask::none, DType::f64}, {2, 0}},
      {{1, 7, 9, 2, 1, 8, Layout::bshd, Mask::bottom_right, DType::f64}, {1, 0}},
      {{1, 9, 6, 2, 2, 8, Layout::sliced, Mask::top_left, DType::f64}, {0, 1}},
      {{2, 6, 8, 4, 2, 8, Layout::bshd, Mask::none, DType::f64}, {2, 1, {-1, -1, 0.8}}},
      {{1, 9, 5, 2, 2, 8, Layout::bhsd, Mask::none, DType::f64}, {0, 1, {1, 0}}},  // rows 6.. see no key
      {{1, 6, 9, 2, 1, 8, Layout::bshd, Mask::none, DType::f64, 4}, {1, 1, {2, 2, 0, 0, true}}},
      {{1, 7, 9, 2, 2, 6, Layout::bshd, Mask::bottom_right, DType::f64, 10}, {}},  // d_v > d_qk
      {{1, 8, 7, 2, 1, 12, Layout::bhsd, Mask::none, DType::f64, 4}, {}},         // d_v < d_qk
  };
}

INSTANTIATE_TEST_SUITE_P(Extras, ExtrasFiniteDifferences,
                         ::testing::Combine(::testing::Values(AttentionImpl::flash, AttentionImpl::naive),
                                            ::testing::ValuesIn(extras_finite_difference_cases())),
                         [](const auto& info) {
                           return std::string(attention_impl_name(std::get<0>(info.param))) + "_" +
                                  extra_case_name(std::get<1>(info.param));
                         });

// A row that sees no key takes the sink alone: o = 0, lse = sink exactly, dq = 0, and it adds nothing to dsink even
// where its dO is NaN; a huge sink takes (nearly) all the mass: o ≈ 0, lse = sink, dsink = -Σ P_sink · Delta ≈ 0.
TEST(AttentionSinks, RowsWithoutKeysTakeTheSinkAloneAndHugeSinksTakeEverything) {
  const Case c{1, 16, 10, 2, 1, 16, Layout::bshd, Mask::none, DType::f32};
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    SCOPED_TRACE(std::string(attention_impl_name(impl)));
    Tensor sinks = Tensor::empty({2}, DType::f32);
    sinks.view().ptr<float>()[0] = 0.75f;
    sinks.view().ptr<float>()[1] = 1e30f;
    AttentionOptions opt = variant_options(c.mask, impl, {2, 0});  // queries 12.. see none of the 10 keys
    opt.learnable_sink = sinks.view();
    Problem p(c, c.layout, c.dtype, 6);
    // NaN in dO of the rows without keys stays out of every gradient.
    for (int64_t i = 12; i < c.Nq; ++i) fill_value(p.dout.view.slice(1, i, i + 1), NAN);
    p.run(opt);
    Tensor o = to_f64(p.o.view), dq = to_f64(p.dq.view), lse = to_f64(p.lse);
    for (int64_t i = 0; i < c.Nq; ++i) {
      const double l0 = lse.view().ptr<double>()[i], l1 = lse.view().ptr<double>()[c.Nq + i];
      if (i >= 12) EXPECT_EQ(l0, 0.75) << "lse of row " << i;
      else EXPECT_GT(l0, 0.75) << "lse of row " << i;
      EXPECT_EQ(l1, double(1e30f)) << "lse of row " << i << ", huge sink";
      for (int64_t d = 0; d < c.D; ++d) {
        if (i >= 12) {
          EXPECT_EQ(o.view().ptr<double>()[(i * c.Hq + 0) * c.D + d], 0.0) << "o of row " << i;
          EXPECT_EQ(dq.view().ptr<double>()[(i * c.Hq + 0) * c.D + d], 0.0) << "dq of row " << i;
        }
        EXPECT_EQ(o.view().ptr<double>()[(i * c.Hq + 1) * c.D + d], 0.0) << "o of row " << i << ", huge sink";
      }
    }
    EXPECT_TRUE(std::isfinite(p.dsink.view().ptr<float>()[0]));
    EXPECT_EQ(p.dsink.view().ptr<float>()[1], 0.0f);
    EXPECT_TRUE(all_finite_or_neg_inf(p.dk.view) && all_finite_or_neg_inf(p.dv.view));
  }
}

// NaN semantics with a sink and ALiBi (SPEC §2): a NaN key reaches exactly the rows that see it (their o, lse and
// the head's dsink become NaN), every other row stays finite, in both implementations.
TEST(AttentionSinks, NanKeyReachesOnlyTheRowsThatSeeIt) {
  const Case c{1, 12, 12, 2, 2, 8, Layout::bshd, Mask::top_left, DType::f32};
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    SCOPED_TRACE(std::string(attention_impl_name(impl)));
    const ExtraInputs in = extra_inputs(c, {1, 1}, impl);
    Problem p(c, c.layout, c.dtype, 10);
    fill_value(p.k.view.slice(1, 7, 8).slice(2, 0, 1), NAN);  // key 7 of head 0: causal rows 7.. see it
    p.run(in.options);
    Tensor o = to_f64(p.o.view), lse = to_f64(p.lse);
    for (int64_t i = 0; i < c.Nq; ++i) {
      EXPECT_EQ(std::isnan(lse.view().ptr<double>()[i]), i >= 7) << "lse of row " << i << ", head 0";
      EXPECT_EQ(std::isnan(o.view().ptr<double>()[(i * c.Hq) * c.D]), i >= 7) << "o of row " << i << ", head 0";
      EXPECT_TRUE(std::isfinite(lse.view().ptr<double>()[c.Nq + i])) << "lse of row " << i << ", head 1";
    }
    EXPECT_TRUE(std::isnan(p.dsink.view().ptr<float>()[0]));
    EXPECT_TRUE(std::isfinite(p.dsink.view().ptr<float>()[1]));
  }
}

// dlearnable_sink sums over the batch: a batch of two gives the sum of its entries run alone.
TEST(AttentionSinks, GradientSumsOverTheBatch) {
  const Case two{2, 20, 30, 4, 2, 16, Layout::bshd, Mask::bottom_right, DType::f64};
  const Case one{1, 20, 30, 4, 2, 16, Layout::bshd, Mask::bottom_right, DType::f64};
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    const ExtraInputs in = extra_inputs(two, {0, 1}, impl);
    Problem both(two, Layout::bshd, DType::f64, 8);
    both.run(in.options);
    std::vector<double> sum(4, 0.0);
    for (int64_t b = 0; b < 2; ++b) {
      Problem alone(one, Layout::bshd, DType::f64, 0);
      copy_into(alone.q.view, both.q.view.slice(0, b, b + 1));
      copy_into(alone.k.view, both.k.view.slice(0, b, b + 1));
      copy_into(alone.v.view, both.v.view.slice(0, b, b + 1));
      copy_into(alone.dout.view, both.dout.view.slice(0, b, b + 1));
      alone.run(in.options);
      for (int64_t h = 0; h < 4; ++h) sum[size_t(h)] += alone.dsink.view().ptr<float>()[h];
    }
    for (int64_t h = 0; h < 4; ++h) {
      EXPECT_NEAR(both.dsink.view().ptr<float>()[h], sum[size_t(h)], 1e-5 * std::max(1.0, std::fabs(sum[size_t(h)])))
          << attention_impl_name(impl) << " head " << h;
    }
  }
}

// ALiBi follows the mask's alignment: bottom-right with seq_q != seq_k is flash-attn's -slope · |i + Nk - Nq - j|,
// which a top-left run on the same inputs does not give.
TEST(AttentionAlibi, BottomRightAlignmentIsFlashAttnsFormula) {
  const Case c{1, 5, 12, 2, 2, 8, Layout::bshd, Mask::bottom_right, DType::f64};
  const ExtraInputs in = extra_inputs(c, {1, 0}, AttentionImpl::naive);
  Problem p(c, Layout::bshd, DType::f64, 9);
  p.forward(in.options);
  std::vector<double> o, lse;
  definition_forward(c, {}, p, o, lse, in.slopes.view().ptr<const float>());
  for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(p.o.view.ptr<const double>()[i], o[i], 1e-12) << "o[" << i << "]";
  AttentionOptions top_left = in.options;
  top_left.causal = false;
  top_left.align = CausalAlign::top_left;
  AttentionOptions bottom_right_full = top_left;
  bottom_right_full.align = CausalAlign::bottom_right;
  Problem tl(c, Layout::bshd, DType::f64, 9), br(c, Layout::bshd, DType::f64, 9);
  tl.forward(top_left);
  br.forward(bottom_right_full);
  EXPECT_GT(max_abs_diff(tl.o.view, br.o.view), 1e-3);  // the bias moved with the alignment
}

TEST(AttentionExtras, BadArgumentsAreRefusedWithTheirName) {
  const Case c{2, 8, 8, 4, 2, 16, Layout::bshd, Mask::none, DType::f32};
  Problem p(c, c.layout, c.dtype, 3);
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    SCOPED_TRACE(std::string(attention_impl_name(impl)));
    const AttentionOptions base = options_for(Mask::none, impl);
    // Slopes: shape, dtype, values.
    for (std::vector<int64_t> shape : {std::vector<int64_t>{3}, {5}, {3, 4}, {2, 3}, {2, 4, 1}, {1, 4}}) {
      Tensor s = Tensor::empty(shape, DType::f32);
      fill_value(s, 0.5);
      AttentionOptions o = base;
      o.alibi_slopes = s.view();
      expect_error([&] { p.forward(o); }, {"attention_forward", "alibi_slopes", "[4] or [2, 4]"});
      expect_error([&] { p.backward(o); }, {"attention_backward", "alibi_slopes"});
    }
    Tensor s64 = Tensor::empty({4}, DType::f64);
    fill_value(s64, 0.5);
    AttentionOptions o = base;
    o.alibi_slopes = s64.view();
    expect_error([&] { p.forward(o); }, {"alibi_slopes", "fp32"});
    Tensor slopes = Tensor::empty({4}, DType::f32);
    fill_value(slopes, 0.5);
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      slopes.view().ptr<float>()[2] = bad;
      o = base;
      o.alibi_slopes = slopes.view();
      expect_error([&] { p.forward(o); }, {"alibi_slopes", "head 2", "finite"});
    }
    // Sinks: shape, dtype, NaN and +inf (-inf is no sink).
    for (std::vector<int64_t> shape : {std::vector<int64_t>{2}, {2, 4}, {5}}) {
      Tensor t = Tensor::empty(shape, DType::f32);
      fill_value(t, 0.5);
      o = base;
      o.learnable_sink = t.view();
      expect_error([&] { p.forward(o); }, {"attention_forward", "learnable_sink"});
    }
    Tensor sinks = Tensor::empty({4}, DType::f32);
    fill_value(sinks, 0.25);
    for (float bad : {NAN, INFINITY}) {
      sinks.view().ptr<float>()[1] = bad;
      o = base;
      o.learnable_sink = sinks.view();
      expect_error([&] { p.forward(o); }, {"learnable_sink", "head 1", "-inf"});
      expect_error([&] { p.backward(o); }, {"attention_backward", "learnable_sink"});
    }
    sinks.view().ptr<float>()[1] = -INFINITY;
    o = base;
    o.learnable_sink = sinks.view();
    EXPECT_NO_THROW(p.run(o));
    // dlearnable_sink: needs the sink, its shape and dtype, apart from the inputs and outputs.
    Tensor dsink = Tensor::empty({4}, DType::f32);
    o = base;
    o.dlearnable_sink = dsink.view();
    expect_error([&] { p.backward(o); }, {"attention_backward", "dlearnable_sink", "without learnable_sink"});
    o.learnable_sink = sinks.view();
    Tensor dsink3 = Tensor::empty({3}, DType::f32);
    o.dlearnable_sink = dsink3.view();
    expect_error([&] { p.backward(o); }, {"dlearnable_sink", "[4]"});
    o.dlearnable_sink = sinks.view();
    expect_error([&] { p.backward(o); }, {"dlearnable_sink", "overlaps the input learnable_sink"});
    o.dlearnable_sink = p.dq.view.slice(0, 0, 1).slice(1, 0, 1).slice(2, 0, 1).slice(3, 0, 4);
    o.dlearnable_sink.ndim = 1;
    o.dlearnable_sink.sizes[0] = 4;
    o.dlearnable_sink.strides[0] = 1;
    expect_error([&] { p.backward(o); }, {"dlearnable_sink", "overlaps", "dq"});
    TensorView self_overlapping = dsink.view();
    self_overlapping.strides[0] = 0;
    o.dlearnable_sink = self_overlapping;
    expect_error([&] { p.backward(o); }, {"dlearnable_sink", "overlaps itself"});
  }
}

TEST(AttentionHeadDimV, ShapesAreCheckedInOnePlace) {
  const Case c{1, 8, 8, 2, 2, 16, Layout::bshd, Mask::none, DType::f32, 8};
  Problem p(c, c.layout, c.dtype, 4);
  EXPECT_NO_THROW(p.run(options_for(Mask::none, AttentionImpl::flash)));
  Problem same(Case{1, 8, 8, 2, 2, 16, Layout::bshd, Mask::none, DType::f32}, c.layout, c.dtype, 4);
  // o and dout with q's head dim while v has 8: refused by name; dv with k's head dim too.
  expect_error([&] { attention_forward(p.q.view, p.k.view, p.v.view, same.o.view, p.lse, {}); },
               {"attention_forward", "o:", "head_dim_v"});
  expect_error([&] {
    attention_backward(p.q.view, p.k.view, p.v.view, p.o.view, p.lse, same.dout.view, p.dq.view, p.dk.view, p.dv.view,
                       {});
  }, {"attention_backward", "dout"});
  expect_error([&] {
    attention_backward(p.q.view, p.k.view, p.v.view, p.o.view, p.lse, p.dout.view, p.dq.view, p.dk.view, same.dv.view,
                       {});
  }, {"attention_backward", "dv"});
  // v must still match k in batch, seq_k and heads_k.
  Problem other(Case{1, 8, 9, 2, 2, 16, Layout::bshd, Mask::none, DType::f32, 8}, c.layout, c.dtype, 4);
  expect_error([&] { attention_forward(p.q.view, p.k.view, other.v.view, p.o.view, p.lse, {}); },
               {"attention_forward", "v:", "seq_k"});
}

// The C ABI's options carry ALiBi, the sinks and the sink's gradient (ABI 5): the same results as the C++ API,
// bit for bit; the defaults (null) mean none; a bad one is FLASHLM_INVALID_ARGUMENT naming it.
TEST(AttentionExtras, CAbiCarriesAlibiAndSinks) {
  const Case c{2, 20, 30, 4, 2, 16, Layout::bshd, Mask::bottom_right, DType::f32, 8};
  const ExtraInputs in = extra_inputs(c, {2, 1, {5, -1, 2.5}}, AttentionImpl::flash);
  Problem api(c, c.layout, c.dtype, 12), abi(c, c.layout, c.dtype, 12);
  api.run(in.options);

  EXPECT_EQ(flashlm_abi_version(), 6);
  flashlm_attention_options opt = flashlm_attention_options_default();
  EXPECT_EQ(opt.alibi_slopes, nullptr);
  EXPECT_EQ(opt.learnable_sink, nullptr);
  EXPECT_EQ(opt.dlearnable_sink, nullptr);
  opt.causal = 1;
  opt.causal_align = FLASHLM_BOTTOM_RIGHT;
  opt.window_size_left = 5;
  opt.softcap = 2.5;
  const flashlm_tensor slopes = c_tensor(in.slopes.view()), sinks = c_tensor(in.sinks.view());
  Tensor dsink = Tensor::empty({c.Hq}, DType::f32);
  const flashlm_tensor dsink_c = c_tensor(dsink.view());
  opt.alibi_slopes = &slopes;
  opt.learnable_sink = &sinks;
  opt.dlearnable_sink = &dsink_c;
  const flashlm_tensor q = c_tensor(abi.q.view), k = c_tensor(abi.k.view), vv = c_tensor(abi.v.view);
  const flashlm_tensor o = c_tensor(abi.o.view), lse = c_tensor(abi.lse.view()), dout = c_tensor(abi.dout.view);
  const flashlm_tensor dq = c_tensor(abi.dq.view), dk = c_tensor(abi.dk.view), dv = c_tensor(abi.dv.view);
  ASSERT_EQ(flashlm_attention_forward(&q, &k, &vv, &o, &lse, &opt), FLASHLM_OK) << flashlm_last_error();
  ASSERT_EQ(flashlm_attention_backward(&q, &k, &vv, &o, &lse, &dout, &dq, &dk, &dv, &opt), FLASHLM_OK)
      << flashlm_last_error();
  for (auto [name, a, b] : {std::tuple{"o", &api.o, &abi.o}, {"dq", &api.dq, &abi.dq}, {"dk", &api.dk, &abi.dk},
                            {"dv", &api.dv, &abi.dv}}) {
    EXPECT_EQ(max_abs_diff(a->view, b->view), 0.0) << name;
  }
  EXPECT_EQ(max_abs_diff(api.dsink.view(), dsink.view()), 0.0) << "dsink";
  flashlm_tensor bad = slopes;
  bad.sizes[1] = 3;
  opt.alibi_slopes = &bad;
  EXPECT_EQ(flashlm_attention_forward(&q, &k, &vv, &o, &lse, &opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("alibi_slopes"), std::string::npos) << flashlm_last_error();
  opt.alibi_slopes = nullptr;
  opt.learnable_sink = nullptr;
  EXPECT_EQ(flashlm_attention_backward(&q, &k, &vv, &o, &lse, &dout, &dq, &dk, &dv, &opt), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("dlearnable_sink"), std::string::npos) << flashlm_last_error();
}

// On a GPU the fp16/bf16 flash kernels (mma.sync) run ALiBi and sinks through the public calls; the fp32 flash and
// the naive kernels refuse them by name, whatever the slopes and sinks hold (their device memory is never read);
// a head_dim_v of its own (64 with 32) runs on the fp16/bf16 and fp32 flash kernels, padded, and the naive ones
// refuse it by name.
TEST(AttentionExtrasCuda, KernelsWithoutThemRefuseThemByName) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
      SCOPED_TRACE(fmt::format("{} {}", dtype_name(dtype), attention_impl_name(impl)));
      const bool mma_sync = impl == AttentionImpl::flash && dtype != DType::f32;
      const Case c{1, 64, 64, 2, 2, 64, Layout::bshd, Mask::top_left, dtype};
      Problem p(c, c.layout, dtype, 1);
      Tensor slopes = Tensor::empty({2}, DType::f32, Device::cuda), sinks = Tensor::empty({2}, DType::f32, Device::cuda);
      fill_normal(slopes, 7);  // the mma.sync kernels read them: finite values
      fill_normal(sinks, 8);
      AttentionOptions o = options_for(c.mask, impl);
      o.alibi_slopes = slopes.view();
      if (mma_sync) {
        EXPECT_NO_THROW(p.run_on_device(o));
      } else {
        expect_error([&] { p.run_on_device(o); }, {"alibi_slopes", "attention kernels have no ALiBi"});
      }
      o = options_for(c.mask, impl);
      o.learnable_sink = sinks.view();
      if (mma_sync) {
        EXPECT_NO_THROW(p.run_on_device(o));
      } else {
        expect_error([&] { p.run_on_device(o); }, {"learnable_sink", "attention kernels have no attention sinks"});
      }
      Problem mla(Case{1, 64, 64, 2, 2, 64, Layout::bshd, Mask::none, dtype, 32}, Layout::bshd, dtype, 2);
      if (impl == AttentionImpl::flash) {
        EXPECT_NO_THROW(mla.run_on_device(options_for(Mask::none, impl)));
      } else {
        expect_error([&] { mla.run_on_device(options_for(Mask::none, impl)); },
                     {"v: head_dim_v 32 differs from head_dim 64", "the naive forward kernels need one head dim"});
      }
    }
  }
}

}  // namespace
