// A head dim of v's own on CUDA: (head_dim, head_dim_v) = (192, 128), DeepSeek's MLA shape, the one pair the
// capability table lists (kHopperForwardHeadDimPairs), runs the Hopper forward's instantiation for it on an
// sm_90 GPU, and nothing else runs it on CUDA. Against the fp64 reference on fresh random inputs with poisoned
// outputs: ragged lengths (1, 17, 127, 1000 queries, fewer and more keys), no mask and causal in both
// alignments, BSHD, BHSD and sliced layouts, GQA, bf16 and fp16; the masked instantiation (a sliding window,
// soft-capping) and, with the Hopper route on, the ALiBi / sink one. Refused by head_dim_v's name where the
// Hopper forward does not run it: the backward (no CUDA backward has the pair), another GPU,
// FLASHLM_ATTENTION_KERNEL=mma, views TMA cannot describe, the other families, other pairs. Every test skips
// without a GPU, the numeric ones (and the Hopper choice) without an sm_90 GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
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
  Case c;  // c.D = 192, c.Dv = 128
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  bool alibi_sink = false;  // ALiBi slopes [Hq] and a sink per head, on the Hopper route
};

std::string pair_case_name(const PairGpuCase& s) {
  std::string name = case_name(s.c);
  if (s.window_left >= 0 || s.window_right >= 0) name += fmt::format("_w{}_{}", s.window_left, s.window_right);
  if (s.softcap > 0) name += fmt::format("_cap{}", s.softcap);
  if (s.alibi_sink) name += "_alibi_sink";
  for (char& ch : name) {
    if (ch == '-') ch = 'm';
    if (ch == '.') ch = 'p';
  }
  return name;
}
void PrintTo(const PairGpuCase& s, std::ostream* os) { *os << pair_case_name(s); }

// Runs `body` with FLASHLM_ATTENTION_KERNEL set to `value` (restoring what was there): the GPU runs of this
// binary may set it to "mma" for the whole process.
template <class Body>
void with_kernel_choice(const char* value, Body&& body) {
  const char* was = std::getenv("FLASHLM_ATTENTION_KERNEL");
  const std::string saved = was == nullptr ? "" : was;
  ASSERT_EQ(setenv("FLASHLM_ATTENTION_KERNEL", value, 1), 0);
  body();
  if (was == nullptr) unsetenv("FLASHLM_ATTENTION_KERNEL");
  else setenv("FLASHLM_ATTENTION_KERNEL", saved.c_str(), 1);
}

#ifdef FLASHLM_WITH_SM90
// The case's options; `slopes` and `sinks` are given where the case has ALiBi and sinks (host or device
// vectors, as the call's tensors).
AttentionOptions pair_options(const PairGpuCase& s, AttentionImpl impl, const TensorView& slopes,
                              const TensorView& sinks) {
  AttentionOptions o = options_for(s.c.mask, impl);
  o.window_size_left = s.window_left;
  o.window_size_right = s.window_right;
  o.softcap = s.softcap;
  if (s.alibi_sink) {
    o.alibi_slopes = slopes;
    o.learnable_sink = sinks;
  }
  return o;
}

