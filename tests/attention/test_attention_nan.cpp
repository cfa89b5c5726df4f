// NaN in the inputs propagates as in PyTorch's SDPA (SPEC §2): to exactly the outputs whose math touches it
// through a key a query sees, never through a masked key, and a row that sees no key stays O = 0,
// lse = -inf. Each case puts one NaN into one row of q, k, v or dO and compares, row by row, which outputs
// are NaN with what that rule predicts, for every impl (and on the GPU when there is one). An inf is
// checked the same way against the fp64 reference: every impl has non-finite values in the same rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../gpu_testing.h"
#include "flashlm/attention.h"

using namespace flashlm;

namespace {

constexpr int64_t B = 2, Hq = 4, Hk = 2;
constexpr int64_t kBatch = 1, kQueryHead = 3, kKeyHead = kQueryHead / (Hq / Hk);
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

enum class Where { q, k, v, dout };
const char* where_name(Where w) { return w == Where::q ? "q" : w == Where::k ? "k" : w == Where::v ? "v" : "dout"; }

struct Shape {
  int64_t nq, nk;
  bool causal;
  CausalAlign align;
};

// The keys [0, visible_keys(i)) query i sees.
struct Problem {
  int64_t seq_q, seq_k, causal_offset;
  bool causal;
  int64_t visible_keys(int64_t i) const {
    return causal ? std::clamp<int64_t>(i + causal_offset + 1, 0, seq_k) : seq_k;
  }
};

// Which rows of each output hold a NaN: o[b][h][i], lse, dq, dk[b][hk][j], dv.
struct NanRows {
  std::vector<bool> o, lse, dq, dk, dv;
  bool operator==(const NanRows&) const = default;
};

std::string describe(const std::vector<bool>& rows) {
  std::string s;
  for (size_t i = 0; i < rows.size(); ++i) s += rows[i] ? 'N' : '.';
  return s;
}

// The rule, computed on booleans: lse_i is NaN when row i sees a key and its q row or a seen k row is NaN;
// O_i also when a seen v row is; the backward follows P = exp(S - lse), dP = dO Vᵀ, Delta = rowsum(dO∘O),
// dS = P∘(dP - Delta), dQ = dS K, dK = dSᵀ Q, dV = Pᵀ dO over the visible pairs only.
NanRows predict(const Problem& p, Where where, int64_t row) {
  NanRows r;
  const int64_t group = Hq / Hk;
  r.o.assign(size_t(B * Hq * p.seq_q), false);
  r.lse = r.dq = r.o;
  r.dk.assign(size_t(B * Hk * p.seq_k), false);
  r.dv = r.dk;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      const bool this_q_head = b == kBatch && h == kQueryHead, this_k_head = b == kBatch && hk == kKeyHead;
      for (int64_t i = 0; i < p.seq_q; ++i) {
        const int64_t visible = p.visible_keys(i);
        const bool q_nan = where == Where::q && this_q_head && i == row;
        const bool do_nan = where == Where::dout && this_q_head && i == row;
        const bool k_seen = where == Where::k && this_k_head && row < visible;
        const bool v_seen = where == Where::v && this_k_head && row < visible;
        const bool lse_nan = visible > 0 && (q_nan || k_seen);
        const bool o_nan = lse_nan || (visible > 0 && v_seen);
        const bool delta_nan = visible > 0 && (o_nan || do_nan);
        const size_t qi = size_t((b * Hq + h) * p.seq_q + i);
        r.lse[qi] = lse_nan;
        r.o[qi] = o_nan;
        for (int64_t j = 0; j < visible; ++j) {
          const bool k_nan = where == Where::k && this_k_head && j == row;
          const bool v_nan = where == Where::v && this_k_head && j == row;
          const bool ds_nan = lse_nan || do_nan || v_nan || delta_nan;
          const size_t kj = size_t((b * Hk + hk) * p.seq_k + j);
          if (ds_nan || k_nan) r.dq[qi] = true;
          if (ds_nan || q_nan) r.dk[kj] = true;
          if (lse_nan || do_nan) r.dv[kj] = true;
        }
      }
    }
  return r;
}

// The rows of t with a NaN (non_finite: a NaN or an inf).
std::vector<bool> nan_rows(const TensorView& t, int64_t heads, int64_t seq, bool bshd, bool non_finite) {
  const int64_t D = t.size(t.ndim - 1);
  Tensor h = Tensor::empty(std::span<const int64_t>(t.sizes.data(), size_t(t.ndim)), DType::f64);
  copy_into(h, t);
  std::vector<bool> rows(size_t(B * heads * seq), false);
  const double* x = h.view().ptr<double>();
  const int64_t width = bshd ? D : 1;
  for (int64_t n = 0; n < h.numel(); ++n) {
    if (non_finite ? std::isfinite(x[n]) || (!bshd && x[n] == -HUGE_VAL) : x[n] == x[n]) continue;  // lse -inf: empty
    const int64_t e = n / width;  // bshd: [b][s][h]; lse: [b][h][s]
    const int64_t b = bshd ? e / (seq * heads) : e / (heads * seq);
    const int64_t s = bshd ? e / heads % seq : e % seq;
    const int64_t hh = bshd ? e % heads : e / seq % heads;
    rows[size_t((b * heads + hh) * seq + s)] = true;
  }
  return rows;
}

