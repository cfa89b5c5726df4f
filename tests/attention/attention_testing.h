// Test helpers shared by the CPU and GPU attention tests: tensors in every layout, the fp64 oracle
// and error metrics.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <fmt/format.h>

#include <limits>
#include <string>
#include <string_view>
#include <tuple>

#include "attention/capabilities.h"
#include "env_testing.h"
#include "flashlm/attention.h"
#include "flashlm/flashlm.h"

namespace flashlm::testing {

// hopper_alibi_sink_route() forced to `on` for the guard's scope (whatever FLASHLM_HOPPER_ALIBI_SINK says),
// then restored: the tests run ALiBi and sinks on the Hopper kernels and on mma.sync in one binary.
struct HopperAlibiSinkRoute {
  bool was;
  explicit HopperAlibiSinkRoute(bool on) : was(hopper_alibi_sink_route()) { set_hopper_alibi_sink_route(on); }
  ~HopperAlibiSinkRoute() { set_hopper_alibi_sink_route(was); }
  HopperAlibiSinkRoute(const HopperAlibiSinkRoute&) = delete;
  HopperAlibiSinkRoute& operator=(const HopperAlibiSinkRoute&) = delete;
};

enum class Layout { bshd, bhsd, sliced };

inline std::string layout_name(Layout l) {
  return l == Layout::bshd ? "bshd" : l == Layout::bhsd ? "bhsd" : "sliced";
}

// A [B, N, H, D] view over owned storage laid out as asked: BSHD contiguous, BHSD contiguous (seen
// through a permutation) or a slice of a larger BSHD buffer (padded rows and head_dim).
struct LaidOut {
  Tensor storage;
  TensorView view;
};

inline LaidOut make_laid_out(Layout layout, int64_t B, int64_t N, int64_t H, int64_t D, DType dtype) {
  LaidOut t;
  switch (layout) {
    case Layout::bshd:
      t.storage = Tensor::empty({B, N, H, D}, dtype);
      t.view = t.storage.view();
      break;
    case Layout::bhsd:
      t.storage = Tensor::empty({B, H, N, D}, dtype);
      t.view = t.storage.view().permute({0, 2, 1, 3});
      break;
    case Layout::sliced:
      t.storage = Tensor::empty({B, N + 3, H, D + 8}, dtype);
      t.view = t.storage.view().slice(1, 2, 2 + N).slice(3, 0, D);
      break;
  }
  return t;
}

// Contiguous fp64 copy of any view.
inline Tensor to_f64(const TensorView& v) {
  Tensor t = Tensor::empty(std::span<const int64_t>(v.sizes.data(), static_cast<size_t>(v.ndim)), DType::f64);
  copy_into(t, v);
  return t;
}

// max |a - b| over two views of the same shape (NaN counts as infinite error).
inline double max_abs_diff(const TensorView& a, const TensorView& b) {
  Tensor x = to_f64(a), y = to_f64(b);
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double d = std::fabs(x.view().ptr<double>()[i] - y.view().ptr<double>()[i]);
    m = std::isnan(d) ? INFINITY : std::max(m, d);
  }
  return m;
}

inline double max_abs(const TensorView& a) {
  Tensor x = to_f64(a);
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(x.view().ptr<double>()[i]));
  return m;
}

inline bool all_finite_or_neg_inf(const TensorView& a) {
  Tensor x = to_f64(a);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = x.view().ptr<double>()[i];
    if (std::isnan(v) || v == INFINITY) return false;
  }
  return true;
}