// o and lse of the CUDA forward against the fp64 reference on the same rounded inputs. o within the
// low-precision rule, twice the error of the naive attention with the same 16-bit storage (here the CPU's,
// whose only error is the rounding of its outputs) plus 1e-3, and 4 unit roundoffs of o's scale for the
// kernel's 16-bit P in P·V; lse finite where the reference's is (within 1e-3 relative), -inf where it is.
void expect_forward_matches_oracle(const PairGpuCase& s) {
  const Case& c = s.c;
  const std::string name = pair_case_name(s);
  Problem ours(c, c.layout, c.dtype, 52000 + static_cast<uint64_t>(c.Nq * 3 + c.Nk));
  Tensor slopes = Tensor::empty({c.Hq}, DType::f32), sinks = Tensor::empty({c.Hq}, DType::f32);
  for (int64_t h = 0; h < c.Hq; ++h) slopes.view().ptr<float>()[h] = std::ldexp(1.0f, -static_cast<int>(h) - 1);
  fill_normal(sinks, 12);
  Tensor device_slopes = Tensor::empty({c.Hq}, DType::f32, Device::cuda);
  Tensor device_sinks = Tensor::empty({c.Hq}, DType::f32, Device::cuda);
  copy_into(device_slopes.view(), slopes.view());
  copy_into(device_sinks.view(), sinks.view());
  const HopperAlibiSinkRoute route(true);  // the ALiBi / sink instantiation; the others do not read it
  with_kernel_choice("auto", [&] {
    ours.run_on_device(pair_options(s, AttentionImpl::flash, device_slopes.view(), device_sinks.view()),
                       /*with_backward=*/false);
  });
  const AttentionOptions naive = pair_options(s, AttentionImpl::naive, slopes.view(), sinks.view());
  Problem ref(ours, c);  // fp64 on the CPU
  ref.forward(naive);
  Problem lowp(c, c.layout, c.dtype, 0);  // the naive attention in the case's 16-bit dtype, on the CPU
  copy_into(lowp.q.view, ours.q.view);
  copy_into(lowp.k.view, ours.k.view);
  copy_into(lowp.v.view, ours.v.view);
  lowp.forward(naive);

  const double err = max_abs_diff(ours.o.view, ref.o.view), low_err = max_abs_diff(lowp.o.view, ref.o.view);
  const double unit_roundoff = c.dtype == DType::bf16 ? 1.0 / 256 : 1.0 / 2048;
  const double tol = 2 * low_err + 1e-3 + 4 * unit_roundoff * std::max(1.0, max_abs(ref.o.view));
  EXPECT_LE(err, tol) << "o of " << name << " (cpu naive " << dtype_name(c.dtype) << " error " << low_err
                      << ", max |ref| " << max_abs(ref.o.view) << ")";
  Tensor lse_ours = to_f64(ours.lse), lse_ref = to_f64(ref.lse);
  for (int64_t i = 0; i < lse_ref.numel(); ++i) {
    const double a = lse_ours.view().ptr<double>()[i], b = lse_ref.view().ptr<double>()[i];
    if (std::isinf(b)) EXPECT_EQ(a, b) << "lse[" << i << "] of " << name;
    else EXPECT_NEAR(a, b, 1e-3 * std::max(1.0, std::fabs(b))) << "lse[" << i << "] of " << name;
  }
}
#endif

class CudaHeadDimPairVsReference : public ::testing::TestWithParam<PairGpuCase> {};

TEST_P(CudaHeadDimPairVsReference, HopperForwardMatchesFp64Oracle) {
  SKIP_WITHOUT_GPU();
#ifndef FLASHLM_WITH_SM90
  GTEST_SKIP() << "built without the Hopper kernels";
#else
  if (!on_sm90()) GTEST_SKIP() << "not an sm_90 GPU: the Hopper kernels do not run";
  expect_forward_matches_oracle(GetParam());
#endif
}