// Runs forward and backward with `poison` (NaN or inf) in element 5 of `where`'s row `row` and reports the
// rows holding NaN (poison NaN) or any non-finite value (poison inf).
NanRows observe(const Shape& shape, int64_t D, Where where, int64_t row, AttentionImpl impl, Device device,
                DType dtype, double poison = kNaN) {
  const int64_t nq = shape.nq, nk = shape.nk;
  auto make = [&](std::initializer_list<int64_t> sizes, uint64_t seed) {
    Tensor t = Tensor::empty(sizes, DType::f64);
    fill_normal(t, seed);
    return t;
  };
  Tensor q = make({B, nq, Hq, D}, 1), k = make({B, nk, Hk, D}, 2), v = make({B, nk, Hk, D}, 3);
  Tensor dout = make({B, nq, Hq, D}, 4);
  Tensor& poisoned = where == Where::q ? q : where == Where::k ? k : where == Where::v ? v : dout;
  const int64_t heads = where == Where::q || where == Where::dout ? kQueryHead : kKeyHead;
  const TensorView& pv = poisoned.view();
  pv.ptr<double>()[kBatch * pv.stride(0) + row * pv.stride(1) + heads * pv.stride(2) + 5] = poison;

  auto on_device = [&](const Tensor& host, DType t) {
    Tensor d = Tensor::empty(std::span<const int64_t>(host.view().sizes.data(), 4), t, device);
    Tensor staged = Tensor::empty(std::span<const int64_t>(host.view().sizes.data(), 4), t);
    copy_into(staged, host);
    copy_into(d, staged);
    return d;
  };
  // fp8_e4m3 inputs (a NaN code stays NaN) come with bf16 o, dout and gradients and descales other than 1.
  const bool fp8 = dtype == DType::f8e4m3;
  const DType out = fp8 ? DType::bf16 : dtype;
  Tensor dq_ = on_device(q, dtype), dk_ = on_device(k, dtype), dv_ = on_device(v, dtype), ddo = on_device(dout, out);
  Tensor o = Tensor::empty({B, nq, Hq, D}, out, device), lse = Tensor::empty({B, Hq, nq}, DType::f32, device);
  Tensor gq = Tensor::empty({B, nq, Hq, D}, out, device), gk = Tensor::empty({B, nk, Hk, D}, out, device);
  Tensor gv = Tensor::empty({B, nk, Hk, D}, out, device);
  AttentionOptions opt;
  opt.impl = impl;
  if (fp8) opt.q_descale = 0.5f, opt.k_descale = 0.25f, opt.v_descale = 2.0f;
  opt.causal = shape.causal;
  opt.align = shape.align;
  attention_forward(dq_, dk_, dv_, o, lse, opt);
  attention_backward(dq_, dk_, dv_, o, lse, ddo, gq, gk, gv, opt);

  auto host = [&](const Tensor& t) {
    Tensor h = Tensor::empty(std::span<const int64_t>(t.view().sizes.data(), size_t(t.view().ndim)), t.view().dtype);
    copy_into(h, t);
    return h;
  };
  NanRows r;
  const bool inf = std::isinf(poison);
  r.o = nan_rows(host(o), Hq, nq, true, inf);
  r.lse = nan_rows(host(lse), Hq, nq, false, inf);
  r.dq = nan_rows(host(gq), Hq, nq, true, inf);
  r.dk = nan_rows(host(gk), Hk, nk, true, inf);
  r.dv = nan_rows(host(gv), Hk, nk, true, inf);
  // Rows that see no key stay O = 0, lse = -inf, whatever the NaN.
  Tensor lse_h = host(lse);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        if (!shape.causal || i + (shape.align == CausalAlign::bottom_right ? nk - nq : 0) >= 0) continue;
        EXPECT_EQ(lse_h.view().ptr<float>()[(b * Hq + h) * nq + i], -std::numeric_limits<float>::infinity());
      }
  return r;
}

Problem problem_of(const Shape& s) {
  return {s.nq, s.nk, s.align == CausalAlign::bottom_right ? s.nk - s.nq : 0, s.causal};
}

