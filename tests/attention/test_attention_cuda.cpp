// CUDA attention (flash on tensor cores / CUDA cores, and the naive cuBLAS baseline) against the fp64
// reference over the same grid as the CPU tests. Every test skips when no GPU is visible.
#include <tuple>
#include <gtest/gtest.h>

#include "gpu_testing.h"

#include <cmath>
#include <vector>

#include "attention/attention_testing.h"
#include "attention/backends.h"
#include "attention/capabilities.h"
#ifdef FLASHLM_WITH_SM90
#include "attention/cuda/hopper/hopper.h"
#endif
#include "attention/problem.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"
#include "flashlm/profile.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

// deterministic: the backward's separate dQ pass (a minority of the cases); the others take the default,
// dQ by fp32 atomics from the dK/dV kernel.
struct GpuCase {
  Case c;
  bool deterministic;
};

std::string gpu_case_name(const GpuCase& g) { return case_name(g.c) + (g.deterministic ? "_det" : "_atomic"); }
void PrintTo(const GpuCase& g, std::ostream* os) { *os << gpu_case_name(g); }

struct Errors {
  double o, dq, dk, dv, lse;
};

// Max-abs errors of every output of `got` against the fp64 oracle `ref`.
Errors errors_of(const Problem& got, const Problem& ref, bool with_backward) {
  Errors e{};
  e.o = max_abs_diff(got.o.view, ref.o.view);
  if (with_backward) {
    e.dq = max_abs_diff(got.dq.view, ref.dq.view);
    e.dk = max_abs_diff(got.dk.view, ref.dk.view);
    e.dv = max_abs_diff(got.dv.view, ref.dv.view);
  }
  Tensor a = to_f64(got.lse), b = to_f64(ref.lse);
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.view().ptr<double>()[i], y = b.view().ptr<double>()[i];
    const double d = std::isinf(y) ? (x == y ? 0.0 : INFINITY) : std::fabs(x - y);
    e.lse = std::isnan(d) ? INFINITY : std::max(e.lse, d);
  }
  return e;
}

