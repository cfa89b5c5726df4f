// Sliding window and soft-capping on CUDA: the 16-bit flash kernels' masked instantiations (the Hopper
// wgmma/TMA kernels where they cover the problem, and the mma.sync kernels, forced with
// FLASHLM_ATTENTION_KERNEL=mma, in both backward modes) against the fp64 reference on fresh random inputs
// with poisoned outputs: windows on the left only, the right only, both sides, 0 and at least the sequence,
// with and without causal, both alignments, seq_q != seq_k both ways, ragged lengths, GQA, every head dim
// (64/128/256 on both families, 256's Hopper backward the wide-head kernel; 16 and 32 on mma.sync; 80 padded to
// 128, which either family may run), bf16 and fp16,
// soft-capping on large scores, both variants together; rows the window leaves without keys (o = 0, lse =
// -inf, dq = 0) and keys no query sees (dk = dv = 0), exactly. ALiBi and attention sinks on the mma.sync
// kernels (by default the Hopper ones decline them: FLASHLM_ATTENTION_KERNEL=auto lands on mma.sync too) and on
// the Hopper kernels' ALiBi / sink instantiations (hopper_alibi_sink_route forced on, sm_90 only) against the
// same oracle, dlearnable_sink included, and NaN and inf reaching the same outputs on both. Every test skips
// without a GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attention/attention_testing.h"
#include "attention/backends.h"
#include "attention/capabilities.h"
#include "attention/problem.h"
#include "flashlm/attention.h"
#include "gpu_testing.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

struct Band {
  int64_t left = -1, right = -1;
  double softcap = 0;
  double score_scale = 1;  // the softmax scale is score_scale / sqrt(D): 30 drives the scores deep into the cap
  bool bottom_right = false;  // the alignment without causal (with causal, the mask's)
};

struct VariantGpuCase {
  Case c;
  Band band;
  bool deterministic = false;
};

std::string variant_gpu_name(const VariantGpuCase& v) {
  std::string s = case_name(v.c) + fmt::format("_w{}_{}", v.band.left, v.band.right);
  if (v.band.softcap > 0) s += fmt::format("_cap{}", v.band.softcap);
  if (v.band.score_scale != 1) s += fmt::format("_x{}", v.band.score_scale);
  if (v.band.bottom_right) s += "_BR";
  s += v.deterministic ? "_det" : "_atomic";
  for (char& ch : s) {
    if (ch == '-') ch = 'm';
    if (ch == '.') ch = 'p';
  }
  return s;
}
void PrintTo(const VariantGpuCase& v, std::ostream* os) { *os << variant_gpu_name(v); }

AttentionOptions band_options(const VariantGpuCase& v, AttentionImpl impl) {
  AttentionOptions o = options_for(v.c.mask, impl);
  o.window_size_left = v.band.left;
  o.window_size_right = v.band.right;
  o.softcap = v.band.softcap;
  if (v.band.score_scale != 1) o.scale = v.band.score_scale / std::sqrt(static_cast<double>(v.c.D));
  if (v.band.bottom_right) o.align = CausalAlign::bottom_right;
  o.deterministic = v.deterministic;
  return o;
}