std::vector<PairGpuCase> pair_grid() {
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
  // Long enough for many work items of the persistent blocks.
  cases.push_back({{1, 2048, 2048, 8, 2, kQkDim, Layout::bhsd, Mask::top_left, DType::bf16, kValueDim}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaHeadDimPairVsReference, ::testing::ValuesIn(pair_grid()),
                         [](const ::testing::TestParamInfo<PairGpuCase>& info) { return pair_case_name(info.param); });

// Device tensors of one (192, 128) problem: q, k [192], v, o, dout, dv [128], dq, dk [192].
struct PairTensors {
  Tensor q, k, v, o, lse, dout, dq, dk, dv;
  PairTensors(DType dtype, int64_t rows)
      : q(Tensor::empty({1, rows, 2, kQkDim}, dtype, Device::cuda)),
        k(Tensor::empty({1, rows, 2, kQkDim}, dtype, Device::cuda)),
        v(Tensor::empty({1, rows, 2, kValueDim}, dtype, Device::cuda)),
        o(Tensor::empty({1, rows, 2, kValueDim}, dtype, Device::cuda)),
        lse(Tensor::empty({1, 2, rows}, DType::f32, Device::cuda)),
        dout(Tensor::empty({1, rows, 2, kValueDim}, dtype, Device::cuda)),
        dq(Tensor::empty({1, rows, 2, kQkDim}, dtype, Device::cuda)),
        dk(Tensor::empty({1, rows, 2, kQkDim}, dtype, Device::cuda)),
        dv(Tensor::empty({1, rows, 2, kValueDim}, dtype, Device::cuda)) {
    fill_normal(q, 1);
    fill_normal(k, 2);
    fill_normal(v, 3);
    fill_normal(dout, 4);
  }
};

// The plan takes the Hopper family for (192, 128) in fp16 and bf16 on any GPU; on an sm_90 GPU the dispatch
// keeps it and the forward runs, elsewhere the forward is refused by head_dim_v's name, saying where it runs.
// The backward is refused everywhere, at the plan. So are FLASHLM_ATTENTION_KERNEL=mma (no mma.sync kernel
// to force) and, on sm_90, a view TMA cannot describe (a zero batch stride): no fallback exists.
TEST(CudaHeadDimPair, HopperRunsTheForwardAndEverythingElseIsRefusedByName) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    PairTensors t(dtype, 300);
    const AttentionOptions opt;
    const AttentionProblem p = validate_attention_forward(t.q, t.k, t.v, t.o, t.lse, opt);
    const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", p, opt.impl, AttentionPass::forward);
    EXPECT_EQ(plan.family, CudaKernelFamily::hopper);
    with_kernel_choice("auto", [&] {
#ifdef FLASHLM_WITH_SM90
      if (on_sm90()) {
        const TensorView o = t.o.view();
        EXPECT_TRUE(flash_forward_sm90_covers(p, t.q, t.k, t.v, &o));
        EXPECT_EQ(flash_kernel_family(plan, AttentionPass::forward, p, t.q, t.k, t.v, t.o, TensorView{}, false),
                  CudaKernelFamily::hopper);
        EXPECT_NO_THROW(attention_forward(t.q, t.k, t.v, t.o, t.lse, opt));
        Tensor q2 = Tensor::empty({2, 300, 2, kQkDim}, dtype, Device::cuda);
        Tensor o2 = Tensor::empty({2, 300, 2, kValueDim}, dtype, Device::cuda);
        Tensor lse2 = Tensor::empty({2, 2, 300}, DType::f32, Device::cuda);
        fill_normal(q2, 5);
        TensorView k2 = t.k.view(), v2 = t.v.view();  // both batches read the one batch's keys and values
        k2.sizes[0] = v2.sizes[0] = 2;
        k2.strides[0] = v2.strides[0] = 0;
        expect_error([&] { attention_forward(q2, k2, v2, o2, lse2, opt); },
                     {"attention_forward: v: head_dim_v 128 differs from head_dim 192",
                      "only the Hopper kernels run on cuda", "views TMA can describe", "runs on the cpu"});
      }
#endif
      if (!on_sm90()) {
        expect_error([&] { attention_forward(t.q, t.k, t.v, t.o, t.lse, opt); },
                     {"attention_forward: v: head_dim_v 128 differs from head_dim 192",
                      "only the Hopper kernels run on cuda", "an sm_90 GPU", "runs on the cpu"});
      }
      expect_error([&] { attention_backward(t.q, t.k, t.v, t.o, t.lse, t.dout, t.dq, t.dk, t.dv, opt); },
                   {"attention_backward: v: head_dim_v 128 differs from head_dim 192",
                    "the hopper backward kernels are compiled for no such pair", "runs on the cpu"});
    });
    with_kernel_choice("mma", [&] {
      expect_error([&] { attention_forward(t.q, t.k, t.v, t.o, t.lse, opt); },
                   {"attention_forward: v: head_dim_v 128 differs from head_dim 192",
                    "FLASHLM_ATTENTION_KERNEL=mma forbids them", "runs on the cpu"});
    });
    AttentionOptions naive;
    naive.impl = AttentionImpl::naive;
    expect_error([&] { attention_forward(t.q, t.k, t.v, t.o, t.lse, naive); },
                 {"v: head_dim_v 128 differs from head_dim 192", "the naive forward kernels", "runs on the cpu"});
  }
  // Another pair, and fp32, have no kernel at all: refused at the plan.
  Tensor q = Tensor::empty({1, 64, 2, 128}, DType::bf16, Device::cuda), v = Tensor::empty({1, 64, 2, 64}, DType::bf16, Device::cuda);
  Tensor o = Tensor::empty({1, 64, 2, 64}, DType::bf16, Device::cuda), lse = Tensor::empty({1, 2, 64}, DType::f32, Device::cuda);
  fill_normal(q, 6);
  fill_normal(v, 7);
  expect_error([&] { attention_forward(q, q, v, o, lse); },
               {"v: head_dim_v 64 differs from head_dim 128", "the hopper forward kernels are compiled for no such pair",
                "(192, 128)"});
  PairTensors f32(DType::f32, 64);
  expect_error([&] { attention_forward(f32.q, f32.k, f32.v, f32.o, f32.lse); },
               {"v: head_dim_v 128 differs from head_dim 192", "the fp32 forward kernels", "runs on the cpu"});
}

}  // namespace