// Whether the capability table has a CUDA flash backward for the case (padded or not).
bool has_cuda_backward(const Case& c) {
  AttentionProblem p;
  p.dtype = c.dtype;
  p.head_dim = c.D;
  try {
    plan_cuda_attention("attention_backward", p, AttentionImpl::flash, AttentionPass::backward);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The flash kernels' outputs (forward, and the backward where the case has one) and the naive GPU path's
// against the fp64 oracle on the same rounded inputs: flash within twice the naive path's error.
void expect_flash_matches_oracle(const GpuCase& g) {
  const Case c = g.c;
  const bool backward = has_cuda_backward(c);
  AttentionOptions flash = options_for(c.mask, AttentionImpl::flash);
  flash.deterministic = g.deterministic;
  const AttentionOptions naive = options_for(c.mask, AttentionImpl::naive);

  Problem ours(c, c.layout, c.dtype, 7000 + static_cast<uint64_t>(c.Nq * 3 + c.Nk));
  Problem baseline(c, c.layout, c.dtype, 7000 + static_cast<uint64_t>(c.Nq * 3 + c.Nk));  // same inputs
  ours.run_on_device(flash, backward);
  baseline.run_on_device(naive, backward);
  Problem ref(ours, c);
  ref.run(naive);  // fp64 on the CPU, from the same rounded inputs

  const Errors e = errors_of(ours, ref, backward), n = errors_of(baseline, ref, backward);
  auto check = [&](const char* name, double err, double naive_err, const TensorView& want) {
    const double scale = std::max(1.0, max_abs(want));
    // The naive GPU path must itself be sane, or it would loosen the bar for flash.
    EXPECT_LE(naive_err, (c.dtype == DType::f32 ? 1e-4 : 3e-2) * scale) << "naive " << name << " of " << case_name(c);
    const double tol = c.dtype == DType::f32 ? 1e-4 * scale : 2 * naive_err + 1e-3;
    EXPECT_LE(err, tol) << "flash " << name << " of " << gpu_case_name(g) << " (naive error " << naive_err
                        << ", max |ref| " << max_abs(want) << ")";
  };
  check("o", e.o, n.o, ref.o.view);
  EXPECT_LE(e.lse, 1e-3) << "flash lse of " << case_name(c);
  EXPECT_LE(n.lse, 1e-3) << "naive lse of " << case_name(c);
  if (backward) {
    check("dq", e.dq, n.dq, ref.dq.view);
    check("dk", e.dk, n.dk, ref.dk.view);
    check("dv", e.dv, n.dv, ref.dv.view);
  }
}

class CudaVsReference : public ::testing::TestWithParam<GpuCase> {};

TEST_P(CudaVsReference, FlashAndNaiveMatchFp64Oracle) {
  SKIP_WITHOUT_GPU();
  expect_flash_matches_oracle(GetParam());
}

std::vector<GpuCase> gpu_grid() {
  std::vector<GpuCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  int n = 0;
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 77}, {17, 17}, {17, 130}, {127, 64}, {127, 127},
                        {1000, 1000}, {1000, 333}, {65, 1000}}) {
    for (Mask m : masks) {
      const DType dt = n % 2 ? DType::bf16 : DType::f16;
      cases.push_back({{2, nq, nk, 2, 2, 64, layouts[n % 3], m, dt}, n % 4 == 3});
      ++n;
    }
  }
  // The same shapes at head dim 128 (the Hopper kernel's other head dim on sm_90), in the other dtype.
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 77}, {17, 130}, {127, 64}, {1000, 333}, {65, 1000}, {300, 129}}) {
    for (Mask m : masks) {
      const DType dt = n % 2 ? DType::f16 : DType::bf16;
      cases.push_back({{2, nq, nk, 4, 2, 128, layouts[n % 3], m, dt}, false});
      ++n;
    }
  }
  // Head dim 256 (64-key tiles: 130 and 1000 keys end in a partial one; 32-row query tiles in the mma.sync
  // dK/dV kernel, 64 in the dQ pass and in the Hopper wide-head kernel, which runs the atomic mode on sm_90),
  // GQA 4 / 2: case i of this block runs mask i % 3, the deterministic mode where i is odd and bf16 where
  // i / 2 is odd, so that its 18 cases hold every (mask, mode, dtype).
  int i = 0;
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 77}, {17, 130}, {127, 64}, {1000, 333}, {65, 1000}, {300, 129}}) {
    for (Mask m : masks) {
      const DType dt = (i / 2) % 2 ? DType::bf16 : DType::f16;
      cases.push_back({{2, nq, nk, 4, 2, 256, layouts[(i / 3) % 3], m, dt}, i % 2 == 1});
      ++i;
    }
  }
  for (int64_t d : {16, 32, 64, 128, 256}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      cases.push_back({{1, 129, 97, 4, 2, d, layouts[d % 3], Mask::top_left, dt}, false});
      cases.push_back({{2, 200, 300, 6, 1, d, layouts[(d + 1) % 3], Mask::bottom_right, dt}, true});
      cases.push_back({{1, 257, 257, 2, 2, d, layouts[(d + 2) % 3], Mask::none, dt}, d % 64 == 0});
    }
  }
  // Head dims without a kernel of their own run the next larger one on zero-padded copies (80: the 2.7B
  // model's), in every dtype.
  for (int64_t d : {40, 80, 96, 160}) {
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      cases.push_back({{2, 130, 97, 4, 2, d, layouts[d % 3], Mask::bottom_right, dt}, dt == DType::f16});
      cases.push_back({{1, 65, 200, 2, 2, d, layouts[(d + 1) % 3], Mask::none, dt}, false});
    }
  }
  for (Mask m : masks) {
    cases.push_back({{2, 150, 131, 4, 2, 64, layouts[static_cast<int>(m)], m, DType::f32}, false});
    cases.push_back({{1, 300, 300, 2, 1, 128, layouts[static_cast<int>(m)], m, DType::f32}, false});
  }
  // Long enough for several key and query tiles in every kernel, and many thread blocks.
  cases.push_back({{2, 2048, 2048, 8, 2, 128, Layout::bhsd, Mask::top_left, DType::bf16}, false});
  cases.push_back({{2, 2048, 2048, 8, 2, 128, Layout::bhsd, Mask::top_left, DType::bf16}, true});
  cases.push_back({{1, 1531, 2100, 4, 4, 64, Layout::sliced, Mask::bottom_right, DType::f16}, false});
  // Head dim 256 over many tiles of both kernels and a GQA group of 4, in both backward modes.
  cases.push_back({{2, 1100, 900, 8, 2, 256, Layout::sliced, Mask::bottom_right, DType::bf16}, false});
  cases.push_back({{2, 1100, 900, 8, 2, 256, Layout::sliced, Mask::top_left, DType::f16}, true});
  // Head dim 64 with more work items than an H200 has SMs, so that persistent blocks walk several tile
  // pairs; 2000 rows leave the last query tile partial (with 192-row tiles its third warpgroup has none).
  cases.push_back({{2, 2000, 2048, 16, 4, 64, Layout::bshd, Mask::bottom_right, DType::bf16}, false});
  // Many key blocks of little work each (65 query rows): more backward tiles than an H100 or H200 has SMs, so
  // that the Hopper backward's persistent launch (FLASHLM_SM90_BWD_SCHEDULE=persistent) walks several per
  // block, small enough for the sanitizer runs; GQA 4, key blocks at the end that no query sees.
  cases.push_back({{2, 65, 2100, 16, 4, 64, Layout::bshd, Mask::top_left, DType::bf16}, false});
  cases.push_back({{1, 65, 2100, 16, 8, 128, Layout::sliced, Mask::bottom_right, DType::f16}, false});
  // Long enough for the head-dim-64 forward to choose its 192-row tiles (sm90_forward_d64_tile).
  cases.push_back({{1, 4096, 4096, 2, 1, 64, Layout::bshd, Mask::none, DType::bf16}, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaVsReference, ::testing::ValuesIn(gpu_grid()),
                         [](const ::testing::TestParamInfo<GpuCase>& info) { return gpu_case_name(info.param); });

TEST(CudaAttention, FullyMaskedRowsGiveZerosAndNegInfNeverNaN) {
  SKIP_WITHOUT_GPU();
  const Case c{1, 40, 16, 2, 1, 64, Layout::bshd, Mask::bottom_right, DType::bf16};  // queries 0..23 see no key
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
    for (bool det : {false, true}) {
      Problem p(c, c.layout, c.dtype, 11);
      AttentionOptions opt = options_for(c.mask, impl);
      opt.deterministic = det;
      p.run_on_device(opt);
      Tensor o = to_f64(p.o.view), dq = to_f64(p.dq.view), lse = to_f64(p.lse);
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t i = 0; i < 24; ++i) {
          EXPECT_EQ(lse.view().ptr<double>()[h * 40 + i], -INFINITY) << attention_impl_name(impl) << " row " << i;
          for (int64_t d = 0; d < 64; ++d) {
            EXPECT_EQ(o.view().ptr<double>()[(i * 2 + h) * 64 + d], 0.0);
            EXPECT_EQ(dq.view().ptr<double>()[(i * 2 + h) * 64 + d], 0.0);
          }
        }
      }
      EXPECT_TRUE(all_finite_or_neg_inf(p.dk.view));
      EXPECT_TRUE(all_finite_or_neg_inf(p.dv.view));
    }
  }
}