// o, dq, dk, dv and lse of the CUDA flash kernels (family "auto": Hopper where it covers the problem, or
// "mma") against the fp64 reference, and exact zeros where the band leaves a query without keys or a key
// without queries.
void expect_band_matches_oracle(const VariantGpuCase& v, const char* family) {
  const Case& c = v.c;
  const std::string name = variant_gpu_name(v) + "_" + family;
  const uint64_t seed = 31000 + static_cast<uint64_t>(c.Nq * 5 + c.Nk * 3 + c.D + v.band.left * 7 + v.band.right);
  Problem ours(c, c.layout, c.dtype, seed);
  with_kernel_choice(family, [&] { ours.run_on_device(band_options(v, AttentionImpl::flash)); });
  Problem ref(ours, c);  // fp64 on the CPU, from the same rounded inputs
  ref.run(band_options(v, AttentionImpl::naive));
  Problem lowp(c, c.layout, c.dtype, 0);  // the naive attention in the case's 16-bit dtype, on the CPU
  expect_outputs_near_oracle(c, name, ours, ref, lowp, band_options(v, AttentionImpl::naive));
  Tensor lse_ours = to_f64(ours.lse), lse_ref = to_f64(ref.lse);
  int64_t empty_rows = 0;
  for (int64_t i = 0; i < lse_ref.numel(); ++i) {
    const double a = lse_ours.view().ptr<double>()[i], b = lse_ref.view().ptr<double>()[i];
    if (std::isinf(b)) {
      ++empty_rows;
      EXPECT_EQ(a, b) << "lse[" << i << "] of " << name;
    } else {
      EXPECT_NEAR(a, b, 1e-3 * std::max(1.0, std::fabs(b))) << "lse[" << i << "] of " << name;
    }
  }

  // The band of the case as the library sees it (alignment, causal and window together).
  const AttentionProblem p =
      validate_attention_forward(ref.q.view, ref.k.view, ref.v.view, ref.o.view, ref.lse, band_options(v, AttentionImpl::naive));
  Tensor o = to_f64(ours.o.view), dq = to_f64(ours.dq.view), dk = to_f64(ours.dk.view), dv = to_f64(ours.dv.view);
  int64_t rows_without_keys = 0;
  for (int64_t i = 0; i < c.Nq; ++i) {
    if (p.first_visible_key(i) < p.visible_keys(i)) continue;
    ++rows_without_keys;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h) {
        const int64_t at = ((b * c.Nq + i) * c.Hq + h) * c.D;
        for (int64_t d = 0; d < c.D; ++d) {
          ASSERT_EQ(o.view().ptr<double>()[at + d], 0.0) << "o of query " << i << " (sees no key) of " << name;
          ASSERT_EQ(dq.view().ptr<double>()[at + d], 0.0) << "dq of query " << i << " (sees no key) of " << name;
        }
      }
  }
  for (int64_t j = 0; j < c.Nk; ++j) {
    if (p.first_query_seeing(j) < p.last_query_seeing(j)) continue;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hk; ++h) {
        const int64_t at = ((b * c.Nk + j) * c.Hk + h) * c.D;
        for (int64_t d = 0; d < c.D; ++d) {
          ASSERT_EQ(dk.view().ptr<double>()[at + d], 0.0) << "dk of key " << j << " (no query sees it) of " << name;
          ASSERT_EQ(dv.view().ptr<double>()[at + d], 0.0) << "dv of key " << j << " (no query sees it) of " << name;
        }
      }
  }
  EXPECT_EQ(empty_rows, rows_without_keys * c.B * c.Hq) << "rows with lse = -inf in the reference, of " << name;
}

class CudaBandVsReference : public ::testing::TestWithParam<VariantGpuCase> {};

TEST_P(CudaBandVsReference, HopperAndMmaSyncMatchFp64Oracle) {
  SKIP_WITHOUT_GPU();
  const VariantGpuCase& v = GetParam();
  // The deterministic mode runs the mma.sync backward on every GPU: once is enough.
  if (!v.deterministic) expect_band_matches_oracle(v, "auto");
  expect_band_matches_oracle(v, "mma");
}

