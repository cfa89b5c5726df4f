// Head dims of v's own on CUDA (head_dim for q and k, head_dim_v for v and o: DeepSeek's MLA attends with 192
// and 128). Every pair whose larger head dim fits a compiled one runs on the fp16/bf16 (mma.sync) and fp32 flash
// kernels on zero-padded copies, forward and backward, deterministic mode included (capabilities.h,
// pads_head_dim_v); the Hopper forward and backward run their own pair, (192, 128), unpadded on an sm_90 GPU
// (kHopperForwardHeadDimPairs, kHopperBackwardHeadDimPairs: the backward on the wide-head kernel,
// flash_bwd_wide_sm90.cu). Against the fp64 reference on fresh random inputs with poisoned outputs: ragged
// lengths (1, 17, 127, 1000 queries, fewer and more keys), no mask and causal in both alignments, BSHD, BHSD and
// sliced layouts, GQA, bf16, fp16 and fp32; a sliding window, soft-capping, ALiBi and sinks (dlearnable_sink
// included). The padded runs go through FLASHLM_ATTENTION_KERNEL=mma and the default route (where, on sm_90, the
// padded problem may itself take the Hopper kernels). The routing, the refusals by name (the naive kernels,
// head dims past the kernels') and the capability table's agreement with what runs. Every test skips without a
// GPU, the Hopper kernels' own without an sm_90 GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
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

constexpr int64_t kQkDim = 192, kValueDim = 128;

struct PairGpuCase {
  Case c;  // c.D: q's and k's head dim, c.Dv: v's
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  bool alibi_sink = false;  // ALiBi slopes [Hq] and a sink per head (the Hopper route on)
  bool deterministic = false;
};

std::string pair_case_name(const PairGpuCase& s) {
  std::string name = case_name(s.c);
  if (s.window_left >= 0 || s.window_right >= 0) name += fmt::format("_w{}_{}", s.window_left, s.window_right);
  if (s.softcap > 0) name += fmt::format("_cap{}", s.softcap);
  if (s.alibi_sink) name += "_alibi_sink";
  if (s.deterministic) name += "_det";
  for (char& ch : name) {
    if (ch == '-') ch = 'm';
    if (ch == '.') ch = 'p';
  }
  return name;
}
void PrintTo(const PairGpuCase& s, std::ostream* os) { *os << pair_case_name(s); }

// A case's ALiBi slopes (2^-(h+1)) and sinks on the host, for the oracle, and on the device with a poisoned
// dlearnable_sink, for the kernels.
struct SlopesAndSinks {
  Tensor slopes, sinks, device_slopes, device_sinks, device_dsink;
  explicit SlopesAndSinks(const Case& c)
      : slopes(Tensor::empty({c.Hq}, DType::f32)),
        sinks(Tensor::empty({c.Hq}, DType::f32)),
        device_slopes(Tensor::empty({c.Hq}, DType::f32, Device::cuda)),
        device_sinks(Tensor::empty({c.Hq}, DType::f32, Device::cuda)),
        device_dsink(Tensor::empty({c.Hq}, DType::f32, Device::cuda)) {
    for (int64_t h = 0; h < c.Hq; ++h) slopes.view().ptr<float>()[h] = std::ldexp(1.0f, -static_cast<int>(h) - 1);
    fill_normal(sinks, 12);
    copy_into(device_slopes.view(), slopes.view());
    copy_into(device_sinks.view(), sinks.view());
    Tensor poison = Tensor::empty({c.Hq}, DType::f32);
    fill_value(poison.view(), std::numeric_limits<double>::quiet_NaN());
    copy_into(device_dsink.view(), poison.view());
  }
};