// Bottom-right causal with Nq >> Nk: most query tiles see no key at all, so their forward blocks skip the
// key loop and go straight to the epilogue while the block's Q copies may still be landing. Run it
// repeatedly (a race shows up as a run with nonzero rows): every row that sees no key must be exactly 0.
TEST(CudaAttention, QueryTilesThatSeeNoKeyAreZeroEveryRun) {
  SKIP_WITHOUT_GPU();
  const Case c{2, 4096, 64, 4, 4, 64, Layout::bshd, Mask::bottom_right, DType::bf16};  // rows < 4032 see nothing
  AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
  for (int run = 0; run < 10; ++run) {
    Problem p(c, c.layout, c.dtype, 100 + static_cast<uint64_t>(run));
    p.run_on_device(opt);
    Tensor o = to_f64(p.o.view);
    const double* od = o.view().ptr<double>();
    int64_t nonzero = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = 0; i < c.Nq - c.Nk; ++i)
        for (int64_t h = 0; h < c.Hq; ++h)
          for (int64_t d = 0; d < c.D; ++d) nonzero += od[((b * c.Nq + i) * c.Hq + h) * c.D + d] != 0.0;
    ASSERT_EQ(nonzero, 0) << "run " << run << ": elements of rows that see no key are not 0";
  }
}

// On an sm_90 GPU with the Hopper kernels built, the forward of a covered problem takes them; a view TMA
// cannot describe (a zero stride), a head dim they lack and FLASHLM_ATTENTION_KERNEL=mma take the mma.sync
// kernels; any other value of the variable is an error.
TEST(CudaAttention, HopperForwardCoversItsProblemsAndMmaForcesTheFallback) {
  SKIP_WITHOUT_HOPPER();
#ifdef FLASHLM_WITH_SM90
  auto problem_of = [](const TensorView& q, const TensorView& k, const TensorView& o, const TensorView& lse) {
    return validate_attention_forward(q, k, k, o, lse, AttentionOptions{});
  };
  for (int64_t d : {64, 128}) {
    Tensor q = Tensor::empty({2, 300, 4, d}, DType::bf16, Device::cuda), k = Tensor::empty({2, 200, 2, d}, DType::bf16, Device::cuda);
    Tensor o = Tensor::empty({2, 300, 4, d}, DType::bf16, Device::cuda);
    Tensor lse = Tensor::empty({2, 4, 300}, DType::f32, Device::cuda);
    EXPECT_TRUE(flash_forward_sm90_covers(problem_of(q, k, o, lse), q, k, k)) << "d" << d;
    TensorView broadcast = k.view();
    broadcast.strides[0] = 0;  // both batches read the first one's keys
    EXPECT_FALSE(flash_forward_sm90_covers(problem_of(q, broadcast, o, lse), q, broadcast, broadcast)) << "d" << d;
  }
  Tensor q32 = Tensor::empty({1, 300, 2, 32}, DType::bf16, Device::cuda);
  Tensor o32 = Tensor::empty({1, 300, 2, 32}, DType::bf16, Device::cuda);
  Tensor lse32 = Tensor::empty({1, 2, 300}, DType::f32, Device::cuda);
  EXPECT_FALSE(flash_forward_sm90_covers(problem_of(q32, q32, o32, lse32), q32, q32, q32));

  {  // the fallback run of this binary sets FLASHLM_ATTENTION_KERNEL
    const ScopedEnvironment choice("FLASHLM_ATTENTION_KERNEL", "auto");
    EXPECT_EQ(flash_kernel_choice(), FlashKernelChoice::automatic);
  }
  {
    const ScopedEnvironment choice("FLASHLM_ATTENTION_KERNEL", "mma");
    EXPECT_EQ(flash_kernel_choice(), FlashKernelChoice::mma);
  }
  const ScopedEnvironment unknown("FLASHLM_ATTENTION_KERNEL", "wgmma");
  Tensor lse = Tensor::empty({1, 2, 300}, DType::f32, Device::cuda);
  Tensor q = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda);
  Tensor o = Tensor::empty({1, 300, 2, 64}, DType::bf16, Device::cuda);
  fill_normal(q, 1);
  try {
    attention_forward(q, q, q, o, lse);
    ADD_FAILURE() << "expected an error for FLASHLM_ATTENTION_KERNEL=wgmma";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLASHLM_ATTENTION_KERNEL: unknown value 'wgmma'"), std::string::npos) << e.what();
  }
#endif
}