std::vector<VariantGpuCase> band_grid() {
  std::vector<VariantGpuCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Band windows[] = {
      {0, 0},        // the diagonal key only
      {3, -1},       // left only
      {-1, 5},       // right only (with causal: the causal mask, right = 0)
      {4, 2},        // both sides
      {130, 70},     // both, across tiles of every kernel
      {300, -1},     // left only, across tiles
      {-1, 200},     // right only, across tiles
      {5000, 5000},  // at least the sequence: the full (or causal) mask, through the masked kernels
  };
  int n = 0;
  // Head dims 64 and 128: both families, both dtypes, every mask, GQA 4 / 2; ragged lengths in both
  // directions (with bottom-right alignment and Nq > Nk whole stretches of rows see no key).
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {17, 130}, {130, 17}, {300, 300}, {1000, 333}, {333, 1000}}) {
    for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
      for (const Band& w : windows) {
        const int64_t d = n % 2 ? 128 : 64;
        const DType dt = (n / 2) % 2 ? DType::bf16 : DType::f16;
        Band b = w;
        b.bottom_right = m == Mask::none && n % 3 == 1;  // the window's own alignment without causal
        cases.push_back({{n % 5 == 0 ? 2 : 1, nq, nk, 4, 2, d, layouts[n % 3], m, dt}, b, n % 7 == 3});
        ++n;
      }
    }
  }
  // Soft-capping: scores scaled x30 (deep in tanh's saturation) and at the default scale, alone and with a
  // window, every mask, both head dims and dtypes.
  const Band caps[] = {{-1, -1, 50.0, 30.0}, {-1, -1, 5.0, 1.0}, {64, 0, 30.0, 30.0}, {20, 40, 10.0, 30.0, true},
                       {0, 0, 20.0, 30.0}};
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{17, 130}, {257, 257}, {700, 1300}, {1000, 333}}) {
    for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
      for (const Band& cap : caps) {
        const int64_t d = n % 2 ? 128 : 64;
        const DType dt = (n / 2) % 2 ? DType::bf16 : DType::f16;
        cases.push_back({{1, nq, nk, 6, 2, d, layouts[n % 3], m, dt}, cap, n % 5 == 2});
        ++n;
      }
    }
  }
  // The other head dims: 16, 32 and 256 (the Hopper kernels have 256 in both passes, the backward on the
  // wide-head kernel; the deterministic backward and the others run on mma.sync), 80 on the padded path (its
  // copies at 128 on either family); GQA 6 / 1.
  for (int64_t d : {16, 32, 80, 256}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      cases.push_back({{1, 200, 300, 6, 1, d, layouts[d % 3], Mask::bottom_right, dt}, {50, 0}, dt == DType::f16});
      cases.push_back({{2, 129, 97, 2, 2, d, layouts[(d + 1) % 3], Mask::none, dt}, {7, 33, 0, 1, true}, false});
      cases.push_back({{1, 300, 300, 4, 2, d, layouts[(d + 2) % 3], Mask::top_left, dt}, {100, -1, 30.0, 30.0}, d == 256});
    }
  }
  // Long enough for many tiles, blocks and (Hopper) persistent work items: a window of 256 keys, causal,
  // and a two-sided one with soft-capping.
  cases.push_back({{2, 2048, 2048, 8, 2, 128, Layout::bhsd, Mask::top_left, DType::bf16}, {256, -1}, false});
  cases.push_back({{2, 2048, 2048, 8, 2, 128, Layout::bhsd, Mask::top_left, DType::bf16}, {256, -1}, true});
  cases.push_back({{1, 1531, 2100, 16, 4, 64, Layout::sliced, Mask::none, DType::f16}, {200, 300, 30.0, 30.0, true}, false});
  cases.push_back({{1, 2000, 2000, 4, 4, 256, Layout::bshd, Mask::bottom_right, DType::bf16}, {512, -1, 20.0}, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaBandVsReference, ::testing::ValuesIn(band_grid()),
                         [](const ::testing::TestParamInfo<VariantGpuCase>& info) {
                           return variant_gpu_name(info.param);
                         });

// Rows the window leaves without keys, in whole query tiles and within tiles, on both families and in both
// backward modes: o = 0 and lse = -inf exactly (never NaN), dq = 0; keys no query sees get dk = dv = 0.
// Top-left with Nq > Nk and a left window: queries past Nk + left see nothing; Nq < Nk: keys past Nq + right
// are seen by nobody; bottom-right with Nq > Nk and window (0, 0): the first Nq - Nk queries see nothing.
TEST(CudaBand, RowsAndKeysOutsideTheBandAreExactZeros) {
  SKIP_WITHOUT_GPU();
  const VariantGpuCase cases[] = {
      {{1, 700, 100, 2, 1, 64, Layout::bshd, Mask::top_left, DType::bf16}, {5, -1}, false},
      {{1, 700, 100, 2, 1, 128, Layout::bshd, Mask::top_left, DType::f16}, {5, -1}, true},
      {{2, 100, 700, 2, 2, 64, Layout::bhsd, Mask::none, DType::bf16}, {3, 10}, false},
      {{2, 100, 700, 4, 2, 128, Layout::sliced, Mask::none, DType::f16}, {3, 10, 30.0, 30.0}, true},
      {{1, 600, 64, 4, 4, 64, Layout::bshd, Mask::none, DType::bf16}, {0, 0, 0, 1, true}, false},
      {{1, 600, 64, 4, 4, 128, Layout::bshd, Mask::bottom_right, DType::bf16}, {0, -1}, false},
  };
  for (const VariantGpuCase& v : cases) {
    if (!v.deterministic) expect_band_matches_oracle(v, "auto");
    expect_band_matches_oracle(v, "mma");
  }
}

// A problem with a window or soft-capping plans the mma.sync family (which the Hopper kernels may then take
// over) and runs; the fp32 and naive CUDA kernels refuse them by name.
TEST(CudaBand, Fp32AndNaiveKernelsRefuseTheBandByName) {
  SKIP_WITHOUT_GPU();
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    const DType dtype = impl == AttentionImpl::flash ? DType::f32 : DType::bf16;
    Tensor q = Tensor::empty({1, 32, 2, 64}, dtype, Device::cuda), o = Tensor::empty({1, 32, 2, 64}, dtype, Device::cuda);
    Tensor lse = Tensor::empty({1, 2, 32}, DType::f32, Device::cuda);
    fill_normal(q, 3);
    AttentionOptions opt;
    opt.impl = impl;
    opt.window_size_left = 4;
    expect_error([&] { attention_forward(q, q, q, o, lse, opt); }, {"window_size_left/window_size_right"});
    opt.window_size_left = -1;
    opt.softcap = 30;
    expect_error([&] { attention_forward(q, q, q, o, lse, opt); }, {"softcap"});
  }
}

