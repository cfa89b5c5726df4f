// Attention variants on the CPU: sliding window (flash-attn's window_size) and soft-capping. The fp64 reference
// against a direct transcription of the definitions, the CPU flash path against the reference (fp32, bf16,
// fp16, fp64) over ragged shapes, both alignments, layouts, GQA and the window's edges, gradients against
// central finite differences, rows the window leaves empty, and the bad arguments.
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
// i + offset - left <= j <= i + offset + right (right = 0 with causal), the score softcap · tanh(s / softcap).
void definition_forward(const Case& c, const Variant& v, const Problem& p, std::vector<double>& o,
                        std::vector<double>& lse) {
  const int64_t off = c.mask == Mask::bottom_right || v.bottom_right ? c.Nk - c.Nq : 0;
  const int64_t right = c.mask != Mask::none ? 0 : v.right;
  const double scale = v.scale > 0 ? v.scale : 1 / std::sqrt(double(c.D));
  const double* q = p.q.view.ptr<const double>();
  const double* k = p.k.view.ptr<const double>();
  const double* val = p.v.view.ptr<const double>();
  o.assign(size_t(c.B * c.Nq * c.Hq * c.D), 0.0);
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
          s.push_back(x);
          keys.push_back(j);
        }
        if (s.empty()) continue;
        double m = -INFINITY, sum = 0;
        for (double x : s) m = std::max(m, x);
        for (double x : s) sum += std::exp(x - m);
        lse[size_t((b * c.Hq + h) * c.Nq + i)] = m + std::log(sum);
        for (size_t n = 0; n < s.size(); ++n) {
          const double w = std::exp(s[n] - m) / sum;
          for (int64_t d = 0; d < c.D; ++d) {
            o[size_t(((b * c.Nq + i) * c.Hq + h) * c.D + d)] += w * val[((b * c.Nk + keys[n]) * c.Hk + hk) * c.D + d];
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

}  // namespace