// Runs `call` and checks that it throws flashlm::Error whose message contains every fragment.
inline void expect_error(const std::function<void()>& call, std::initializer_list<std::string> fragments) {
  try {
    call();
    ADD_FAILURE() << "expected flashlm::Error";
  } catch (const Error& e) {
    for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

enum class Mask { none, top_left, bottom_right };

struct Case {
  int64_t B, Nq, Nk, Hq, Hk, D;
  Layout layout;
  Mask mask;
  DType dtype;
  int64_t Dv = 0;  // v's (o's, dout's) head dim; 0: D
};

inline int64_t value_dim(const Case& c) { return c.Dv > 0 ? c.Dv : c.D; }

inline std::string case_name(const Case& c) {
  const char* mask = c.mask == Mask::none ? "full" : c.mask == Mask::top_left ? "causalTL" : "causalBR";
  return fmt::format("b{}_q{}_k{}_h{}x{}_d{}{}_{}_{}_{}", c.B, c.Nq, c.Nk, c.Hq, c.Hk, c.D,
                     c.Dv > 0 ? fmt::format("_dv{}", c.Dv) : std::string(), layout_name(c.layout), mask,
                     dtype_name(c.dtype));
}

// Whether an option's view (alibi_slopes, learnable_sink, dlearnable_sink) is given.
inline bool given(const TensorView& t) { return t.ndim != 0 || t.data != nullptr; }

inline void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

inline AttentionOptions options_for(Mask mask, AttentionImpl impl) {
  AttentionOptions o;
  o.impl = impl;
  o.causal = mask != Mask::none;
  o.align = mask == Mask::bottom_right ? CausalAlign::bottom_right : CausalAlign::top_left;
  return o;
}

// Everything one attention call reads and writes, in one layout and dtype, on the host.
// (dsink: the sink's gradient, fp32 [Hq], which backward() asks for whenever the options have a learnable_sink
// and no dlearnable_sink of their own.)
struct Problem {
  LaidOut q, k, v, o, dout, dq, dk, dv;
  Tensor lse, dsink;
  Problem(const Case& c, Layout layout, DType dtype, uint64_t seed)
      : q(make_laid_out(layout, c.B, c.Nq, c.Hq, c.D, dtype)),
        k(make_laid_out(layout, c.B, c.Nk, c.Hk, c.D, dtype)),
        v(make_laid_out(layout, c.B, c.Nk, c.Hk, value_dim(c), dtype)),
        o(make_laid_out(layout, c.B, c.Nq, c.Hq, value_dim(c), dtype)),
        dout(make_laid_out(layout, c.B, c.Nq, c.Hq, value_dim(c), dtype)),
        dq(make_laid_out(layout, c.B, c.Nq, c.Hq, c.D, dtype)),
        dk(make_laid_out(layout, c.B, c.Nk, c.Hk, c.D, dtype)),
        dv(make_laid_out(layout, c.B, c.Nk, c.Hk, value_dim(c), dtype)),
        lse(Tensor::empty({c.B, c.Hq, c.Nq}, dtype == DType::f64 ? DType::f64 : DType::f32)),
        dsink(Tensor::empty({c.Hq}, DType::f32)) {
    fill_normal(q.view, seed);
    fill_normal(k.view, seed + 1);
    fill_normal(v.view, seed + 2);
    fill_normal(dout.view, seed + 3);
    poison();
  }
  // NaN in every output: an element the kernel forgets to write fails the comparison.
  void poison() {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (auto* t : {&o, &dq, &dk, &dv}) fill_value(t->view, nan);
    fill_value(lse, nan);
    fill_value(dsink, nan);
  }
  // The same inputs (already rounded to their dtype) as fp64 BSHD tensors.
  Problem(const Problem& src, const Case& c)
      : Problem(c, Layout::bshd, DType::f64, 0) {
    copy_into(q.view, src.q.view);
    copy_into(k.view, src.k.view);
    copy_into(v.view, src.v.view);
    copy_into(dout.view, src.dout.view);
  }
  void forward(const AttentionOptions& opt) { attention_forward(q.view, k.view, v.view, o.view, lse, opt); }
  void backward(const AttentionOptions& opt) {
    AttentionOptions with_dsink = opt;
    if (given(opt.learnable_sink) && !given(opt.dlearnable_sink)) with_dsink.dlearnable_sink = dsink.view();
    attention_backward(q.view, k.view, v.view, o.view, lse, dout.view, dq.view, dk.view, dv.view, with_dsink);
  }
  void run(const AttentionOptions& opt) {
    forward(opt);
    backward(opt);
  }
  // The same calls on the current GPU, on device copies that keep every layout, stride and offset (and
  // the NaN poison of the outputs); the results are copied back into this host problem.
  void run_on_device(const AttentionOptions& opt, bool with_backward = true);
};

// Allowed max-abs error of a result against the fp64 oracle. fp16/bf16 follow FlashAttention's rule:
// at most twice the error of the naive attention computed with the same low-precision storage, plus 1e-3.
inline double tolerance(DType dtype, double naive_lowp_error, double ref_scale) {
  switch (dtype) {
    case DType::f64: return 1e-10 * std::max(1.0, ref_scale);
    case DType::f32: return 2e-5 * std::max(1.0, ref_scale);
    default: return 2 * naive_lowp_error + 1e-3;
  }
}

// Runs `body` with FLASHLM_ATTENTION_KERNEL set to `value` (restoring what was there): the GPU runs of this
// binary may set it to "mma" for the whole process.
template <class Body>
void with_kernel_choice(const char* value, Body&& body) {
  const ScopedEnvironment choice("FLASHLM_ATTENTION_KERNEL", value);
  body();
}

// The allowed max-abs error of a CUDA flash result against the fp64 oracle where the low-precision baseline is
// the CPU's naive attention: in fp16/bf16 the low-precision rule (twice the error of the naive attention with the
// same 16-bit storage, whose only error on the CPU is the rounding of its outputs, plus 1e-3) and, for the
// kernels' 16-bit P and dS in their GEMMs, 4 unit roundoffs of the result's scale; fp32 kernels compute in fp32
// throughout. A band edge off by one key, a missing cap, slope or zero column is far above it.
inline double cuda_flash_tolerance(DType dtype, double lowp_error, double ref_scale) {
  if (dtype == DType::f32) return 1e-4 * std::max(1.0, ref_scale);
  const double unit_roundoff = dtype == DType::bf16 ? 1.0 / 256 : 1.0 / 2048;
  return 2 * lowp_error + 1e-3 + 4 * unit_roundoff * std::max(1.0, ref_scale);
}

// What dsink[h] of a 16-bit flash backward may differ by beyond tolerance(): dsink_h = -Σ_i P_sink,i · Delta_i
// sums over every row of the batch, and the flash backward's Delta_i = dO_i · O_i reads the stored O, rounded to
// the dtype, where the naive one derives Delta from its fp64 P: in fp16 / bf16 each term may be off by
// eps · P_sink,i · Σ_d |dO_id O_id|. `ref` is the fp64 oracle's problem (its o, dout, lse), `sinks` the host sinks.
inline double dsink_rounding_allowance(const Case& c, const Problem& ref, const TensorView& sinks, int64_t h) {
  const double eps = c.dtype == DType::bf16 ? 0x1p-8 : c.dtype == DType::f16 ? 0x1p-11 : 0.0;
  if (eps == 0) return 0;
  Tensor o = to_f64(ref.o.view), dout = to_f64(ref.dout.view), lse = to_f64(ref.lse);
  const int64_t Dv = value_dim(c);
  const double sink = double(sinks.ptr<const float>()[h * sinks.stride(0)]);
  double rounding = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t i = 0; i < c.Nq; ++i) {
      // A row with neither a key nor a sink (lse = -inf, o = 0) has no sink probability: 0, not exp(-inf + inf).
      const double row_lse = lse.view().ptr<double>()[(b * c.Hq + h) * c.Nq + i];
      const double p_sink = row_lse == -INFINITY ? 0.0 : std::exp(sink - row_lse);
      const int64_t row = ((b * c.Nq + i) * c.Hq + h) * Dv;
      double sum = 0;
      for (int64_t d = 0; d < Dv; ++d) {
        sum += std::fabs(o.view().ptr<double>()[row + d] * dout.view().ptr<double>()[row + d]);
      }
      rounding += p_sink * sum;
    }
  }
  return 2 * eps * rounding;
}