// ---- ALiBi and attention sinks (mma.sync's masked kernels; the Hopper ones' own instantiations where
// hopper_alibi_sink_route() holds, off by default) ----

struct AlibiSinkGpuCase {
  VariantGpuCase v;
  int alibi = 0;  // 0: none; 1: slopes [Hq]; 2: slopes [B, Hq]
  bool sink = false;
};

std::string alibi_sink_name(const AlibiSinkGpuCase& a) {
  std::string s = variant_gpu_name(a.v);
  if (a.alibi) s += a.alibi == 1 ? "_alibi" : "_alibiB";
  if (a.sink) s += "_sink";
  return s;
}
void PrintTo(const AlibiSinkGpuCase& a, std::ostream* os) { *os << alibi_sink_name(a); }

// The slopes and sinks of a case on the host (for the oracle) and their device copies (for the kernels), and
// the device dlearnable_sink, NaN-poisoned. Slopes 2^(-8(h+1)/Hq) (ALiBi's geometric sequence), times
// 1 + 0.3·b per batch for [B, Hq]; sinks N-ish around 0.5 with every fifth head -inf (no sink).
struct SlopesAndSinks {
  Tensor slopes, sinks, device_slopes, device_sinks, device_dsink;
  SlopesAndSinks(const AlibiSinkGpuCase& a) {
    const Case& c = a.v.c;
    if (a.alibi) {
      const int64_t rows = a.alibi == 2 ? c.B : 1;
      slopes = a.alibi == 2 ? Tensor::empty({rows, c.Hq}, DType::f32) : Tensor::empty({c.Hq}, DType::f32);
      for (int64_t b = 0; b < rows; ++b)
        for (int64_t h = 0; h < c.Hq; ++h) {
          slopes.view().ptr<float>()[b * c.Hq + h] =
              float(std::exp2(-8.0 * double(h + 1) / double(c.Hq)) * (1 + 0.3 * double(b)));
        }
      device_slopes = a.alibi == 2 ? Tensor::empty({rows, c.Hq}, DType::f32, Device::cuda)
                                   : Tensor::empty({c.Hq}, DType::f32, Device::cuda);
      copy_into(device_slopes.view(), slopes.view());
    }
    if (a.sink) {
      sinks = Tensor::empty({c.Hq}, DType::f32);
      for (int64_t h = 0; h < c.Hq; ++h) {
        sinks.view().ptr<float>()[h] = h % 5 == 4 ? -INFINITY : float(1.5 * std::sin(1.7 * double(h) + 0.3) + 0.5);
      }
      device_sinks = Tensor::empty({c.Hq}, DType::f32, Device::cuda);
      copy_into(device_sinks.view(), sinks.view());
      Tensor poison = Tensor::empty({c.Hq}, DType::f32);
      fill_value(poison.view(), std::numeric_limits<double>::quiet_NaN());
      device_dsink = Tensor::empty({c.Hq}, DType::f32, Device::cuda);
      copy_into(device_dsink.view(), poison.view());
    }
  }
  // `o` with the host slopes and sinks (the backward's dsink then goes to Problem::dsink).
  AttentionOptions on_host(AttentionOptions o) const {
    if (slopes.numel() > 0) o.alibi_slopes = slopes.view();
    if (sinks.numel() > 0) o.learnable_sink = sinks.view();
    return o;
  }
  AttentionOptions on_device(AttentionOptions o) const {
    if (device_slopes.numel() > 0) o.alibi_slopes = device_slopes.view();
    if (device_sinks.numel() > 0) {
      o.learnable_sink = device_sinks.view();
      o.dlearnable_sink = device_dsink.view();
    }
    return o;
  }
};