const Shape kShapes[] = {{70, 90, false, CausalAlign::top_left},
                         {70, 90, true, CausalAlign::top_left},
                         {90, 45, true, CausalAlign::bottom_right}};  // rows 0..44 see no key

// poison NaN: the rows predict() gives; inf: the non-finite rows of the fp64 reference on the CPU. Head dim
// 32 runs the mma.sync kernels on every GPU; 64 the Hopper forward on sm_90.
void check(Device device, AttentionImpl impl, DType dtype, bool masked_may_leak, double poison = kNaN,
           int64_t D = 32) {
  for (const Shape& shape : kShapes)
    for (Where where : {Where::q, Where::k, Where::v, Where::dout}) {
      const bool query_side = where == Where::q || where == Where::dout;
      const int64_t row = query_side ? shape.nq - 30 : 20;
      const Problem p = problem_of(shape);
      const NanRows want = std::isnan(poison)
                               ? predict(p, where, row)
                               : observe(shape, D, where, row, AttentionImpl::naive, Device::cpu, DType::f64, poison);
      const NanRows got = observe(shape, D, where, row, impl, device, dtype, poison);
      const std::string what =
          std::string(attention_impl_name(impl)) + " " + std::string(dtype_name(dtype)) + " on " +
          std::string(device_name(device)) + (std::isnan(poison) ? ", NaN" : ", inf") + " in " + where_name(where) + " row " + std::to_string(row) + ", d " +
          std::to_string(D) + ", nq " +
          std::to_string(shape.nq) + " nk " + std::to_string(shape.nk) +
          (shape.causal ? shape.align == CausalAlign::top_left ? " causal" : " causal bottom-right" : "");
      // On the GPU a NaN under a causal mask also reaches masked pairs that share a matrix product with the
      // pairs that see it (0 · NaN in P·V, dS·K, dSᵀ·Q: tensor-core tiles and cuBLAS, as in PyTorch's own
      // kernels): there the predicted rows must be NaN, and more may be.
      if (masked_may_leak && shape.causal) {
        auto covers = [&](const std::vector<bool>& g, const std::vector<bool>& w, const char* name) {
          for (size_t i = 0; i < w.size(); ++i) EXPECT_TRUE(!w[i] || g[i]) << what << ": " << name << " row " << i;
        };
        covers(got.o, want.o, "o"), covers(got.lse, want.lse, "lse"), covers(got.dq, want.dq, "dq");
        covers(got.dk, want.dk, "dk"), covers(got.dv, want.dv, "dv");
        continue;
      }
      EXPECT_EQ(describe(got.o), describe(want.o)) << what << ": o";
      EXPECT_EQ(describe(got.lse), describe(want.lse)) << what << ": lse";
      EXPECT_EQ(describe(got.dq), describe(want.dq)) << what << ": dq";
      EXPECT_EQ(describe(got.dk), describe(want.dk)) << what << ": dk";
      EXPECT_EQ(describe(got.dv), describe(want.dv)) << what << ": dv";
    }
}

TEST(AttentionNaN, PropagatesAsSdpaOnTheCpu) {
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash})
    for (DType dtype : {DType::f64, DType::f32, DType::bf16}) check(Device::cpu, impl, dtype, false);
}

// fp8_e4m3 on the CPU (its inputs have no inf: e4m3 saturates, so only NaN is checked).
TEST(AttentionNaN, PropagatesAsSdpaInFp8OnTheCpu) {
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash}) check(Device::cpu, impl, DType::f8e4m3, false);
}

TEST(AttentionNaN, PropagatesAsSdpaOnTheGpu) {
  SKIP_WITHOUT_GPU();
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash})
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (int64_t d : {32, 64}) check(Device::cuda, impl, dtype, true, kNaN, d);
}

// fp8_e4m3 on the GPU: the sm_90 forward (head dim 64) and the backward on the 16-bit kernels (the Hopper ones
// there), NaN only as on the CPU.
TEST(AttentionNaN, PropagatesAsSdpaInFp8OnTheGpu) {
  SKIP_WITHOUT_HOPPER();
  check(Device::cuda, AttentionImpl::flash, DType::f8e4m3, true, kNaN, 64);
}

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(AttentionNaN, InfReachesTheSameRowsInEveryImplOnTheCpu) {
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash})
    for (DType dtype : {DType::f32, DType::bf16}) check(Device::cpu, impl, dtype, false, kInf);
}

TEST(AttentionNaN, InfReachesTheSameRowsInEveryImplOnTheGpu) {
  SKIP_WITHOUT_GPU();
  for (AttentionImpl impl : {AttentionImpl::naive, AttentionImpl::flash})
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (int64_t d : {32, 64}) check(Device::cuda, impl, dtype, true, kInf, d);
}

}  // namespace