// The case's options; on the host (the oracle's: the backward's dsink goes to Problem::dsink) or on the device.
AttentionOptions pair_options(const PairGpuCase& s, AttentionImpl impl, const SlopesAndSinks& in, bool on_device) {
  AttentionOptions o = options_for(s.c.mask, impl);
  o.window_size_left = s.window_left;
  o.window_size_right = s.window_right;
  o.softcap = s.softcap;
  o.deterministic = s.deterministic;
  if (s.alibi_sink) {
    o.alibi_slopes = on_device ? in.device_slopes.view() : in.slopes.view();
    o.learnable_sink = on_device ? in.device_sinks.view() : in.sinks.view();
    if (on_device) o.dlearnable_sink = in.device_dsink.view();
  }
  return o;
}

// o, lse and (`with_backward`) dq, dk, dv and dlearnable_sink of the CUDA flash kernels with
// FLASHLM_ATTENTION_KERNEL `choice` against the fp64 reference on the same rounded inputs, within
// cuda_flash_tolerance of the naive attention in the case's dtype; lse finite where the reference's is (within
// 1e-3 relative), -inf where it is.
void expect_pair_matches_oracle(const PairGpuCase& s, const char* choice, bool with_backward) {
  const Case& c = s.c;
  const std::string name = pair_case_name(s) + "_" + choice;
  Problem ours(c, c.layout, c.dtype, 52000 + static_cast<uint64_t>(c.Nq * 3 + c.Nk + c.D + c.Dv));
  const SlopesAndSinks in(c);
  const HopperAlibiSinkRoute route(true);  // ALiBi and sinks on the Hopper kernels where they take the problem
  with_kernel_choice(choice,
                     [&] { ours.run_on_device(pair_options(s, AttentionImpl::flash, in, true), with_backward); });
  const AttentionOptions naive = pair_options(s, AttentionImpl::naive, in, false);
  Problem ref(ours, c);  // fp64 on the CPU
  if (with_backward) ref.run(naive);
  else ref.forward(naive);
  Problem lowp(c, c.layout, c.dtype, 0);
  expect_outputs_near_oracle(c, name, ours, ref, lowp, naive, with_backward);

  Tensor lse_ours = to_f64(ours.lse), lse_ref = to_f64(ref.lse);
  for (int64_t i = 0; i < lse_ref.numel(); ++i) {
    const double a = lse_ours.view().ptr<double>()[i], b = lse_ref.view().ptr<double>()[i];
    if (std::isinf(b)) EXPECT_EQ(a, b) << "lse[" << i << "] of " << name;
    else EXPECT_NEAR(a, b, 1e-3 * std::max(1.0, std::fabs(b))) << "lse[" << i << "] of " << name;
  }
  if (s.alibi_sink && with_backward) {
    copy_into(ours.dsink.view(), in.device_dsink.view());
    expect_dsink_matches(c, ref, ours.dsink.view(), lowp.dsink.view(), in.sinks.view(), cuda_flash_tolerance, name);
  }
}

// ---- The Hopper kernels' own pair, unpadded ----

class CudaHeadDimPairVsReference : public ::testing::TestWithParam<PairGpuCase> {};

// The default route on sm_90: the forward and the (atomic) backward both take the pair unpadded (the routing
// test below checks that they are chosen for such views); the grid holds no deterministic case.
TEST_P(CudaHeadDimPairVsReference, HopperMatchesFp64OracleInBothPasses) {
  SKIP_WITHOUT_HOPPER();
  expect_pair_matches_oracle(GetParam(), "auto", /*with_backward=*/true);
}