// o, dq, dk, dv, lse and dlearnable_sink of the CUDA flash kernels (FLASHLM_ATTENTION_KERNEL `family`: "auto"
// leaves ALiBi and sinks on mma.sync unless hopper_alibi_sink_route() holds) against the fp64 reference with
// the same slopes and sinks; `label` names the run in messages (the family by default).
void expect_alibi_sink_matches_oracle(const AlibiSinkGpuCase& a, const char* family, const char* label = nullptr) {
  const Case& c = a.v.c;
  const std::string name = alibi_sink_name(a) + "_" + (label != nullptr ? label : family);
  const SlopesAndSinks in(a);
  const AttentionOptions flash = band_options(a.v, AttentionImpl::flash);
  const AttentionOptions naive = in.on_host(band_options(a.v, AttentionImpl::naive));
  Problem ours(c, c.layout, c.dtype, 47000 + static_cast<uint64_t>(c.Nq * 5 + c.Nk * 3 + c.D + a.alibi * 11));
  with_kernel_choice(family, [&] { ours.run_on_device(in.on_device(flash)); });
  if (a.sink) copy_into(ours.dsink.view(), in.device_dsink.view());
  Problem ref(ours, c);
  ref.run(naive);
  Problem lowp(c, c.layout, c.dtype, 0);
  expect_outputs_near_oracle(c, name, ours, ref, lowp, naive);
  // lse: -inf exactly where the oracle's is (no key and no sink), else close (the sink alone: lse = sink).
  Tensor lse_ours = to_f64(ours.lse), lse_ref = to_f64(ref.lse);
  for (int64_t i = 0; i < lse_ref.numel(); ++i) {
    const double x = lse_ours.view().ptr<double>()[i], y = lse_ref.view().ptr<double>()[i];
    if (std::isinf(y)) {
      EXPECT_EQ(x, y) << "lse[" << i << "] of " << name;
    } else {
      EXPECT_NEAR(x, y, 1e-3 * std::max(1.0, std::fabs(y))) << "lse[" << i << "] of " << name;
    }
  }
  if (a.sink) {
    expect_dsink_matches(c, ref, ours.dsink.view(), lowp.dsink.view(), in.sinks.view(), cuda_flash_tolerance, name);
  }
}

class CudaAlibiSinkVsReference : public ::testing::TestWithParam<AlibiSinkGpuCase> {};

TEST_P(CudaAlibiSinkVsReference, MmaSyncMatchesFp64Oracle) {
  SKIP_WITHOUT_GPU();
  const AlibiSinkGpuCase& a = GetParam();
  const HopperAlibiSinkRoute route(false);
  if (!a.v.deterministic) expect_alibi_sink_matches_oracle(a, "auto");
  expect_alibi_sink_matches_oracle(a, "mma");
}

// The same grid with the Hopper route on: head dims 64, 128 and 256 run the Hopper forward and backward (the
// deterministic mode: the Hopper forward, the mma.sync backward), the others mma.sync
// (CudaAlibiSink.HopperRouteFollowsTheSwitch checks the choice).
TEST_P(CudaAlibiSinkVsReference, HopperMatchesFp64Oracle) {
  SKIP_WITHOUT_HOPPER();
  const HopperAlibiSinkRoute route(true);
  expect_alibi_sink_matches_oracle(GetParam(), "auto", "hopper");
}