// What dq and dk of a flash backward that reads o rounded to a 16-bit dtype (the fp8 backward's o is bf16, its
// gradients fp32 or bf16) may differ by beyond tolerance(), element by element. Delta_i = rowsum(dO_i ∘ O_i) is then
// off by up to δ_i = eps · Σ_d |dO_id O_id| (eps two unit roundoffs of o's dtype), so dS_ij = P_ij (dP_ij - Delta_i)
// by P_ij δ_i, dq_id by scale · δ_i · Σ_j P_ij |k_jd| and dk_jd by scale · Σ_i P_ij δ_i |q_id| (over the key head's
// query heads). Where o or v is large, this outgrows the naive attention's rounding of the gradients, which the
// low-precision rule measures. `ref` is the fp64 oracle's problem (BSHD, default scale, c's causal mask); the
// allowances come as [B, N, H, D] fp64 tensors shaped like dq and dk.
struct DeltaRoundingAllowance {
  Tensor dq, dk;
};
inline DeltaRoundingAllowance delta_rounding_allowance(const Case& c, const Problem& ref, DType o_dtype) {
  const double eps = o_dtype == DType::bf16 ? 0x1p-8 : o_dtype == DType::f16 ? 0x1p-11 : 0.0;
  const int64_t D = c.D, Dv = value_dim(c), group = c.Hq / c.Hk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t offset = c.mask == Mask::bottom_right ? c.Nk - c.Nq : 0;
  const Tensor q = to_f64(ref.q.view), k = to_f64(ref.k.view), o = to_f64(ref.o.view), dout = to_f64(ref.dout.view),
               lse = to_f64(ref.lse);
  DeltaRoundingAllowance a{Tensor::empty({c.B, c.Nq, c.Hq, D}, DType::f64), Tensor::empty({c.B, c.Nk, c.Hk, D}, DType::f64)};
  fill_value(a.dq, 0.0);
  fill_value(a.dk, 0.0);
  const double *qp = q.view().ptr<double>(), *kp = k.view().ptr<double>(), *op = o.view().ptr<double>();
  const double *dop = dout.view().ptr<double>(), *lp = lse.view().ptr<double>();
  double *aq = a.dq.view().ptr<double>(), *ak = a.dk.view().ptr<double>();
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Nq; ++i) {
        const double row_lse = lp[(b * c.Hq + h) * c.Nq + i];
        if (row_lse == -INFINITY) continue;  // a row that sees no key has zero gradients
        const int64_t orow = ((b * c.Nq + i) * c.Hq + h) * Dv, qrow = ((b * c.Nq + i) * c.Hq + h) * D;
        double delta = 0;
        for (int64_t d = 0; d < Dv; ++d) delta += std::fabs(dop[orow + d] * op[orow + d]);
        delta *= eps;
        const int64_t visible = c.mask == Mask::none ? c.Nk : std::clamp<int64_t>(i + offset + 1, 0, c.Nk);
        for (int64_t j = 0; j < visible; ++j) {
          const int64_t krow = ((b * c.Nk + j) * c.Hk + h / group) * D;
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += qp[qrow + d] * kp[krow + d];
          const double w = scale * std::exp(scale * s - row_lse) * delta;
          for (int64_t d = 0; d < D; ++d) {
            aq[qrow + d] += w * std::fabs(kp[krow + d]);
            ak[krow + d] += w * std::fabs(qp[qrow + d]);
          }
        }
      }
  return a;
}