std::vector<PairGpuCase> hopper_pair_grid() {
  std::vector<PairGpuCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  int n = 0;
  // Ragged query counts against fewer and more keys, every mask (bottom-right with Nq > Nk leaves rows without
  // keys: o = 0, lse = -inf), each mask on every layout over the lengths, both dtypes, GQA 4 / 2 and 6 / 1,
  // batches of 1 and 2.
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {1, 300}, {17, 130}, {17, 5}, {127, 1000}, {127, 64},
                        {1000, 333}, {1000, 1000}}) {
    for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
      const DType dt = n % 2 ? DType::bf16 : DType::f16;
      const int64_t hk = (n / 3) % 2 ? 1 : 2, hq = hk == 1 ? 6 : 4;
      cases.push_back({{n % 4 == 0 ? 2 : 1, nq, nk, hq, hk, kQkDim, layouts[(n + n / 3) % 3], m, dt, kValueDim}});
      ++n;
    }
  }
  // The masked instantiation: windows on one side, both and across tiles, soft-capping alone and with one.
  cases.push_back({{1, 300, 300, 4, 2, kQkDim, Layout::bshd, Mask::top_left, DType::bf16, kValueDim}, 50, -1});
  cases.push_back({{2, 127, 1000, 4, 4, kQkDim, Layout::bhsd, Mask::none, DType::f16, kValueDim}, 130, 70});
  cases.push_back({{1, 1000, 333, 6, 2, kQkDim, Layout::sliced, Mask::bottom_right, DType::bf16, kValueDim}, 5, -1});
  cases.push_back({{1, 17, 130, 2, 1, kQkDim, Layout::bshd, Mask::none, DType::f16, kValueDim}, -1, -1, 30.0});
  cases.push_back({{2, 300, 500, 4, 2, kQkDim, Layout::bhsd, Mask::top_left, DType::bf16, kValueDim}, 64, 0, 20.0});
  // The ALiBi / sink instantiation (with and without a window).
  cases.push_back({{1, 300, 300, 4, 2, kQkDim, Layout::bshd, Mask::none, DType::bf16, kValueDim}, -1, -1, 0, true});
  cases.push_back({{2, 127, 400, 6, 2, kQkDim, Layout::bhsd, Mask::bottom_right, DType::f16, kValueDim}, 100, -1, 0,
                   true});
  // Long enough for many work items of the persistent blocks, and many key and query tiles of the backward.
  cases.push_back({{1, 2048, 2048, 8, 2, kQkDim, Layout::bhsd, Mask::top_left, DType::bf16, kValueDim}});
  cases.push_back({{2, 1000, 1000, 4, 1, kQkDim, Layout::bshd, Mask::bottom_right, DType::f16, kValueDim}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaHeadDimPairVsReference, ::testing::ValuesIn(hopper_pair_grid()),
                         [](const ::testing::TestParamInfo<PairGpuCase>& info) { return pair_case_name(info.param); });

// ---- Every pair, padded: forward and backward ----

class CudaPaddedHeadDimPairVsReference : public ::testing::TestWithParam<PairGpuCase> {};

// FLASHLM_ATTENTION_KERNEL=mma: the mma.sync (or, in fp32, the fp32) kernels on the padded copies in both passes.
// The default route as well (the deterministic mode runs mma.sync either way): on sm_90 the Hopper kernels take
// (192, 128) unpadded in both passes, and a padded problem of their head dims ((64, 128) pads to 128, (256, 128)
// to 256).
TEST_P(CudaPaddedHeadDimPairVsReference, FlashMatchesFp64OracleInBothPasses) {
  SKIP_WITHOUT_GPU();
  const PairGpuCase& s = GetParam();
  expect_pair_matches_oracle(s, "mma", /*with_backward=*/true);
  if (!s.deterministic && s.c.dtype != DType::f32) expect_pair_matches_oracle(s, "auto", /*with_backward=*/true);
}

std::vector<PairGpuCase> padded_pair_grid() {
  std::vector<PairGpuCase> cases;
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::sliced};
  const Mask masks[] = {Mask::none, Mask::top_left, Mask::bottom_right};
  const std::pair<int64_t, int64_t> lengths[] = {{1, 1},     {1, 300}, {17, 130},   {17, 5},
                                                 {127, 1000}, {127, 64}, {1000, 333}, {300, 1000}};
  int n = 0;
  auto add = [&](int64_t d, int64_t dv, std::pair<int64_t, int64_t> len, Mask m) {
    const DType dt = n % 2 ? DType::bf16 : DType::f16;
    const int64_t hk = (n / 3) % 2 ? 1 : 2, hq = hk == 1 ? 6 : 4;
    PairGpuCase s{{n % 4 == 0 ? 2 : 1, len.first, len.second, hq, hk, d, layouts[(n + n / 3) % 3], m, dt, dv}};
    s.deterministic = n % 4 == 3;
    cases.push_back(s);
    ++n;
  };
  // DeepSeek's pair (padded to 256) over every length and mask: each mask on every layout, both dtypes, both
  // backward modes, GQA 4 / 2 and 6 / 1.
  for (auto len : lengths) {
    for (Mask m : masks) add(kQkDim, kValueDim, len, m);
  }
  // Pairs that pad q and k only ((64, 128), (16, 32), (128, 256)), v only ((128, 64), (256, 128)), or both
  // ((96, 64) and (80, 48) to 128), each with every mask over three lengths.
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{64, 128}, {128, 64}, {96, 64}, {16, 32}, {256, 128}, {128, 256},
                       {80, 48}}) {
    for (Mask m : masks) add(d, dv, lengths[n % 8], m);
  }
  // The fp32 kernels pad the same way.
  cases.push_back({{2, 130, 97, 4, 2, kQkDim, Layout::bhsd, Mask::bottom_right, DType::f32, kValueDim}});
  cases.push_back({{1, 65, 200, 2, 2, 24, Layout::sliced, Mask::none, DType::f32, 40}});
  // The masked kernels pad too: a window, soft-capping, ALiBi and sinks (dlearnable_sink against the oracle's).
  cases.push_back({{1, 300, 300, 4, 2, kQkDim, Layout::bshd, Mask::top_left, DType::bf16, kValueDim}, 50, -1});
  cases.push_back({{2, 127, 1000, 4, 4, kQkDim, Layout::bhsd, Mask::none, DType::f16, kValueDim}, 130, 70, 30.0});
  cases.push_back({{1, 300, 300, 4, 2, kQkDim, Layout::sliced, Mask::none, DType::bf16, kValueDim}, -1, -1, 0, true});
  cases.push_back({{2, 127, 400, 6, 2, 64, Layout::bhsd, Mask::bottom_right, DType::f16, 128}, 100, -1, 0, true});
  PairGpuCase deterministic_variants{{1, 200, 333, 4, 1, kQkDim, Layout::bshd, Mask::none, DType::bf16, kValueDim},
                                     64, 64, 20.0, true};
  deterministic_variants.deterministic = true;
  cases.push_back(deterministic_variants);
  // Many key and query tiles of both backward kernels.
  cases.push_back({{1, 1000, 1000, 8, 2, kQkDim, Layout::bhsd, Mask::top_left, DType::bf16, kValueDim}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaPaddedHeadDimPairVsReference, ::testing::ValuesIn(padded_pair_grid()),
                         [](const ::testing::TestParamInfo<PairGpuCase>& info) { return pair_case_name(info.param); });

// ---- Routing and refusals ----

// Device tensors of one problem: q, k, dq, dk [head_dim], v, o, dout, dv [head_dim_v].
struct PairTensors {
  Tensor q, k, v, o, lse, dout, dq, dk, dv;
  PairTensors(DType dtype, int64_t rows, int64_t head_dim = kQkDim, int64_t head_dim_v = kValueDim)
      : q(Tensor::empty({1, rows, 2, head_dim}, dtype, Device::cuda)),
        k(Tensor::empty({1, rows, 2, head_dim}, dtype, Device::cuda)),
        v(Tensor::empty({1, rows, 2, head_dim_v}, dtype, Device::cuda)),
        o(Tensor::empty({1, rows, 2, head_dim_v}, dtype, Device::cuda)),
        lse(Tensor::empty({1, 2, rows}, DType::f32, Device::cuda)),
        dout(Tensor::empty({1, rows, 2, head_dim_v}, dtype, Device::cuda)),
        dq(Tensor::empty({1, rows, 2, head_dim}, dtype, Device::cuda)),
        dk(Tensor::empty({1, rows, 2, head_dim}, dtype, Device::cuda)),
        dv(Tensor::empty({1, rows, 2, head_dim_v}, dtype, Device::cuda)) {
    fill_normal(q, 1);
    fill_normal(k, 2);
    fill_normal(v, 3);
    fill_normal(dout, 4);
  }
  void forward(const AttentionOptions& opt = {}) { attention_forward(q, k, v, o, lse, opt); }
  void backward(const AttentionOptions& opt = {}) { attention_backward(q, k, v, o, lse, dout, dq, dk, dv, opt); }
};

// (192, 128) in fp16 and bf16 plans on mma.sync padded to 256 in both passes. With the default route, the forward
// and the atomic backward run the Hopper kernels' own pair unpadded on an sm_90 GPU (mma.sync padded elsewhere,
// and on sm_90 where TMA cannot describe a view: a zero batch stride); the deterministic backward stays on
// mma.sync. FLASHLM_ATTENTION_KERNEL=mma keeps both passes on mma.sync. Every one runs.
TEST(CudaHeadDimPair, PlansPadOnMmaSyncAndTheHopperKernelsTakeTheirOwnPairUnpadded) {
  SKIP_WITHOUT_GPU();
#ifndef FLASHLM_WITH_CUDA
  GTEST_SKIP() << "built without the CUDA backends' declarations";
#else
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    PairTensors t(dtype, 300);
    const AttentionOptions opt;
    const AttentionProblem pf = validate_attention_forward(t.q, t.k, t.v, t.o, t.lse, opt);
    const AttentionProblem pb = validate_attention_backward(t.q, t.k, t.v, t.o, t.lse, t.dout, t.dq, t.dk, t.dv, opt);
    const CudaAttentionPlan plan_f = plan_cuda_attention("attention_forward", pf, opt.impl, AttentionPass::forward);
    const CudaAttentionPlan plan_b = plan_cuda_attention("attention_backward", pb, opt.impl, AttentionPass::backward);
    for (const CudaAttentionPlan& plan : {plan_f, plan_b}) {
      EXPECT_EQ(plan.family, CudaKernelFamily::mma_sync);
      EXPECT_EQ(plan.kernel_head_dim, 256);
      EXPECT_TRUE(plan.padded);
    }
    auto forward_family = [&] {
      return flash_kernel_family(plan_f, AttentionPass::forward, pf, t.q, t.k, t.v, t.o, TensorView{}, false);
    };
    auto backward_family = [&](bool deterministic) {
      return flash_kernel_family(plan_b, AttentionPass::backward, pb, t.q, t.k, t.v, t.o, t.dout, deterministic);
    };
    with_kernel_choice("auto", [&] {
#ifdef FLASHLM_WITH_SM90
      const bool hopper = on_sm90();
#else
      const bool hopper = false;
#endif
      EXPECT_EQ(forward_family(), hopper ? CudaKernelFamily::hopper : CudaKernelFamily::mma_sync);
      EXPECT_EQ(backward_family(false), hopper ? CudaKernelFamily::hopper : CudaKernelFamily::mma_sync);
      EXPECT_EQ(backward_family(true), CudaKernelFamily::mma_sync);
      EXPECT_NO_THROW(t.forward());
      EXPECT_NO_THROW(t.backward());
      AttentionOptions deterministic;
      deterministic.deterministic = true;
      EXPECT_NO_THROW(t.backward(deterministic));
      // Both batches read the one batch's keys and values: no TMA descriptor, so mma.sync on padded copies.
      Tensor q2 = Tensor::empty({2, 300, 2, kQkDim}, dtype, Device::cuda);
      Tensor o2 = Tensor::empty({2, 300, 2, kValueDim}, dtype, Device::cuda);
      Tensor lse2 = Tensor::empty({2, 2, 300}, DType::f32, Device::cuda);
      fill_normal(q2, 5);
      TensorView k2 = t.k.view(), v2 = t.v.view();
      k2.sizes[0] = v2.sizes[0] = 2;
      k2.strides[0] = v2.strides[0] = 0;
      EXPECT_NO_THROW(attention_forward(q2, k2, v2, o2, lse2, opt));
    });
    with_kernel_choice("mma", [&] {
      EXPECT_EQ(forward_family(), CudaKernelFamily::mma_sync);
      EXPECT_EQ(backward_family(false), CudaKernelFamily::mma_sync);
      EXPECT_NO_THROW(t.forward());
      EXPECT_NO_THROW(t.backward());
    });
  }
#endif
}