std::vector<AlibiSinkGpuCase> alibi_sink_grid() {
  std::vector<AlibiSinkGpuCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const std::pair<int, bool> variants[] = {{1, false}, {2, false}, {0, true}, {1, true}, {2, true}};
  int n = 0;
  // Head dims 64 and 128, both dtypes, every mask, GQA 8 / 2, ragged lengths both ways (bottom-right with
  // Nq > Nk leaves rows without keys: with a sink they get o = 0, lse = sink).
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {17, 130}, {130, 17}, {257, 257}, {1000, 333}}) {
    for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
      for (auto [alibi, sink] : variants) {
        const int64_t d = n % 2 ? 128 : 64;
        const DType dt = (n / 2) % 2 ? DType::bf16 : DType::f16;
        Band b;
        b.bottom_right = m == Mask::none && n % 3 == 1;
        cases.push_back({{{n % 4 == 0 ? 2 : 1, nq, nk, 8, 2, d, layouts[n % 3], m, dt}, b, n % 7 == 3}, alibi, sink});
        ++n;
      }
    }
  }
  // With a window and soft-capping (the cap's slope taken without the bias), both backward modes.
  const Band bands[] = {{64, 0}, {20, 40, 0, 1, true}, {-1, -1, 30.0, 30.0}, {100, 10, 20.0, 30.0}, {0, 0}};
  for (const Band& w : bands) {
    for (auto [alibi, sink] : {std::pair<int, bool>{1, true}, {2, true}}) {
      for (bool det : {false, true}) {
        const int64_t d = n % 2 ? 128 : 64;
        const DType dt = n % 3 ? DType::bf16 : DType::f16;
        cases.push_back({{{2, 300, 700, 8, 2, d, layouts[n % 3], n % 2 ? Mask::top_left : Mask::none, dt}, w, det},
                         alibi,
                         sink});
        ++n;
      }
    }
  }
  // The other head dims (16, 32, 256 and the padded 80), GQA 6 / 1 and MHA.
  for (int64_t d : {16, 32, 80, 256}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      cases.push_back({{{1, 200, 300, 6, 1, d, layouts[d % 3], Mask::bottom_right, dt}, {}, dt == DType::f16}, 1, true});
      cases.push_back({{{2, 129, 97, 2, 2, d, layouts[(d + 1) % 3], Mask::none, dt}, {7, 33, 30.0, 30.0}, false}, 2, true});
    }
  }
  // Many tiles and blocks.
  cases.push_back({{{2, 2048, 2048, 8, 2, 128, Layout::bhsd, Mask::top_left, DType::bf16}, {}, false}, 1, true});
  cases.push_back({{{2, 2048, 2048, 8, 2, 128, Layout::bhsd, Mask::none, DType::f16}, {}, true}, 2, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaAlibiSinkVsReference, ::testing::ValuesIn(alibi_sink_grid()),
                         [](const ::testing::TestParamInfo<AlibiSinkGpuCase>& info) {
                           return alibi_sink_name(info.param);
                         });

// A CUDA call with ALiBi, a sink or both is planned on mma.sync and, with FLASHLM_ATTENTION_KERNEL=auto and the
// Hopper route off (the default), stays there in both passes (the Hopper kernels decline them), where the same
// problem without them takes the Hopper kernels on an sm_90 GPU; it runs. So does a head dim of v's own (64 with
// 32: mma.sync on copies padded to 64, which the Hopper kernels have no pair for), with or without them.
TEST(CudaAlibiSink, PlannedOnMmaSyncNeverHopperWithOrWithoutAHeadDimVOfItsOwn) {
  SKIP_WITHOUT_GPU();
#ifndef FLASHLM_WITH_CUDA
  GTEST_SKIP() << "built without the CUDA backends' declarations";
#else
  const HopperAlibiSinkRoute route(false);  // FLASHLM_HOPPER_ALIBI_SINK=0
  Tensor q = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda), o = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda);
  Tensor lse = Tensor::empty({1, 2, 300}, DType::f32, Device::cuda), per_head = Tensor::empty({2}, DType::f32, Device::cuda);
  Tensor dq = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda), dk = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda);
  Tensor dv = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda), dsink = Tensor::empty({2}, DType::f32, Device::cuda);
  fill_normal(q, 3);
  fill_normal(per_head, 4);
  with_kernel_choice("auto", [&] {
    // The family each pass runs: the plan, then flash_kernel_family's choice on these views (dout = q).
    auto families = [&](const AttentionOptions& opt) {
      const AttentionProblem pf = validate_attention_forward(q, q, q, o, lse, opt);
      const CudaAttentionPlan plan_f = plan_cuda_attention("attention_forward", pf, opt.impl, AttentionPass::forward);
      const AttentionProblem pb = validate_attention_backward(q, q, q, o, lse, q, dq, dk, dv, opt);
      const CudaAttentionPlan plan_b = plan_cuda_attention("attention_backward", pb, opt.impl, AttentionPass::backward);
      EXPECT_EQ(plan_f.family, CudaKernelFamily::mma_sync);
      EXPECT_EQ(plan_b.family, CudaKernelFamily::mma_sync);
      return std::pair{flash_kernel_family(plan_f, AttentionPass::forward, pf, q, q, q, o, TensorView{}, false),
                       flash_kernel_family(plan_b, AttentionPass::backward, pb, q, q, q, o, q, false)};
    };
#ifdef FLASHLM_WITH_SM90
    if (on_sm90()) {  // the control: the same problem without ALiBi or a sink takes the Hopper kernels
      const auto plain = families(AttentionOptions{});
      EXPECT_EQ(plain.first, CudaKernelFamily::hopper);
      EXPECT_EQ(plain.second, CudaKernelFamily::hopper);
    }
#endif
    for (int which : {1, 2, 3}) {  // ALiBi, a sink, both
      SCOPED_TRACE(which == 1 ? "alibi" : which == 2 ? "sink" : "alibi and sink");
      AttentionOptions opt;
      if (which & 1) opt.alibi_slopes = per_head.view();
      if (which & 2) opt.learnable_sink = per_head.view();
      const auto chosen = families(opt);
      EXPECT_EQ(chosen.first, CudaKernelFamily::mma_sync);
      EXPECT_EQ(chosen.second, CudaKernelFamily::mma_sync);
      EXPECT_NO_THROW(attention_forward(q, q, q, o, lse, opt));
      if (which & 2) opt.dlearnable_sink = dsink.view();
      EXPECT_NO_THROW(attention_backward(q, q, q, o, lse, q, dq, dk, dv, opt));
    }
  });
  Tensor v32 = Tensor::empty({1, 300, 2, 32}, DType::bf16, Device::cuda), o32 = Tensor::empty({1, 300, 2, 32}, DType::bf16, Device::cuda);
  Tensor dv32 = Tensor::empty({1, 300, 2, 32}, DType::bf16, Device::cuda);
  fill_normal(v32, 5);
  with_kernel_choice("auto", [&] {
    AttentionOptions opt;
    for (bool with_alibi_sink : {false, true}) {
      SCOPED_TRACE(with_alibi_sink ? "head_dim_v 32 with alibi and sink" : "head_dim_v 32");
      if (with_alibi_sink) {
        opt.alibi_slopes = opt.learnable_sink = per_head.view();
        opt.dlearnable_sink = dsink.view();
      }
      const AttentionProblem p = validate_attention_forward(q, q, v32, o32, lse, opt);
      const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", p, opt.impl, AttentionPass::forward);
      EXPECT_EQ(plan.family, CudaKernelFamily::mma_sync);
      EXPECT_TRUE(plan.padded);
      EXPECT_EQ(flash_kernel_family(plan, AttentionPass::forward, p, q, q, v32, o32, TensorView{}, false),
                CudaKernelFamily::mma_sync);
      EXPECT_NO_THROW(attention_forward(q, q, v32, o32, lse, opt));
      EXPECT_NO_THROW(attention_backward(q, q, v32, o32, lse, o32, dq, dk, dv32, opt));
    }
  });