// The unfused path's sub-ops are NVTX ranges, timed by --profile-ranges: QK matmul, softmax, AV matmul in
// the forward; the recomputation and each gradient product in the backward.
// The head-dim-64 forward's tile shapes: the choice from the problem's lengths and mask, each shape forced
// through FLASHLM_SM90_FWD_D64_TILE against the fp64 oracle (ragged rows and keys, both causal alignments,
// GQA, fp16 and bf16), and an unknown value an error naming the variable.
TEST(CudaAttention, HopperD64TileShapesMatchTheReference) {
  SKIP_WITHOUT_HOPPER();
#ifdef FLASHLM_WITH_SM90
  auto tile_of = [](int64_t seq_q, int64_t seq_k, bool causal) {
    AttentionProblem p;
    p.seq_q = seq_q, p.seq_k = seq_k, p.causal = causal, p.head_dim = 64;
    return flash_cuda::sm90_forward_d64_tile(p);
  };
  {  // a test run may force a tile for the grid
    const ScopedEnvironment tile("FLASHLM_SM90_FWD_D64_TILE", "auto");
    using flash_cuda::Sm90D64Tile;
    EXPECT_EQ(tile_of(4096, 4096, false), Sm90D64Tile::rows192_keys128);
    EXPECT_EQ(tile_of(4096, 2048, false), Sm90D64Tile::rows128_keys128);
    EXPECT_EQ(tile_of(8192, 8192, true), Sm90D64Tile::rows128_keys192);
    EXPECT_EQ(tile_of(4096, 4096, true), Sm90D64Tile::rows128_keys128);
    EXPECT_EQ(tile_of(1024, 1024, false), Sm90D64Tile::rows128_keys128);
  }
  const GpuCase cases[] = {
      {{2, 1000, 1000, 4, 2, 64, Layout::bshd, Mask::none, DType::bf16}, false},
      {{1, 700, 1300, 2, 2, 64, Layout::sliced, Mask::bottom_right, DType::f16}, false},
      {{2, 300, 200, 4, 4, 64, Layout::bhsd, Mask::top_left, DType::bf16}, false},
  };
  for (const char* tile : {"128x128", "192x128", "128x192"}) {
    const ScopedEnvironment forced("FLASHLM_SM90_FWD_D64_TILE", tile);
    for (const GpuCase& g : cases) {
      SCOPED_TRACE(std::string("FLASHLM_SM90_FWD_D64_TILE=") + tile);
      expect_flash_matches_oracle(g);
    }
  }
  const ScopedEnvironment unknown("FLASHLM_SM90_FWD_D64_TILE", "256x128");
  try {
    tile_of(64, 64, false);
    ADD_FAILURE() << "expected an error for FLASHLM_SM90_FWD_D64_TILE=256x128";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLASHLM_SM90_FWD_D64_TILE: unknown value '256x128'"), std::string::npos)
        << e.what();
  }
#endif
}

TEST(CudaAttention, NaivePathNamesItsSubOpRanges) {
  SKIP_WITHOUT_GPU();
  const Case c{1, 100, 90, 2, 1, 64, Layout::bshd, Mask::top_left, DType::bf16};
  Problem p(c, c.layout, c.dtype, 21);
  RangeProfiler& prof = RangeProfiler::instance();
  prof.reset();
  prof.enable(true);  // host clock: enough to see which ranges ran
  p.run_on_device(options_for(c.mask, AttentionImpl::naive));
  prof.enable(false);
  std::vector<std::string> names;
  for (const RangeStats& s : prof.summary()) names.push_back(s.name);
  prof.reset();
  for (const char* want : {"attention.qk_matmul", "attention.softmax", "attention.av_matmul", "attention.dp_matmul",
                           "attention.dv_matmul", "attention.softmax_backward", "attention.dq_matmul",
                           "attention.dk_matmul"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want << " was not recorded";
  }
}

// No queries: dK and dV are zero. No keys: O and dQ are zero, logsumexp -inf. Gradients start poisoned.
TEST(CudaAttention, EmptySequencesGiveZeroGradients) {
  SKIP_WITHOUT_GPU();
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{0, 70}, std::pair<int64_t, int64_t>{70, 0}}) {
    for (bool det : {false, true}) {
      Tensor q = Tensor::empty({2, nq, 4, 64}, DType::bf16, Device::cuda), o = Tensor::empty({2, nq, 4, 64}, DType::bf16, Device::cuda);
      Tensor dout = Tensor::empty({2, nq, 4, 64}, DType::bf16, Device::cuda), dq = Tensor::empty({2, nq, 4, 64}, DType::bf16, Device::cuda);
      Tensor k = Tensor::empty({2, nk, 2, 64}, DType::bf16, Device::cuda), v = Tensor::empty({2, nk, 2, 64}, DType::bf16, Device::cuda);
      Tensor dk = Tensor::empty({2, nk, 2, 64}, DType::bf16, Device::cuda), dv = Tensor::empty({2, nk, 2, 64}, DType::bf16, Device::cuda);
      Tensor lse = Tensor::empty({2, 4, nq}, DType::f32, Device::cuda);
      for (const Tensor* t : {&q, &k, &v, &dout}) fill_normal(*t, 5);
      for (const Tensor* t : {&o, &dq, &dk, &dv}) fill_value(*t, 7.0);  // poison: must be overwritten with 0
      AttentionOptions opt;
      opt.deterministic = det;
      attention_forward(q, k, v, o, lse, opt);
      attention_backward(q, k, v, o, lse, dout, dq, dk, dv, opt);
      const std::string what = fmt::format("nq {} nk {} deterministic {}", nq, nk, det);
      for (const Tensor* t : {&o, &dq, &dk, &dv}) {
        Tensor h = to_f64(t->view());
        for (int64_t i = 0; i < h.view().numel(); ++i) ASSERT_EQ(h.view().ptr<double>()[i], 0.0) << what;
      }
      Tensor l = to_f64(lse.view());
      for (int64_t i = 0; i < l.view().numel(); ++i) ASSERT_EQ(l.view().ptr<double>()[i], -INFINITY) << what;
    }
  }
}