// The naive kernels need one head dim (refused by head_dim_v's name, saying where it runs); the fp32 flash
// kernels pad like mma.sync; a head_dim_v past every kernel or with rows of no whole number of 16-byte vectors
// is refused by its name, as head_dim is.
TEST(CudaHeadDimPair, NaiveRefusesByNameFp32PadsAndBadHeadDimVIsRefusedByName) {
  SKIP_WITHOUT_GPU();
  PairTensors bf16(DType::bf16, 64);
  AttentionOptions naive;
  naive.impl = AttentionImpl::naive;
  expect_error([&] { bf16.forward(naive); },
               {"attention_forward: v: head_dim_v 128 differs from head_dim 192",
                "the naive forward kernels need one head dim", "runs on the cpu"});
  PairTensors f32(DType::f32, 64);
  const AttentionProblem p = validate_attention_forward(f32.q, f32.k, f32.v, f32.o, f32.lse, {});
  const CudaAttentionPlan plan =
      plan_cuda_attention("attention_forward", p, AttentionImpl::flash, AttentionPass::forward);
  EXPECT_EQ(plan.family, CudaKernelFamily::f32);
  EXPECT_EQ(plan.kernel_head_dim, 256);
  EXPECT_NO_THROW(f32.forward());
  EXPECT_NO_THROW(f32.backward());
  PairTensors wide(DType::bf16, 64, 128, 320);
  expect_error([&] { wide.forward(); },
               {"attention_forward: v: head_dim_v 320 is not supported on cuda", "at most 256"});
  PairTensors unaligned(DType::bf16, 64, 64, 36);
  expect_error([&] { unaligned.backward(); },
               {"attention_backward: v: head_dim_v 36 is not supported on cuda", "a multiple of 8 for bf16"});
}