#endif
}


// The Hopper route follows hopper_alibi_sink_route(): on, an ALiBi or sink problem takes the Hopper kernels on
// an sm_90 GPU where they cover it (the forward and the backward at head dims 64, 128 and 256, not the
// deterministic backward), and FLASHLM_ATTENTION_KERNEL=mma still forces mma.sync; off, it stays on
// mma.sync. Every choice runs.
TEST(CudaAlibiSink, HopperRouteFollowsTheSwitch) {
  SKIP_WITHOUT_HOPPER();
#ifdef FLASHLM_WITH_SM90
  for (int64_t d : {32, 64, 128, 256}) {
    auto make = [&](int64_t rows, int64_t dim) { return Tensor::empty({1, rows, 2, dim}, DType::bf16, Device::cuda); };
    Tensor q = make(300, d), o = make(300, d), dq = make(300, d), dk = make(300, d), dv = make(300, d);
    Tensor lse = Tensor::empty({1, 2, 300}, DType::f32, Device::cuda);
    Tensor per_head = Tensor::empty({2}, DType::f32, Device::cuda);
    Tensor dsink = Tensor::empty({2}, DType::f32, Device::cuda);
    fill_normal(q, 3);
    fill_normal(per_head, 4);
    for (int which : {1, 2, 3}) {  // ALiBi, a sink, both
      AttentionOptions opt;
      if (which & 1) opt.alibi_slopes = per_head.view();
      if (which & 2) {
        opt.learnable_sink = per_head.view();
        opt.dlearnable_sink = dsink.view();
      }
      for (bool on : {false, true}) {
        const HopperAlibiSinkRoute route(on);
        for (const char* choice : {"auto", "mma"}) {
          SCOPED_TRACE(fmt::format("d {}, {}, route {}, FLASHLM_ATTENTION_KERNEL={}", d,
                                   which == 1 ? "alibi" : which == 2 ? "sink" : "alibi and sink", on ? "on" : "off",
                                   choice));
          with_kernel_choice(choice, [&] {
            const AttentionProblem pf = validate_attention_forward(q, q, q, o, lse, opt);
            const CudaAttentionPlan plan_f =
                plan_cuda_attention("attention_forward", pf, opt.impl, AttentionPass::forward);
            const AttentionProblem pb = validate_attention_backward(q, q, q, o, lse, q, dq, dk, dv, opt);
            const CudaAttentionPlan plan_b =
                plan_cuda_attention("attention_backward", pb, opt.impl, AttentionPass::backward);
            const bool hopper = on && std::string_view(choice) == "auto";
            const auto want = [&](bool covered) {
              return hopper && covered ? CudaKernelFamily::hopper : CudaKernelFamily::mma_sync;
            };
            EXPECT_EQ(flash_kernel_family(plan_f, AttentionPass::forward, pf, q, q, q, o, TensorView{}, false),
                      want(d >= 64));
            EXPECT_EQ(flash_kernel_family(plan_b, AttentionPass::backward, pb, q, q, q, o, q, false),
                      want(d >= 64));
            EXPECT_EQ(flash_kernel_family(plan_b, AttentionPass::backward, pb, q, q, q, o, q, true),
                      CudaKernelFamily::mma_sync);
            EXPECT_NO_THROW(attention_forward(q, q, q, o, lse, opt));
            EXPECT_NO_THROW(attention_backward(q, q, q, o, lse, q, dq, dk, dv, opt));
          });
        }
      }
    }
  }
#endif
}