TEST(CudaAttention, DeterministicBackwardIsBitwiseReproducible) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 256}) {
    const Case c{2, 1000, 1000, 8, 2, d, Layout::bhsd, Mask::top_left, DType::bf16};
    AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
    opt.deterministic = true;
    Problem a(c, c.layout, c.dtype, 3), b(c, c.layout, c.dtype, 3);
    a.run_on_device(opt);
    b.run_on_device(opt);
    EXPECT_EQ(max_abs_diff(a.dq.view, b.dq.view), 0.0) << d;
    EXPECT_EQ(max_abs_diff(a.dk.view, b.dk.view), 0.0) << d;
    EXPECT_EQ(max_abs_diff(a.dv.view, b.dv.view), 0.0) << d;
  }
}

// Long enough that the atomic mode's fp32 dQ accumulator (4·B·Hq·Nq·D bytes = 143 MiB here) exceeds the
// 128 MiB above which the backward runs one group of key/value heads at a time (one kv head and its two
// query heads per launch here): every gradient must match the deterministic mode's, which never splits.
TEST(CudaAttention, AtomicBackwardSplitOverHeadsMatchesDeterministic) {
  SKIP_WITHOUT_GPU();
  const Case c{1, 70000, 70000, 4, 2, 128, Layout::bshd, Mask::top_left, DType::bf16};
  AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
  Problem split(c, c.layout, c.dtype, 5), whole(c, c.layout, c.dtype, 5);
  split.run_on_device(opt);
  opt.deterministic = true;
  whole.run_on_device(opt);
  for (auto [name, a, b] : {std::tuple{"dq", split.dq.view, whole.dq.view}, std::tuple{"dk", split.dk.view, whole.dk.view},
                            std::tuple{"dv", split.dv.view, whole.dv.view}}) {
    Tensor ref = to_f64(b);
    double scale = 0;
    for (int64_t i = 0; i < ref.view().numel(); ++i) scale = std::max(scale, std::fabs(ref.view().ptr<double>()[i]));
    EXPECT_GT(scale, 0.0) << name;
    // Both are bf16 results of fp32 sums in different orders: a few bf16 ulps apart, never O(1).
    EXPECT_LE(max_abs_diff(a, b), 0.02 * scale) << name;
  }
}

// The atomic backward's accumulator bound splits only where a launch keeps at least three waves of
// blocks: the causal GQA shape of issue 15 (b1, 64 query / 8 key heads, 16k, d128; 64 MiB of accumulator
// per key head, 128 blocks per key head) takes two launches of 4 key heads on 132 SMs, not eight of one;
// a long MHA sequence (547 blocks per head) still runs one head per launch; small problems one launch; head
// dim 256 and the pair (192, 128) count 64-key blocks.
TEST(CudaAttention, BackwardHeadGroupsBoundTheAccumulatorWithoutUnderfillingTheGpu) {
#ifndef FLASHLM_WITH_CUDA
  GTEST_SKIP() << "built without the CUDA backends' declarations";
#else
  AttentionProblem p;
  p.batch = 1;
  p.seq_q = p.seq_k = 16384;
  p.heads_q = 64;
  p.heads_k = 8;
  p.head_dim = 128;
  p.causal = true;
  p.dtype = DType::bf16;
  EXPECT_EQ(backward_accumulator_bytes_per_kv_head(p), size_t{64} << 20);
  EXPECT_EQ(backward_kv_heads_per_launch(p, 132), 4);
  EXPECT_EQ(backward_kv_heads_per_launch(p, 16), 1);  // few SMs: the bytes bound alone
  AttentionProblem mha = p;
  mha.seq_q = mha.seq_k = 70000;
  mha.heads_q = 4;
  mha.heads_k = 2;
  EXPECT_EQ(backward_kv_heads_per_launch(mha, 132), 1);
  AttentionProblem small = p;
  small.seq_q = small.seq_k = 1024;
  EXPECT_EQ(backward_kv_heads_per_launch(small, 132), 8);
  AttentionProblem odd = p;  // 5 key heads needing 4 per launch: launches of 3 and 2, not 4 and 1
  odd.heads_k = 5;
  odd.heads_q = 40;
  EXPECT_EQ(backward_kv_heads_per_launch(odd, 132), 3);
  // Head dim 256: 128 MiB of accumulator per key head, but 64-key blocks, 256 per key head: two key heads
  // per launch keep three waves (counted as 128-key blocks it would take four).
  AttentionProblem wide = p;
  wide.head_dim = 256;
  EXPECT_EQ(backward_accumulator_bytes_per_kv_head(wide), size_t{128} << 20);
  EXPECT_EQ(backward_kv_heads_per_launch(wide, 132), 2);
  // The pair (192, 128), which the Hopper backward runs unpadded: dQ's accumulator over head_dim (96 MiB per
  // key head), the blocks of the kernel its padded problem would run (64 keys, as the wide Hopper kernel's).
  AttentionProblem pair = p;
  pair.head_dim = 192;
  pair.head_dim_v = 128;
  EXPECT_EQ(backward_accumulator_bytes_per_kv_head(pair), size_t{96} << 20);
  EXPECT_EQ(backward_kv_heads_per_launch(pair, 132), 2);
#endif
}