// The library does what the capability table says for pairs: for every dtype, both implementations and a spread
// of (head_dim, head_dim_v) (padded on either side or both, unaligned, too large), each pass on the GPU either runs,
// with finite outputs, or fails with the table's own message.
TEST(CudaHeadDimPair, CapabilityTableAndBehaviourAgree) {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    for (auto [d, dv] : {std::pair<int64_t, int64_t>{192, 128}, {64, 128}, {128, 64}, {40, 24}, {8, 16}, {256, 40},
                         {12, 20}, {200, 8}, {128, 264}, {64, 36}}) {
      for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
        for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
          const bool forward = pass == AttentionPass::forward;
          const Case c{1, 33, 40, 2, 1, d, Layout::bshd, Mask::bottom_right, dt, dv};
          AttentionProblem p;
          p.dtype = dt;
          p.head_dim = d;
          p.head_dim_v = dv;
          // The table's error, empty where it has a kernel; a backward runs the forward first.
          const std::string expected = cuda_plan_error(p, impl, pass);
          const std::string what = fmt::format("{} ({}, {}) {} {}", dtype_name(dt), d, dv, attention_impl_name(impl),
                                               forward ? "forward" : "backward");
          Problem prob(c, c.layout, dt, 17 + static_cast<uint64_t>(d + dv));
          try {
            prob.run_on_device(options_for(c.mask, impl), !forward);
            EXPECT_EQ(expected, "") << what << ": ran, but the table says no";
            EXPECT_TRUE(all_finite_or_neg_inf(prob.o.view)) << what;
            if (!forward) {
              EXPECT_TRUE(all_finite_or_neg_inf(prob.dv.view)) << what;
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