// The error plan_cuda_attention raises for a call of `pass` on p, empty where it plans a kernel. A backward runs
// the forward first, so a problem without a forward kernel fails with the forward's message.
inline std::string cuda_plan_error(const AttentionProblem& p, AttentionImpl impl, AttentionPass pass) {
  const auto error = [&](AttentionPass pa) -> std::string {
    try {
      plan_cuda_attention(pa == AttentionPass::forward ? "attention_forward" : "attention_backward", p, impl, pa);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  std::string forward = error(AttentionPass::forward);
  if (pass == AttentionPass::forward || !forward.empty()) return forward;
  return error(AttentionPass::backward);
}

// dsink[h] of `got` (fp32, on the host) against the oracle's (`ref`) for every head: within `tol` (tolerance or
// cuda_flash_tolerance) of the low-precision naive attention's error (`lowp`'s dsink), plus
// dsink_rounding_allowance. `sinks` are the host sinks.
inline void expect_dsink_matches(const Case& c, const Problem& ref, const TensorView& got, const TensorView& lowp,
                                 const TensorView& sinks, double (*tol)(DType, double, double),
                                 const std::string& name) {
  for (int64_t h = 0; h < c.Hq; ++h) {
    const double want = ref.dsink.view().ptr<float>()[h], ours = got.ptr<const float>()[h];
    const double low = lowp.ptr<const float>()[h];
    const double bound = tol(c.dtype, std::fabs(low - want), std::fabs(want)) +
                         dsink_rounding_allowance(c, ref, sinks, h);
    EXPECT_LE(std::fabs(ours - want), bound) << "dsink[" << h << "] of " << name << " (ref " << want << ")";
  }
}

// The flash implementation with `flash`'s options (its impl set to flash) against the fp64 naive oracle with
// the same options on the very same (rounded) inputs: o, dq, dk, dv within tolerance() (the low-precision
// rule measured on the naive attention in c.dtype), lse finite where the oracle's is, -inf where it is.
inline void expect_flash_matches_oracle(const Case& c, AttentionOptions flash, const std::string& what = "") {
  flash.impl = AttentionImpl::flash;
  AttentionOptions naive = flash;
  naive.impl = AttentionImpl::naive;
  const std::string name = case_name(c) + what;

  Problem ours(c, c.layout, c.dtype, 1000 + static_cast<uint64_t>(c.Nq * 7 + c.Nk));
  ours.run(flash);
  Problem ref(ours, c);  // fp64 oracle on the very same (rounded) inputs
  ref.run(naive);
  Problem naive_lowp(c, c.layout, c.dtype, 0);  // naive attention with the same low-precision storage
  copy_into(naive_lowp.q.view, ours.q.view);
  copy_into(naive_lowp.k.view, ours.k.view);
  copy_into(naive_lowp.v.view, ours.v.view);
  copy_into(naive_lowp.dout.view, ours.dout.view);
  naive_lowp.run(naive);

  struct Pair {
    const char* name;
    const TensorView &got, &want, &lowp;
  };
  for (const Pair& t : {Pair{"o", ours.o.view, ref.o.view, naive_lowp.o.view},
                        Pair{"dq", ours.dq.view, ref.dq.view, naive_lowp.dq.view},
                        Pair{"dk", ours.dk.view, ref.dk.view, naive_lowp.dk.view},
                        Pair{"dv", ours.dv.view, ref.dv.view, naive_lowp.dv.view}}) {
    const double err = max_abs_diff(t.got, t.want);
    const double tol = tolerance(c.dtype, max_abs_diff(t.lowp, t.want), max_abs(t.want));
    EXPECT_LE(err, tol) << t.name << " of " << name << " (max |ref| " << max_abs(t.want) << ")";
  }
  if (given(flash.learnable_sink) && !given(flash.dlearnable_sink)) {
    expect_dsink_matches(c, ref, ours.dsink.view(), naive_lowp.dsink.view(), flash.learnable_sink, tolerance, name);
  }
  // logsumexp: finite where a key is visible, -inf where none is, never NaN.
  Tensor lse_ours = to_f64(ours.lse), lse_ref = to_f64(ref.lse);
  for (int64_t i = 0; i < lse_ref.numel(); ++i) {
    const double a = lse_ours.view().ptr<double>()[i], b = lse_ref.view().ptr<double>()[i];
    if (std::isinf(b)) {
      EXPECT_EQ(a, b) << "lse[" << i << "] of " << name;
    } else {
      EXPECT_NEAR(a, b, c.dtype == DType::f64 ? 1e-10 : 1e-4) << "lse[" << i << "] of " << name;
    }
  }
}

// dq, dk, dv of an fp64 problem against central finite differences of L = Σ O ∘ dO (p's dout as the weights),
// every element, within `tol`.
inline void expect_gradients_match_central_differences(Problem& p, const AttentionOptions& opt, double tol = 1e-6) {
  p.run(opt);
  auto loss = [&] {
    p.forward(opt);
    Tensor o = to_f64(p.o.view), w = to_f64(p.dout.view);
    double s = 0;
    for (int64_t i = 0; i < o.numel(); ++i) s += o.view().ptr<double>()[i] * w.view().ptr<double>()[i];
    return s;
  };
  const double eps = 1e-6;
  for (auto [name, x, g] : {std::tuple{"q", &p.q, &p.dq}, {"k", &p.k, &p.dk}, {"v", &p.v, &p.dv}}) {
    Tensor analytic = to_f64(g->view);
    Tensor xs = to_f64(x->view);
    for (int64_t i = 0; i < xs.numel(); ++i) {
      double* xi = xs.view().ptr<double>() + i;
      const double saved = *xi;
      *xi = saved + eps;
      copy_into(x->view, xs);
      const double up = loss();
      *xi = saved - eps;
      copy_into(x->view, xs);
      const double down = loss();
      *xi = saved;
      copy_into(x->view, xs);
      EXPECT_NEAR(analytic.view().ptr<double>()[i], (up - down) / (2 * eps), tol) << "d" << name << "[" << i << "]";
    }
  }
  // The sink (fp32, so a step of 2^-10, exact for the sinks' magnitudes, and the looser tolerance of that step).
  if (given(opt.learnable_sink) && !given(opt.dlearnable_sink)) {
    Tensor analytic = to_f64(p.dsink.view());
    const TensorView& sink = opt.learnable_sink;
    for (int64_t h = 0; h < sink.size(0); ++h) {
      float* sh = sink.ptr<float>() + h * sink.stride(0);
      const float saved = *sh;
      if (!std::isfinite(saved)) continue;
      const float step = 1.0f / 1024;
      *sh = saved + step;
      const double up = loss();
      *sh = saved - step;
      const double down = loss();
      *sh = saved;
      const double a = analytic.view().ptr<double>()[h];
      EXPECT_NEAR(a, (up - down) / (2.0 * step), 1e-5 * std::max(1.0, std::fabs(a)))
          << "dsink[" << h << "]";
    }
    p.forward(opt);
  }
}


// A host view as the C ABI's flashlm_tensor (flashlm_dtype and DType share their numbering).
inline flashlm_tensor c_tensor(const TensorView& t) {
  flashlm_tensor c{};
  c.data = t.data;
  c.ndim = t.ndim;
  c.dtype = static_cast<decltype(c.dtype)>(t.dtype);
  c.device = t.device == Device::cuda ? FLASHLM_CUDA : FLASHLM_CPU;
  for (int d = 0; d < t.ndim; ++d) {
    c.sizes[d] = t.size(d);
    c.strides[d] = t.stride(d);
  }
  return c;
}

// A device copy of a host LaidOut: same storage shape, same strides, same offset of the view.
inline LaidOut to_device(const LaidOut& host) {
  LaidOut d;
  const TensorView& s = host.storage.view();
  d.storage = Tensor::empty(std::span<const int64_t>(s.sizes.data(), static_cast<size_t>(s.ndim)), s.dtype, Device::cuda);
  copy_into(d.storage.view(), s);
  d.view = host.view;
  d.view.device = Device::cuda;
  d.view.data = static_cast<char*>(d.storage.data()) +
                (static_cast<char*>(host.view.data) - static_cast<char*>(host.storage.data()));
  return d;
}

inline void copy_back(LaidOut& host, const LaidOut& device) { copy_into(host.storage.view(), device.storage.view()); }

inline void Problem::run_on_device(const AttentionOptions& opt, bool with_backward) {
  LaidOut dq_ = to_device(q), dk_ = to_device(k), dv_ = to_device(v), do_ = to_device(o), ddout = to_device(dout);
  LaidOut ddq = to_device(dq), ddk = to_device(dk), ddv = to_device(dv);
  const TensorView& l = lse.view();
  Tensor dlse = Tensor::empty(std::span<const int64_t>(l.sizes.data(), 3), l.dtype, Device::cuda);
  copy_into(dlse.view(), l);
  attention_forward(dq_.view, dk_.view, dv_.view, do_.view, dlse, opt);
  if (with_backward) {
    attention_backward(dq_.view, dk_.view, dv_.view, do_.view, dlse, ddout.view, ddq.view, ddk.view, ddv.view, opt);
  }
  copy_back(o, do_);
  copy_back(dq, ddq);
  copy_back(dk, ddk);
  copy_back(dv, ddv);
  copy_into(l, dlse.view());
}


// o (and, `with_backward`, dq, dk and dv) of the CUDA run `ours` against the fp64 oracle `ref`, within
// cuda_flash_tolerance of `lowp`: the naive attention (`naive`: its CPU options) run here in the case's dtype on
// the same inputs.
inline void expect_outputs_near_oracle(const Case& c, const std::string& name, const Problem& ours,
                                       const Problem& ref, Problem& lowp, const AttentionOptions& naive,
                                       bool with_backward = true) {
  copy_into(lowp.q.view, ours.q.view);
  copy_into(lowp.k.view, ours.k.view);
  copy_into(lowp.v.view, ours.v.view);
  copy_into(lowp.dout.view, ours.dout.view);
  if (with_backward) lowp.run(naive);
  else lowp.forward(naive);

  struct Item {
    const char* what;
    const TensorView &got, &want, &low;
  };
  for (const Item& t : {Item{"o", ours.o.view, ref.o.view, lowp.o.view}, Item{"dq", ours.dq.view, ref.dq.view, lowp.dq.view},
                        Item{"dk", ours.dk.view, ref.dk.view, lowp.dk.view},
                        Item{"dv", ours.dv.view, ref.dv.view, lowp.dv.view}}) {
    if (!with_backward && std::string_view(t.what) != "o") continue;
    const double err = max_abs_diff(t.got, t.want), low_err = max_abs_diff(t.low, t.want);
    const double tol = cuda_flash_tolerance(c.dtype, low_err, max_abs(t.want));
    EXPECT_LE(err, tol) << t.what << " of " << name << " (cpu naive " << dtype_name(c.dtype) << " error " << low_err
                        << ", max |ref| " << max_abs(t.want) << ")";
  }
}

}  // namespace flashlm::testing