// The mma.sync backward's shared memory fits sm_80's 163 KiB per block at every head dim (sm_90 grants
// 227 KiB); a GPU that grants less than a head dim needs (sm_86 and sm_89: 99 KiB, at head dims 128 and
// 256) gets an Error naming the head dim instead of a failed launch, and the naive path still runs it.
TEST(CudaAttention, BackwardSharedMemoryFitsSm80AndAGpuWithLessRefusesByName) {
#ifndef FLASHLM_WITH_CUDA
  GTEST_SKIP() << "built without the CUDA backends' declarations";
#else
  constexpr size_t kSm80OptinBytes = 163 * 1024;
  for (int d : kMmaSyncBackwardHeadDims) {
    for (bool det : {false, true}) EXPECT_LE(mma_sync_backward_smem_bytes(d, det), kSm80OptinBytes) << d << " " << det;
  }
  SKIP_WITHOUT_GPU();
  const int64_t granted = cuda_shared_memory_per_block_optin();
  ASSERT_GT(granted, 0);
  for (bool det : {false, true}) {
    const Case c{1, 100, 90, 2, 1, 256, Layout::bshd, Mask::bottom_right, DType::bf16};
    AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
    opt.deterministic = det;
    Problem prob(c, c.layout, c.dtype, 17);
    const size_t needed = mma_sync_backward_smem_bytes(256, det);
    if (needed <= static_cast<size_t>(granted)) {
      prob.run_on_device(opt);
      EXPECT_GT(max_abs(prob.dk.view), 0.0) << det;
    } else {
      expect_error([&] { prob.run_on_device(opt); },
                   {fmt::format("head_dim 256 needs {} bytes of shared memory per block, this GPU grants {}", needed,
                                granted)});
      prob.run_on_device(options_for(c.mask, AttentionImpl::naive));
    }
  }
#endif
}

// On an sm_90 GPU the Hopper backward covers fp16/bf16 at head dims 64, 128 and 256 (the wide-head kernel)
// with views TMA can describe; a zero stride, head dim 32 and an empty side take the mma.sync kernels.
TEST(CudaAttention, HopperBackwardCoversItsProblems) {
  SKIP_WITHOUT_HOPPER();
#ifdef FLASHLM_WITH_SM90
  auto problem_of = [](const TensorView& q, const TensorView& k, const TensorView& o, const TensorView& lse) {
    return validate_attention_forward(q, k, k, o, lse, AttentionOptions{});
  };
  for (int64_t d : {32, 64, 128, 256}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      Tensor q = Tensor::empty({2, 300, 4, d}, dt, Device::cuda), k = Tensor::empty({2, 200, 2, d}, dt, Device::cuda);
      Tensor o = Tensor::empty({2, 300, 4, d}, dt, Device::cuda);
      Tensor lse = Tensor::empty({2, 4, 300}, DType::f32, Device::cuda);
      const bool has_kernel = d == 64 || d == 128 || d == 256;
      EXPECT_EQ(flash_backward_sm90_covers(problem_of(q, k, o, lse), q, k, k, o), has_kernel) << "d" << d;
      TensorView broadcast = k.view();
      broadcast.strides[0] = 0;
      EXPECT_FALSE(flash_backward_sm90_covers(problem_of(q, broadcast, o, lse), q, broadcast, broadcast, o))
          << "d" << d;
      TensorView no_keys = k.view().slice(1, 0, 0);
      EXPECT_FALSE(flash_backward_sm90_covers(problem_of(q, no_keys, o, lse), q, no_keys, no_keys, o)) << "d" << d;
    }
  }
#endif
}

// The Hopper backward's two launches (FLASHLM_SM90_BWD_SCHEDULE): the persistent one against the fp64 oracle
// on fresh inputs (the default, auto — persistent at d64, grid at d128 — is every other test's), and dK and dV bit-identical between them (each tile's are summed by one block in one order either
// way; only dQ's reduce-adds meet in another order), so a tile run twice, skipped or given another tile's
// coordinates shows. The shapes have more tiles than an H100 or H200 has SMs (persistent blocks walk
// several, in both rounds of the snake), ragged ends, GQA, both causal alignments and none, key blocks no
// query sees (top-left with Nk > Nq: tiles of no steps in the middle of a block's walk), both head dims and
// dtypes and every layout. An unknown value is an error naming the variable.
TEST(CudaAttention, HopperBackwardSchedulesMatchTheReferenceAndEachOther) {
  SKIP_WITHOUT_HOPPER();
#ifdef FLASHLM_WITH_SM90
  const Case cases[] = {
      {2, 1024, 2048, 16, 8, 64, Layout::bshd, Mask::top_left, DType::f16},          // 256 tiles
      {1, 1500, 5000, 8, 8, 128, Layout::sliced, Mask::bottom_right, DType::bf16},   // 320 tiles, Nk > Nq
      {2, 1531, 2100, 4, 4, 64, Layout::bhsd, Mask::none, DType::bf16},              // 136 tiles
      {2, 300, 2100, 8, 4, 128, Layout::bshd, Mask::top_left, DType::f16},           // key blocks 3.. see no query
      {3, 1000, 777, 12, 4, 128, Layout::bhsd, Mask::bottom_right, DType::f16},      // Nq > Nk
      {2, 127, 1000, 6, 2, 64, Layout::sliced, Mask::none, DType::bf16},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(case_name(c));
    const uint64_t seed = 9100 + static_cast<uint64_t>(c.Nq * 7 + c.Nk);
    Problem grid(c, c.layout, c.dtype, seed), persistent(c, c.layout, c.dtype, seed);
    const AttentionOptions opt = options_for(c.mask, AttentionImpl::flash);
    {  // a test run may force a schedule for the grid
      const ScopedEnvironment schedule("FLASHLM_SM90_BWD_SCHEDULE", "grid");
      grid.run_on_device(opt);
    }
    const ScopedEnvironment schedule("FLASHLM_SM90_BWD_SCHEDULE", "persistent");
    persistent.run_on_device(opt);
    expect_flash_matches_oracle({c, false});
    EXPECT_EQ(max_abs_diff(grid.dk.view, persistent.dk.view), 0.0) << "dk";
    EXPECT_EQ(max_abs_diff(grid.dv.view, persistent.dv.view), 0.0) << "dv";
    EXPECT_EQ(max_abs_diff(grid.o.view, persistent.o.view), 0.0) << "o (the same forward)";
    // dQ: fp32 sums of the same terms in another order, rounded to 16 bits.
    Tensor ref = to_f64(grid.dq.view);
    double scale = 0;
    for (int64_t i = 0; i < ref.view().numel(); ++i) scale = std::max(scale, std::fabs(ref.view().ptr<double>()[i]));
    EXPECT_GT(scale, 0.0);
    EXPECT_LE(max_abs_diff(grid.dq.view, persistent.dq.view), 0.02 * scale) << "dq";
  }
  {
    const ScopedEnvironment schedule("FLASHLM_SM90_BWD_SCHEDULE", "auto");
    using flash_cuda::Sm90BackwardSchedule;
    EXPECT_EQ(flash_cuda::sm90_backward_schedule(), Sm90BackwardSchedule::automatic);
    // auto: persistent at head dim 64, grid otherwise; an explicit choice is kept at every head dim.
    EXPECT_EQ(flash_cuda::sm90_backward_schedule_for(Sm90BackwardSchedule::automatic, 64), Sm90BackwardSchedule::persistent);
    EXPECT_EQ(flash_cuda::sm90_backward_schedule_for(Sm90BackwardSchedule::automatic, 128), Sm90BackwardSchedule::grid);
    EXPECT_EQ(flash_cuda::sm90_backward_schedule_for(Sm90BackwardSchedule::grid, 64), Sm90BackwardSchedule::grid);
    EXPECT_EQ(flash_cuda::sm90_backward_schedule_for(Sm90BackwardSchedule::persistent, 128),
              Sm90BackwardSchedule::persistent);
  }
  const ScopedEnvironment unknown("FLASHLM_SM90_BWD_SCHEDULE", "dynamic");
  const Case c{1, 200, 200, 2, 2, 64, Layout::bshd, Mask::top_left, DType::bf16};
  Problem p(c, c.layout, c.dtype, 1);
  try {
    p.run_on_device(options_for(c.mask, AttentionImpl::flash));
    ADD_FAILURE() << "expected an error for FLASHLM_SM90_BWD_SCHEDULE=dynamic";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLASHLM_SM90_BWD_SCHEDULE: unknown value 'dynamic'"), std::string::npos)
        << e.what();
  }
#endif
}