// NaN in a q row, a NaN slope and a NaN sink (and a head without a sink) reach the same elements of o, lse, dq,
// dk, dv and dlearnable_sink on the Hopper kernels as on mma.sync, and inf in a k row the same non-finite ones.
// No mask: every pair is visible, so where a NaN goes is the math's alone, not the kernels' tiles (under a
// causal mask 0 · NaN in a product may reach masked pairs of a visited tile: test_attention_nan.cpp).
TEST(CudaAlibiSink, HopperAndMmaSyncPropagateNanAndInfAlike) {
  SKIP_WITHOUT_HOPPER();
  constexpr int64_t B = 2, Nq = 150, Nk = 200, Hq = 4, Hk = 2;
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  for (int64_t d : {64, 128, 256}) {
    for (bool inf_in_k : {false, true}) {
      auto host = [&](int64_t rows, int64_t heads, uint64_t seed) {
        Tensor t = Tensor::empty({B, rows, heads, d}, DType::bf16);
        fill_normal(t.view(), seed);
        return t;
      };
      Tensor q = host(Nq, Hq, 61), k = host(Nk, Hk, 62), v = host(Nk, Hk, 63), dout = host(Nq, Hq, 64);
      if (inf_in_k) fill_value(k.view().slice(0, 1, 2).slice(1, 33, 34).slice(2, 0, 1).slice(3, 5, 6), INFINITY);
      else fill_value(q.view().slice(0, 0, 1).slice(1, 20, 21).slice(2, 1, 2).slice(3, 3, 4), kNaN);
      Tensor slopes = Tensor::empty({Hq}, DType::f32), sinks = Tensor::empty({Hq}, DType::f32);
      const float slope_values[Hq] = {0.25f, 0.0625f, NAN, 0.5f}, sink_values[Hq] = {-INFINITY, 0.5f, 1.f, NAN};
      for (int64_t h = 0; h < Hq; ++h) {
        slopes.view().ptr<float>()[h] = slope_values[h];
        sinks.view().ptr<float>()[h] = sink_values[h];
      }
      // Every output of one run, on the host as fp64, in the order o, lse, dq, dk, dv, dsink.
      auto run = [&](bool on_hopper) {
        auto device = [](const Tensor& t) {
          Tensor g = Tensor::empty(std::span<const int64_t>(t.view().sizes.data(), size_t(t.view().ndim)),
                                   t.view().dtype, Device::cuda);
          copy_into(g.view(), t.view());
          return g;
        };
        Tensor gq = device(q), gk = device(k), gv = device(v), gdout = device(dout), gslopes = device(slopes),
               gsinks = device(sinks);
        Tensor go = device(dout), gdq = device(q), gdk = device(k), gdv = device(v), gdsink = device(sinks);
        Tensor glse = Tensor::empty({B, Hq, Nq}, DType::f32, Device::cuda);
        AttentionOptions opt;
        opt.alibi_slopes = gslopes.view();
        opt.learnable_sink = gsinks.view();
        opt.dlearnable_sink = gdsink.view();
        const HopperAlibiSinkRoute route(on_hopper);
        with_kernel_choice(on_hopper ? "auto" : "mma", [&] {
          attention_forward(gq, gk, gv, go, glse, opt);
          attention_backward(gq, gk, gv, go, glse, gdout, gdq, gdk, gdv, opt);
        });
        std::vector<Tensor> out;
        for (const Tensor* t : {&go, &glse, &gdq, &gdk, &gdv, &gdsink}) {
          Tensor h = Tensor::empty(std::span<const int64_t>(t->view().sizes.data(), size_t(t->view().ndim)),
                                   t->view().dtype);
          copy_into(h.view(), t->view());
          out.push_back(to_f64(h.view()));
        }
        return out;
      };
      const std::vector<Tensor> hopper = run(true), mma = run(false);
      const char* names[] = {"o", "lse", "dq", "dk", "dv", "dsink"};
      for (size_t n = 0; n < hopper.size(); ++n) {
        const double* a = hopper[n].view().ptr<double>();
        const double* b = mma[n].view().ptr<double>();
        int64_t mismatches = 0, non_finite = 0;
        for (int64_t i = 0; i < hopper[n].numel(); ++i) {
          non_finite += !std::isfinite(b[i]);
          if (std::isnan(a[i]) != std::isnan(b[i]) || std::isinf(a[i]) != std::isinf(b[i])) {
            if (++mismatches <= 5) {
              ADD_FAILURE() << names[n] << "[" << i << "]: hopper " << a[i] << ", mma.sync " << b[i] << " (d " << d
                            << (inf_in_k ? ", inf in k" : ", NaN in q") << ")";
            }
          }
        }
        EXPECT_EQ(mismatches, 0) << names[n] << " (d " << d << (inf_in_k ? ", inf in k" : ", NaN in q") << ")";
        EXPECT_GT(non_finite, 0) << names[n] << ": the case reaches it (d " << d << ")";
      }
    }
  }
}

}  // namespace