// flash_kernel_family is the one choice of the flash kernels for both passes: on an sm_90 GPU with the
// Hopper kernels built, a covered 16-bit problem takes them forward and backward (the plan says mma.sync),
// the deterministic backward and FLASHLM_ATTENTION_KERNEL=mma keep mma.sync (head dim 256 included, which the
// Hopper backward runs on its wide-head kernel), a head dim the Hopper kernels lack (32) keeps it, and fp32
// stays fp32.
TEST(CudaAttention, FlashKernelFamilyChoosesHopperForBothPassesInOnePlace) {
  SKIP_WITHOUT_HOPPER();
#ifdef FLASHLM_WITH_SM90
  const ScopedEnvironment automatic("FLASHLM_ATTENTION_KERNEL", "auto");  // the fallback run of this binary sets it
  constexpr auto fwd = AttentionPass::forward, bwd = AttentionPass::backward;
  auto family = [](const TensorView& q, AttentionPass pass, bool deterministic) {
    Tensor o = Tensor::empty(std::span<const int64_t>(q.sizes.data(), 4), q.dtype, Device::cuda);
    Tensor lse = Tensor::empty({q.size(0), q.size(2), q.size(1)}, DType::f32, Device::cuda);
    const AttentionProblem p = validate_attention_forward(q, q, q, o, lse, AttentionOptions{});
    const CudaAttentionPlan plan = plan_cuda_attention("test", p, AttentionImpl::flash, pass);
    return flash_kernel_family(plan, pass, p, q, q, q, o, o, deterministic);  // o stands in for dout
  };
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor d128 = Tensor::empty({2, 300, 4, 128}, dt, Device::cuda);
    Tensor d256 = Tensor::empty({2, 300, 4, 256}, dt, Device::cuda);
    Tensor d32 = Tensor::empty({2, 300, 4, 32}, dt, Device::cuda);
    EXPECT_EQ(family(d128, fwd, false), CudaKernelFamily::hopper);
    EXPECT_EQ(family(d128, bwd, false), CudaKernelFamily::hopper);
    EXPECT_EQ(family(d128, bwd, true), CudaKernelFamily::mma_sync);
    EXPECT_EQ(family(d256, fwd, false), CudaKernelFamily::hopper);
    EXPECT_EQ(family(d256, bwd, false), CudaKernelFamily::hopper);
    EXPECT_EQ(family(d256, bwd, true), CudaKernelFamily::mma_sync);
    EXPECT_EQ(family(d32, fwd, false), CudaKernelFamily::mma_sync);
    EXPECT_EQ(family(d32, bwd, false), CudaKernelFamily::mma_sync);
    const ScopedEnvironment mma("FLASHLM_ATTENTION_KERNEL", "mma");
    EXPECT_EQ(family(d128, fwd, false), CudaKernelFamily::mma_sync);
    EXPECT_EQ(family(d128, bwd, false), CudaKernelFamily::mma_sync);
    EXPECT_EQ(family(d256, bwd, false), CudaKernelFamily::mma_sync);
  }
  Tensor f32 = Tensor::empty({2, 300, 4, 128}, DType::f32, Device::cuda);
  EXPECT_EQ(family(f32, fwd, false), CudaKernelFamily::f32);
  EXPECT_EQ(family(f32, bwd, false), CudaKernelFamily::f32);
#endif
}

TEST(CudaAttention, BadDeviceArgumentsAreClearErrors) {
  SKIP_WITHOUT_GPU();
  auto expect_error = [](auto&& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "expected flashlm::Error containing " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  Tensor q = Tensor::empty({1, 64, 2, 64}, DType::bf16, Device::cuda);
  Tensor k = Tensor::empty({1, 64, 2, 64}, DType::bf16, Device::cuda);
  Tensor o = Tensor::empty({1, 64, 2, 64}, DType::bf16, Device::cuda);
  Tensor lse = Tensor::empty({1, 2, 64}, DType::f32, Device::cuda);
  Tensor host_k = Tensor::empty({1, 64, 2, 64}, DType::bf16);
  TensorView host_as_cuda = host_k.view();
  host_as_cuda.device = Device::cuda;  // a host pointer claiming to be on the GPU
  expect_error([&] { attention_forward(q, host_as_cuda, k, o, lse); }, "k: data is not device memory");
  TensorView misaligned = k.view().slice(3, 1, 64);  // head_dim 63 and a pointer off by 2 bytes
  expect_error([&] { attention_forward(q.view().slice(3, 0, 63), misaligned, misaligned, o.view().slice(3, 0, 63), lse); },
               "head_dim 63 is not supported on cuda");
  Tensor q36 = Tensor::empty({1, 64, 2, 36}, DType::bf16, Device::cuda);  // 72-byte rows
  Tensor o36 = Tensor::empty({1, 64, 2, 36}, DType::bf16, Device::cuda);
  expect_error([&] { attention_forward(q36, q36, q36, o36, lse); }, "head_dim 36 is not supported");
  TensorView odd_stride = TensorView::contiguous(k.data(), DType::bf16, {1, 60, 2, 64}, Device::cuda);
  odd_stride.strides[1] = 130;  // 260 bytes between rows: not a multiple of 16
  Tensor q60 = Tensor::empty({1, 60, 2, 64}, DType::bf16, Device::cuda);
  Tensor lse60 = Tensor::empty({1, 2, 60}, DType::f32, Device::cuda);
  Tensor o60 = Tensor::empty({1, 60, 2, 64}, DType::bf16, Device::cuda);
  expect_error([&] { attention_forward(q60, odd_stride, odd_stride, o60, lse60); }, "k: stride 130 of dimension 1");
  Tensor host_lse = Tensor::empty({1, 2, 64}, DType::f32);
  expect_error([&] { attention_forward(q, k, k, o, host_lse); }, "lse: on cpu but q is on cuda");
  Tensor q64 = Tensor::empty({1, 64, 2, 64}, DType::f64, Device::cuda);
  Tensor lse64 = Tensor::empty({1, 2, 64}, DType::f64, Device::cuda);
  Tensor o64 = Tensor::empty({1, 64, 2, 64}, DType::f64, Device::cuda);
  expect_error([&] { attention_forward(q64, q64, q64, o64, lse64); }, "dtype fp64 is not supported on cuda");
  // Above 256 no CUDA path has a backward (the grid runs head dims 160 and 256 against the reference).
  Tensor q264 = Tensor::empty({1, 64, 2, 264}, DType::bf16, Device::cuda);
  Tensor g264[3] = {Tensor::empty({1, 64, 2, 264}, DType::bf16, Device::cuda),
                    Tensor::empty({1, 64, 2, 264}, DType::bf16, Device::cuda),
                    Tensor::empty({1, 64, 2, 264}, DType::bf16, Device::cuda)};
  expect_error([&] { attention_backward(q264, q264, q264, q264, lse, q264, g264[0], g264[1], g264[2]); },
               "head_dim 264 is not supported on cuda");
}

// The library does what the capability table says: for every dtype and a spread of head dims (compiled,
// padded, unaligned, too large), each pass on the GPU either runs or fails with the table's own message.
TEST(CudaAttention, CapabilityTableAndBehaviourAgree) {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    for (int64_t d : {4, 8, 12, 16, 24, 36, 48, 64, 80, 128, 136, 160, 200, 256, 264}) {
      for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
        for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
          const bool forward = pass == AttentionPass::forward;
          const Case c{1, 33, 40, 2, 1, d, Layout::bshd, Mask::bottom_right, dt};
          const AttentionOptions opt = options_for(c.mask, impl);
          AttentionProblem p;
          p.dtype = dt;
          p.head_dim = d;
          // The table's error, empty where it has a kernel (cuda_plan_error: a backward fails with the forward's
          // message where the head dim has no forward).
          const std::string expected = cuda_plan_error(p, impl, pass);
          const std::string what = std::string(dtype_name(dt)) + " d" + std::to_string(d) + " " +
                                   std::string(attention_impl_name(impl)) + (forward ? " forward" : " backward");
          Problem prob(c, c.layout, dt, 11 + static_cast<uint64_t>(d));
          try {
            prob.run_on_device(opt, !forward);
            EXPECT_EQ(expected, "") << what << ": ran, but the table says no";
            EXPECT_TRUE(all_finite_or_neg_inf(prob.o.view)) << what;
            if (!forward) {
              EXPECT_GT(max_abs(prob.dq.view), 0.0) << what;
            }
          } catch (const Error& e) {
            EXPECT_EQ(std::string(e.what()), expected) << what;
          }
        }
      }
    }
  }
}

}  // namespace
