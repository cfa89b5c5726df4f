// Packed variable-length attention (attention_varlen_*) against per-sequence calls of the fp64 reference on
// ragged packs (lengths 1, 17, 1000, 0, ...), both causal alignments, GQA, every dtype, outputs poisoned; on
// the CPU and (skipping without a GPU) on CUDA; and every bad offsets array refused with its name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "attention/attention_testing.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "gpu_testing.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

struct VarlenCase {
  std::vector<int32_t> len_q, len_k;
  int64_t Hq, Hk, D;
  Mask mask;
  DType dtype;
  bool padded_rows;  // rows of the packed tensors further apart than heads · head_dim (a sliced view)
  bool deterministic = false;
  int64_t window_left = -1, window_right = -1;  // AttentionOptions::window_size_*, per sequence
  double softcap = 0;
  int64_t Dv = 0;  // v's head dim (0: D)
  int alibi = 0;   // 0: none; 1: slopes [Hq]; 2: slopes [number of sequences, Hq]
  bool sink = false;
};

int64_t value_dim(const VarlenCase& c) { return c.Dv > 0 ? c.Dv : c.D; }

// The options without the slopes and sinks (Pack::options adds its own).
AttentionOptions varlen_options(const VarlenCase& c, AttentionImpl impl) {
  AttentionOptions o = options_for(c.mask, impl);
  o.window_size_left = c.window_left;
  o.window_size_right = c.window_right;
  o.softcap = c.softcap;
  return o;
}

std::string varlen_case_name(const VarlenCase& c) {
  std::string lens;
  for (size_t b = 0; b < c.len_q.size(); ++b) lens += fmt::format("{}x{}_", c.len_q[b], c.len_k[b]);
  const char* mask = c.mask == Mask::none ? "full" : c.mask == Mask::top_left ? "causalTL" : "causalBR";
  std::string variant;
  if (c.window_left >= 0 || c.window_right >= 0) {
    variant += fmt::format("_w{}_{}", c.window_left < 0 ? "inf" : std::to_string(c.window_left),
                           c.window_right < 0 ? "inf" : std::to_string(c.window_right));
  }
  if (c.softcap > 0) variant += fmt::format("_cap{}", static_cast<int>(c.softcap));
  if (c.Dv > 0) variant += fmt::format("_dv{}", c.Dv);
  if (c.alibi) variant += c.alibi == 1 ? "_alibi" : "_alibiB";
  if (c.sink) variant += "_sink";
  return fmt::format("{}h{}x{}_d{}_{}_{}{}{}{}", lens, c.Hq, c.Hk, c.D, mask, dtype_name(c.dtype),
                     c.padded_rows ? "_padded" : "", c.deterministic ? "_det" : "", variant);
}

void PrintTo(const VarlenCase& c, std::ostream* os) { *os << varlen_case_name(c); }

std::vector<int32_t> offsets_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  std::partial_sum(lengths.begin(), lengths.end(), cu.begin() + 1);
  return cu;
}

// A packed [total, heads, head_dim] tensor, its rows `padded_rows` apart by 8 extra elements.
struct Rows {
  Tensor storage;
  TensorView view;
  Rows() = default;
  Rows(int64_t total, int64_t heads, int64_t D, DType dtype, bool padded_rows, Device device = Device::cpu) {
    storage = Tensor::empty({total, heads, D + (padded_rows ? 8 : 0)}, dtype, device);
    view = storage.view().slice(2, 0, D);
  }
};

// A [total, heads, head_dim] view as [1, total, heads, head_dim] (and [heads, total] as [1, heads, total]),
// for the per-sequence reference calls on slices of it.
TensorView batch_of_one(const TensorView& t) {
  TensorView out = t;
  out.ndim = t.ndim + 1;
  for (int d = t.ndim; d > 0; --d) {
    out.sizes[static_cast<size_t>(d)] = t.size(d - 1);
    out.strides[static_cast<size_t>(d)] = t.stride(d - 1);
  }
  out.sizes[0] = 1;
  out.strides[0] = 0;
  return out;
}

// Everything a varlen call reads and writes, on the host.
// slopes and sinks (fp32, the same values in every Pack of a case) where the case asks for them, and dsink, the
// sink's gradient.
struct Pack {
  std::vector<int32_t> cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
  Rows q, k, v, o, dout, dq, dk, dv;
  Tensor lse, slopes, sinks, dsink;
  Pack(const VarlenCase& c, DType dtype, uint64_t seed, bool padded_rows)
      : cu_q(offsets_of(c.len_q)),
        cu_k(offsets_of(c.len_k)),
        q(cu_q.back(), c.Hq, c.D, dtype, padded_rows),
        k(cu_k.back(), c.Hk, c.D, dtype, padded_rows),
        v(cu_k.back(), c.Hk, value_dim(c), dtype, padded_rows),
        o(cu_q.back(), c.Hq, value_dim(c), dtype, padded_rows),
        dout(cu_q.back(), c.Hq, value_dim(c), dtype, padded_rows),
        dq(cu_q.back(), c.Hq, c.D, dtype, padded_rows),
        dk(cu_k.back(), c.Hk, c.D, dtype, padded_rows),
        dv(cu_k.back(), c.Hk, value_dim(c), dtype, padded_rows),
        lse(Tensor::empty({c.Hq, cu_q.back()}, dtype == DType::f64 ? DType::f64 : DType::f32)),
        dsink(Tensor::empty({c.Hq}, DType::f32)) {
    for (int32_t n : c.len_q) max_q = std::max<int64_t>(max_q, n);
    for (int32_t n : c.len_k) max_k = std::max<int64_t>(max_k, n);
    fill_normal(q.view, seed);
    fill_normal(k.view, seed + 1);
    fill_normal(v.view, seed + 2);
    fill_normal(dout.view, seed + 3);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (Rows* t : {&o, &dq, &dk, &dv}) fill_value(t->view, nan);
    fill_value(lse, nan);
    fill_value(dsink, nan);
    const int64_t sequences = static_cast<int64_t>(c.len_q.size());
    if (c.alibi) {
      const int64_t rows = c.alibi == 2 ? sequences : 1;
      slopes = c.alibi == 2 ? Tensor::empty({rows, c.Hq}, DType::f32) : Tensor::empty({c.Hq}, DType::f32);
      for (int64_t b = 0; b < rows; ++b) {
        for (int64_t h = 0; h < c.Hq; ++h) {
          slopes.view().ptr<float>()[b * c.Hq + h] = float(std::exp2(-4.0 * double(h + 1) / double(c.Hq)) * (1 + 0.3 * double(b)));
        }
      }
    }
    if (c.sink) {
      sinks = Tensor::empty({c.Hq}, DType::f32);
      for (int64_t h = 0; h < c.Hq; ++h) sinks.view().ptr<float>()[h] = float(2 * std::cos(double(h)) - 0.5);
    }
  }
  AttentionOptions options(const VarlenCase& c, AttentionImpl impl) {
    AttentionOptions o = varlen_options(c, impl);
    if (c.alibi) o.alibi_slopes = slopes.view();
    if (c.sink) {
      o.learnable_sink = sinks.view();
      o.dlearnable_sink = dsink.view();
    }
    return o;
  }
  // The same (rounded) inputs in `dtype`, outputs poisoned.
  Pack(const Pack& src, const VarlenCase& c, DType dtype) : Pack(c, dtype, 0, false) {
    copy_into(q.view, src.q.view);
    copy_into(k.view, src.k.view);
    copy_into(v.view, src.v.view);
    copy_into(dout.view, src.dout.view);
  }
  VarlenSequences seqs() const {
    return {cu_q.data(), cu_k.data(), static_cast<int64_t>(cu_q.size()) - 1, Device::cpu, max_q, max_k};
  }
  // (with_backward false: the forward alone, dq, dk, dv and dsink left poisoned; so in the calls below.)
  void run_varlen(const AttentionOptions& opt, bool with_backward = true) {
    attention_varlen_forward(q.view, k.view, v.view, o.view, lse, seqs(), opt);
    if (!with_backward) return;
    attention_varlen_backward(q.view, k.view, v.view, o.view, lse, dout.view, dq.view, dk.view, dv.view, seqs(), opt);
  }
  // The oracle: one batched reference call per sequence on that sequence's rows (4-D slices of the pack), with
  // that sequence's slopes; dsink the sum of the calls'.
  void run_per_sequence_reference(const VarlenCase& c, bool with_backward = true) {
    AttentionOptions opt = options(c, AttentionImpl::naive);
    Tensor dsink_b = Tensor::empty({c.Hq}, DType::f32);
    if (c.sink) {
      fill_value(dsink, 0.0);
      opt.dlearnable_sink = dsink_b.view();
    }
    const TensorView Q = batch_of_one(q.view), K = batch_of_one(k.view), V = batch_of_one(v.view);
    const TensorView O = batch_of_one(o.view), dO = batch_of_one(dout.view), L = batch_of_one(lse);
    const TensorView dQ = batch_of_one(dq.view), dK = batch_of_one(dk.view), dV = batch_of_one(dv.view);
    for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
      auto qs = [&](const TensorView& t) { return t.slice(1, cu_q[b], cu_q[b + 1]); };
      auto ks = [&](const TensorView& t) { return t.slice(1, cu_k[b], cu_k[b + 1]); };
      const TensorView lse_b = L.slice(2, cu_q[b], cu_q[b + 1]);
      if (c.alibi == 2) {  // row b of the [sequences, Hq] slopes, as [Hq]
        TensorView row = slopes.view().slice(0, int64_t(b), int64_t(b) + 1);
        row.ndim = 1;
        row.sizes[0] = c.Hq;
        row.strides[0] = slopes.view().stride(1);
        opt.alibi_slopes = row;
      }
      attention_forward(qs(Q), ks(K), ks(V), qs(O), lse_b, opt);
      if (!with_backward) continue;
      attention_backward(qs(Q), ks(K), ks(V), qs(O), lse_b, qs(dO), qs(dQ), ks(dK), ks(dV), opt);
      for (int64_t h = 0; h < (c.sink ? c.Hq : 0); ++h) dsink.view().ptr<float>()[h] += dsink_b.view().ptr<float>()[h];
    }
  }
  // The varlen calls on device copies (rows as far apart as here, outputs poisoned), results copied back.
  void run_varlen_on_device(const AttentionOptions& opt, bool device_offsets, bool with_backward = true);
};

void Pack::run_varlen_on_device(const AttentionOptions& opt, bool device_offsets, bool with_backward) {
  auto to_dev = [](const Rows& host) {
    Rows d;
    const TensorView& s = host.storage.view();
    d.storage = Tensor::empty(std::span<const int64_t>(s.sizes.data(), 3), s.dtype, Device::cuda);
    copy_into(d.storage.view(), s);
    d.view = host.view;
    d.view.device = Device::cuda;
    d.view.data = d.storage.data();
    return d;
  };
  Rows Q = to_dev(q), K = to_dev(k), V = to_dev(v), O = to_dev(o), dO = to_dev(dout);
  Rows dQ = to_dev(dq), dK = to_dev(dk), dV = to_dev(dv);
  Tensor L = Tensor::empty({lse.view().size(0), lse.view().size(1)}, DType::f32, Device::cuda);
  copy_into(L.view(), lse.view());
  VarlenSequences s = seqs();
  // Device storage for the int32 offsets (an fp32 tensor of as many 4-byte elements), copied byte for byte.
  Tensor cq = Tensor::empty({static_cast<int64_t>(cu_q.size())}, DType::f32, Device::cuda);
  Tensor ck = Tensor::empty({static_cast<int64_t>(cu_k.size())}, DType::f32, Device::cuda);
  if (device_offsets) {
    cuda_copy(cq.data(), cu_q.data(), cu_q.size() * sizeof(int32_t));
    cuda_copy(ck.data(), cu_k.data(), cu_k.size() * sizeof(int32_t));
    s.cu_seqlens_q = static_cast<const int32_t*>(cq.data());
    s.cu_seqlens_k = static_cast<const int32_t*>(ck.data());
    s.device = Device::cuda;
  }
  // The slopes, sinks and dsink (host views in `opt`) go to the device too, dsink with its poison, and back.
  AttentionOptions dev_opt = opt;
  auto to_device_vector = [](const TensorView& host) {
    Tensor d = Tensor::empty(std::span<const int64_t>(host.sizes.data(), static_cast<size_t>(host.ndim)), host.dtype,
                             Device::cuda);
    copy_into(d.view(), host);
    return d;
  };
  Tensor d_slopes, d_sinks, d_dsink;
  if (given(opt.alibi_slopes)) {
    d_slopes = to_device_vector(opt.alibi_slopes);
    dev_opt.alibi_slopes = d_slopes.view();
  }
  if (given(opt.learnable_sink)) {
    d_sinks = to_device_vector(opt.learnable_sink);
    dev_opt.learnable_sink = d_sinks.view();
  }
  if (given(opt.dlearnable_sink)) {
    d_dsink = to_device_vector(opt.dlearnable_sink);
    dev_opt.dlearnable_sink = d_dsink.view();
  }
  attention_varlen_forward(Q.view, K.view, V.view, O.view, L, s, dev_opt);
  if (with_backward) {
    attention_varlen_backward(Q.view, K.view, V.view, O.view, L, dO.view, dQ.view, dK.view, dV.view, s, dev_opt);
  }
  for (auto [host, dev] : {std::pair{&o, &O}, {&dq, &dQ}, {&dk, &dK}, {&dv, &dV}}) {
    copy_into(host->storage.view(), dev->storage.view());
  }
  copy_into(lse.view(), L.view());
  if (given(opt.dlearnable_sink)) copy_into(opt.dlearnable_sink, d_dsink.view());
}

// The outputs of `got` against the oracle `ref`, with the tolerance of the low-precision rule from `lowp`
// (the naive attention with got's storage dtype), plus `roundoffs` unit roundoffs of the dtype times the
// result's scale (for a 16-bit CUDA flash result measured against the CPU's naive attention, whose only error
// is the rounding of its outputs, the kernels' 16-bit P and dS in their GEMMs). with_backward false: o and lse.
void expect_close(const Pack& got, const Pack& ref, const Pack& lowp, const VarlenCase& c, const std::string& what,
                  double roundoffs = 0, bool with_backward = true) {
  struct Item {
    const char* name;
    const TensorView &got, &want, &lowp;
  };
  for (const Item& t : {Item{"o", got.o.view, ref.o.view, lowp.o.view}, Item{"dq", got.dq.view, ref.dq.view, lowp.dq.view},
                        Item{"dk", got.dk.view, ref.dk.view, lowp.dk.view},
                        Item{"dv", got.dv.view, ref.dv.view, lowp.dv.view}}) {
    if (!with_backward && std::string_view(t.name) != "o") continue;
    const double err = max_abs_diff(t.got, t.want);
    const double scale = std::max(1.0, max_abs(t.want));
    const double unit_roundoff = c.dtype == DType::bf16 ? 1.0 / 256 : 1.0 / 2048;
    const double tol = c.dtype == DType::f32
                           ? 1e-4 * scale
                           : tolerance(c.dtype, max_abs_diff(t.lowp, t.want), scale) + roundoffs * unit_roundoff * scale;
    EXPECT_LE(err, tol) << what << " " << t.name << " of " << varlen_case_name(c) << " (max |ref| " << max_abs(t.want)
                        << ")";
  }
  if (c.sink && with_backward) {
    // As in expect_flash_matches_oracle: the flash backward's Delta = dO · O reads the stored O (rounded to the
    // dtype), the naive one derives it from fp64 P, so fp16 / bf16 allow eps · Σ_i P_sink,i Σ_d |dO_id O_id| more.
    const double eps = c.dtype == DType::bf16 ? 0x1p-8 : c.dtype == DType::f16 ? 0x1p-11 : 0.0;
    Tensor o = to_f64(ref.o.view), dout = to_f64(ref.dout.view), lse = to_f64(ref.lse);
    const int64_t total_q = ref.cu_q.back(), Dv = value_dim(c);
    for (int64_t h = 0; h < c.Hq; ++h) {
      const double sink = double(ref.sinks.view().ptr<float>()[h]);
      double rounding = 0;
      for (int64_t i = 0; i < total_q && eps > 0; ++i) {
        double sum = 0;
        for (int64_t d = 0; d < Dv; ++d) {
          sum += std::fabs(o.view().ptr<double>()[(i * c.Hq + h) * Dv + d] * dout.view().ptr<double>()[(i * c.Hq + h) * Dv + d]);
        }
        rounding += std::exp(sink - lse.view().ptr<double>()[h * total_q + i]) * sum;
      }
      const double want = ref.dsink.view().ptr<float>()[h], have = got.dsink.view().ptr<float>()[h];
      const double scale = std::max(1.0, std::fabs(want));
      const double tol = c.dtype == DType::f32 ? 1e-4 * scale
                                               : tolerance(c.dtype, std::fabs(lowp.dsink.view().ptr<float>()[h] - want),
                                                           scale) + 2 * eps * rounding;
      EXPECT_LE(std::fabs(have - want), tol) << what << " dsink[" << h << "] of " << varlen_case_name(c);
    }
  }
  Tensor a = to_f64(got.lse), b = to_f64(ref.lse);
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double x = a.view().ptr<double>()[i], y = b.view().ptr<double>()[i];
    if (std::isinf(y)) EXPECT_EQ(x, y) << what << " lse[" << i << "] of " << varlen_case_name(c);
    else EXPECT_NEAR(x, y, c.dtype == DType::f64 ? 1e-10 : 1e-3) << what << " lse[" << i << "] of " << varlen_case_name(c);
  }
}

// Exact zeros where the semantics fix them: o and dq of queries in a sequence without keys, dk and dv of
// keys in a sequence without queries; lse = -inf for those queries.
// (With sinks the lse of a query without keys is its head's sink: exactly on the CPU, within the fp32 rounding of
// the CUDA kernels' log2-domain round trip, sink · log2(e) · ln(2).)
void expect_empty_sequences_zero(const Pack& got, const VarlenCase& c, const std::string& what,
                                 bool with_backward = true) {
  Tensor o = to_f64(got.o.view), dq = to_f64(got.dq.view), dk = to_f64(got.dk.view), dv = to_f64(got.dv.view);
  Tensor lse = to_f64(got.lse);
  const int64_t total_q = got.cu_q.back(), Dv = value_dim(c);
  for (size_t b = 0; b < c.len_q.size(); ++b) {
    if (c.len_k[b] == 0) {
      for (int64_t i = got.cu_q[b] * c.Hq * Dv; i < got.cu_q[b + 1] * c.Hq * Dv; ++i) {
        ASSERT_EQ(o.view().ptr<double>()[i], 0.0) << what << " o of sequence " << b << " (no keys)";
      }
      for (int64_t i = got.cu_q[b] * c.Hq * c.D; i < (with_backward ? got.cu_q[b + 1] * c.Hq * c.D : 0); ++i) {
        ASSERT_EQ(dq.view().ptr<double>()[i], 0.0) << what << " dq of sequence " << b << " (no keys)";
      }
      for (int64_t h = 0; h < c.Hq; ++h) {
        const double want = c.sink ? double(got.sinks.view().ptr<float>()[h]) : -INFINITY;
        const double ulps = std::isinf(want) ? 0.0 : 4 * 0x1p-23 * std::max(1.0, std::fabs(want));
        for (int64_t i = got.cu_q[b]; i < got.cu_q[b + 1]; ++i) {
          const double x = lse.view().ptr<double>()[h * total_q + i];
          if (std::isinf(want)) {
            ASSERT_EQ(x, want) << what << " lse of sequence " << b;
          } else {
            ASSERT_NEAR(x, want, ulps) << what << " lse of sequence " << b;
          }
        }
      }
    }
    if (c.len_q[b] == 0 && with_backward) {
      for (int64_t i = got.cu_k[b] * c.Hk * c.D; i < got.cu_k[b + 1] * c.Hk * c.D; ++i) {
        ASSERT_EQ(dk.view().ptr<double>()[i], 0.0) << what << " dk of sequence " << b << " (no queries)";
      }
      for (int64_t i = got.cu_k[b] * c.Hk * Dv; i < got.cu_k[b + 1] * c.Hk * Dv; ++i) {
        ASSERT_EQ(dv.view().ptr<double>()[i], 0.0) << what << " dv of sequence " << b << " (no queries)";
      }
    }
  }
}

std::vector<VarlenCase> cpu_grid() {
  std::vector<VarlenCase> cases;
  const std::vector<int32_t> self{1, 17, 1000, 0, 64, 3};
  for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
    cases.push_back({self, self, 4, 2, 64, m, DType::f32, m == Mask::top_left});
  }
  // Cross attention: len_q != len_k per sequence, sequences without keys or without queries.
  const std::vector<int32_t> cq{5, 0, 130, 17, 9}, ck{9, 40, 0, 17, 200};
  for (Mask m : {Mask::top_left, Mask::bottom_right}) {
    for (DType dt : {DType::bf16, DType::f16}) cases.push_back({cq, ck, 6, 2, 32, m, dt, dt == DType::bf16});
  }
  cases.push_back({cq, ck, 2, 1, 16, Mask::bottom_right, DType::f64, true});
  // Runs of equal lengths (one batched problem each, a strided batch in the pack), empty ones among them.
  const std::vector<int32_t> rq{17, 17, 17, 5, 5, 0, 0, 64, 64}, rk{17, 17, 17, 9, 9, 3, 3, 0, 0};
  for (Mask m : {Mask::top_left, Mask::bottom_right}) cases.push_back({rq, rk, 4, 2, 32, m, DType::bf16, m == Mask::top_left});
  cases.push_back({{}, {}, 2, 2, 16, Mask::none, DType::f32, false});  // no sequences at all
  cases.push_back({{0, 0}, {0, 5}, 2, 2, 16, Mask::top_left, DType::f32, false});
  // Sliding window and soft-capping per sequence (each with its own bottom-right offset), rows the window
  // leaves empty among them.
  cases.push_back({cq, ck, 4, 2, 32, Mask::bottom_right, DType::f32, true, false, 6, -1, 2.0});
  cases.push_back({cq, ck, 4, 2, 32, Mask::none, DType::bf16, false, false, 3, 4});
  cases.push_back({self, self, 2, 1, 64, Mask::top_left, DType::f32, false, false, 100, -1, 30.0});
  // ALiBi ([Hq] and per sequence), sinks (summed over the sequences) and d_v != d_qk, per sequence with its own
  // offset, sequences without keys or queries among them.
  cases.push_back({cq, ck, 4, 2, 32, Mask::bottom_right, DType::f32, true, false, -1, -1, 0, 0, 1, false});
  cases.push_back({cq, ck, 4, 2, 32, Mask::none, DType::f32, false, false, -1, -1, 0, 0, 2, false});
  cases.push_back({cq, ck, 4, 2, 32, Mask::top_left, DType::f32, false, false, -1, -1, 0, 0, 0, true});
  cases.push_back({cq, ck, 4, 2, 48, Mask::bottom_right, DType::f32, true, false, -1, -1, 0, 16, 0, false});
  cases.push_back({rq, rk, 4, 2, 32, Mask::bottom_right, DType::bf16, false, false, 6, -1, 2.0, 64, 2, true});
  cases.push_back({self, self, 2, 1, 64, Mask::top_left, DType::f32, false, false, 100, -1, 30.0, 32, 2, true});
  return cases;
}

class VarlenCpuVsReference : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCpuVsReference, ForwardAndBackwardMatchPerSequenceReference) {
  const VarlenCase c = GetParam();
  Pack ours(c, c.dtype, 4200 + c.len_q.size(), c.padded_rows);
  Pack naive_lowp(ours, c, c.dtype);
  Pack ref(ours, c, DType::f64);
  ours.run_varlen(ours.options(c, AttentionImpl::flash));
  naive_lowp.run_varlen(naive_lowp.options(c, AttentionImpl::naive));
  ref.run_per_sequence_reference(c);
  expect_close(ours, ref, naive_lowp, c, "cpu flash");
  expect_close(naive_lowp, ref, naive_lowp, c, "cpu naive");
  expect_empty_sequences_zero(ours, c, "cpu flash");
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenCpuVsReference, ::testing::ValuesIn(cpu_grid()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) {
                           return varlen_case_name(info.param);
                         });

// A causal sequence packed next to others sees only its own keys: the same sequence alone gives the same
// bits (the CPU kernels' sums do not depend on what is packed around them).
TEST(VarlenCpu, SequenceResultsDoNotDependOnItsNeighbours) {
  const VarlenCase packed{{40, 70, 25}, {40, 70, 25}, 2, 2, 32, Mask::top_left, DType::f32, false};
  const VarlenCase alone{{70}, {70}, 2, 2, 32, Mask::top_left, DType::f32, false};
  Pack a(packed, DType::f32, 5, false), s(alone, DType::f32, 6, false);
  copy_into(s.q.view, a.q.view.slice(0, 40, 110));
  copy_into(s.k.view, a.k.view.slice(0, 40, 110));
  copy_into(s.v.view, a.v.view.slice(0, 40, 110));
  copy_into(s.dout.view, a.dout.view.slice(0, 40, 110));
  const AttentionOptions opt = options_for(Mask::top_left, AttentionImpl::flash);
  a.run_varlen(opt);
  s.run_varlen(opt);
  EXPECT_EQ(max_abs_diff(a.o.view.slice(0, 40, 110), s.o.view), 0.0);
  EXPECT_EQ(max_abs_diff(a.dq.view.slice(0, 40, 110), s.dq.view), 0.0);
  EXPECT_EQ(max_abs_diff(a.dk.view.slice(0, 40, 110), s.dk.view), 0.0);
}

std::vector<VarlenCase> gpu_grid() {
  std::vector<VarlenCase> cases;
  const std::vector<int32_t> self{1, 17, 1000, 0, 64, 3, 300};
  const std::vector<int32_t> cq{5, 0, 130, 17, 9, 700}, ck{9, 40, 0, 17, 200, 513};
  int n = 0;
  for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      cases.push_back({self, self, 4, 2, 64, m, dt, n % 2 == 1, n % 3 == 2});
      cases.push_back({cq, ck, 4, 1, 128, m, dt, n % 2 == 0, n % 3 == 1});  // head dim 128: the Hopper forward
      ++n;
    }
    cases.push_back({cq, ck, 2, 2, 64, m, DType::f32, true});
    cases.push_back({self, self, 2, 1, 80, m, DType::bf16, false});  // head dim 80: the padded path
    // Runs of equal lengths, each one batched launch.
    cases.push_back({{17, 17, 17, 130, 130, 0, 0, 64, 64}, {17, 17, 17, 129, 129, 3, 3, 0, 0}, 4, 2, 128, m,
                     DType::bf16, m != Mask::none});
  }
  return cases;
}

class VarlenCudaVsReference : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCudaVsReference, FlashAndNaiveMatchPerSequenceReference) {
  SKIP_WITHOUT_GPU();
  const VarlenCase c = GetParam();
  AttentionOptions flash = options_for(c.mask, AttentionImpl::flash);
  flash.deterministic = c.deterministic;
  for (bool device_offsets : {false, true}) {
    Pack ours(c, c.dtype, 900 + c.len_q.size(), c.padded_rows);
    Pack baseline(ours, c, c.dtype);
    Pack ref(ours, c, DType::f64);
    ours.run_varlen_on_device(flash, device_offsets);
    baseline.run_varlen_on_device(options_for(c.mask, AttentionImpl::naive), device_offsets);
    ref.run_per_sequence_reference(c);
    const std::string what = device_offsets ? "cuda flash (device offsets)" : "cuda flash (host offsets)";
    expect_close(ours, ref, baseline, c, what);
    expect_empty_sequences_zero(ours, c, what);
    expect_empty_sequences_zero(baseline, c, "cuda naive");
  }
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenCudaVsReference, ::testing::ValuesIn(gpu_grid()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) {
                           return varlen_case_name(info.param);
                         });

// Sliding window and soft-capping on packed sequences, on the CUDA 16-bit flash kernels (the Hopper ones where
// they cover the problem, and the mma.sync ones forced by FLASHLM_ATTENTION_KERNEL=mma, in both backward
// modes): each sequence with its own band and bottom-right offset, rows the window leaves empty, sequences
// without keys or queries, GQA, head dims 64, 128 and 256 and the pair (192, 128), bf16 and fp16, against the
// per-sequence fp64 reference (the CUDA naive kernels have no band: the CPU's naive attention in the 16-bit
// dtype is the low-precision baseline).
std::vector<VarlenCase> band_gpu_grid() {
  std::vector<VarlenCase> cases;
  const std::vector<int32_t> self{1, 17, 1000, 0, 64, 3, 300};
  const std::vector<int32_t> cq{5, 0, 130, 17, 9, 700}, ck{9, 40, 0, 17, 200, 513};
  int n = 0;
  for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      const int64_t d = n % 2 ? 128 : 64;
      cases.push_back({self, self, 4, 2, d, m, dt, n % 2 == 1, n % 3 == 2, 100, m == Mask::none ? 20 : -1});
      cases.push_back({cq, ck, 4, 1, 192 - d, m, dt, n % 2 == 0, n % 3 == 1, 6, 3, n % 2 ? 30.0 : 0.0});
      cases.push_back({cq, ck, 6, 2, d, m, dt, false, false, -1, -1, 20.0});
      ++n;
    }
  }
  // Head dim 256 and the pair (192, 128): the Hopper backward's wide-head kernel (the pair unpadded), with and
  // without a band, and mma.sync on padded copies.
  cases.push_back({cq, ck, 4, 2, 256, Mask::top_left, DType::bf16, false, false, 100, -1, 20.0});
  cases.push_back({self, self, 4, 2, 256, Mask::bottom_right, DType::f16, true, false});
  cases.push_back({cq, ck, 4, 1, 192, Mask::bottom_right, DType::f16, true, false, 64, -1, 0, 128});
  cases.push_back({self, self, 4, 2, 192, Mask::none, DType::bf16, false, false, -1, -1, 0, 128});
  // Runs of equal lengths (one batched launch each) with a window across tiles.
  cases.push_back({{17, 17, 17, 130, 130, 0, 0, 300, 300}, {17, 17, 17, 129, 129, 3, 3, 0, 290}, 4, 2, 128,
                   Mask::bottom_right, DType::bf16, true, false, 64, -1});
  return cases;
}

class VarlenCudaBandVsReference : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCudaBandVsReference, FlashMatchesPerSequenceReference) {
  SKIP_WITHOUT_GPU();
  const VarlenCase c = GetParam();
  AttentionOptions flash = varlen_options(c, AttentionImpl::flash);
  flash.deterministic = c.deterministic;
  for (const char* family : {"auto", "mma"}) {
    if (c.deterministic && std::string(family) == "auto") continue;  // the deterministic backward is mma.sync's
    Pack ours(c, c.dtype, 1900 + c.len_q.size(), c.padded_rows);
    Pack lowp(ours, c, c.dtype);
    Pack ref(ours, c, DType::f64);
    with_kernel_choice(family, [&] { ours.run_varlen_on_device(flash, c.len_q.size() % 2 == 1); });
    lowp.run_varlen(varlen_options(c, AttentionImpl::naive));
    ref.run_per_sequence_reference(c);
    const std::string what = std::string("cuda flash (") + family + ")";
    expect_close(ours, ref, lowp, c, what, 4);
    expect_empty_sequences_zero(ours, c, what);
  }
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenCudaBandVsReference, ::testing::ValuesIn(band_gpu_grid()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) {
                           return varlen_case_name(info.param);
                         });

// ALiBi and sinks on packed sequences, on the mma.sync kernels (the Hopper ones decline them), against the
// per-sequence fp64 reference, dsink included (summed over every run of sequences): slopes [Hq] and
// [sequences, Hq], sequences without keys (o = 0, lse = the sink) or queries, runs of equal lengths, GQA, with a
// window and softcap, both backward modes.
std::vector<VarlenCase> alibi_sink_gpu_grid() {
  std::vector<VarlenCase> cases;
  const std::vector<int32_t> self{1, 17, 1000, 0, 64, 3, 300};
  const std::vector<int32_t> cq{5, 0, 130, 17, 9, 700}, ck{9, 40, 0, 17, 200, 513};
  int n = 0;
  for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      const int64_t d = n % 2 ? 128 : 64;
      cases.push_back({self, self, 8, 2, d, m, dt, n % 2 == 1, n % 3 == 2, -1, -1, 0, 0, 1 + n % 2, true});
      cases.push_back({cq, ck, 4, 1, 192 - d, m, dt, n % 2 == 0, n % 3 == 1, 6, 3, n % 2 ? 30.0 : 0.0, 0, 2, true});
      cases.push_back({cq, ck, 6, 2, d, m, dt, false, false, -1, -1, 0, 0, 1, false});
      cases.push_back({cq, ck, 6, 2, d, m, dt, false, true, -1, -1, 20.0, 0, 0, true});
      ++n;
    }
  }
  cases.push_back({{17, 17, 17, 130, 130, 0, 0, 300, 300}, {17, 17, 17, 129, 129, 3, 3, 0, 290}, 4, 2, 128,
                   Mask::bottom_right, DType::bf16, true, false, 64, -1, 0, 0, 2, true});
  return cases;
}

class VarlenCudaAlibiSinkVsReference : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCudaAlibiSinkVsReference, MmaSyncMatchesPerSequenceReference) {
  SKIP_WITHOUT_GPU();
  const VarlenCase c = GetParam();
  const HopperAlibiSinkRoute route(false);  // FLASHLM_HOPPER_ALIBI_SINK=0: "auto" lands on mma.sync
  Pack ours(c, c.dtype, 2900 + c.len_q.size(), c.padded_rows);
  Pack lowp(ours, c, c.dtype);
  Pack ref(ours, c, DType::f64);
  AttentionOptions flash = ours.options(c, AttentionImpl::flash);
  flash.deterministic = c.deterministic;
  ours.run_varlen_on_device(flash, c.len_q.size() % 2 == 1);
  lowp.run_varlen(lowp.options(c, AttentionImpl::naive));
  ref.run_per_sequence_reference(c);
  expect_close(ours, ref, lowp, c, "cuda flash (mma.sync)", 4);
  expect_empty_sequences_zero(ours, c, "cuda flash (mma.sync)");
}

// The same packs with the Hopper route on (hopper_alibi_sink_route): each run of sequences takes the Hopper
// kernels' ALiBi / sink instantiations at head dims 64 and 128 (the deterministic backward stays on mma.sync),
// dlearnable_sink summed over the runs by the shared backward host code.
TEST_P(VarlenCudaAlibiSinkVsReference, HopperMatchesPerSequenceReference) {
  SKIP_WITHOUT_HOPPER();
  const VarlenCase c = GetParam();
  const HopperAlibiSinkRoute route(true);
  Pack ours(c, c.dtype, 2900 + c.len_q.size(), c.padded_rows);
  Pack lowp(ours, c, c.dtype);
  Pack ref(ours, c, DType::f64);
  AttentionOptions flash = ours.options(c, AttentionImpl::flash);
  flash.deterministic = c.deterministic;
  // "auto": a process-wide "mma" would keep the Hopper kernels out.
  with_kernel_choice("auto", [&] { ours.run_varlen_on_device(flash, c.len_q.size() % 2 == 1); });
  lowp.run_varlen(lowp.options(c, AttentionImpl::naive));
  ref.run_per_sequence_reference(c);
  expect_close(ours, ref, lowp, c, "cuda flash (hopper route)", 4);
  expect_empty_sequences_zero(ours, c, "cuda flash (hopper route)");
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenCudaAlibiSinkVsReference, ::testing::ValuesIn(alibi_sink_gpu_grid()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) {
                           return varlen_case_name(info.param);
                         });

// A head dim of v's own on packed sequences: (192, 128), the Hopper kernels' own pair (unpadded, the backward on
// the wide-head kernel), on an sm_90 GPU, each run of sequences one Hopper launch per pass; ragged packs with
// sequences without keys (o = 0, lse = -inf) or queries, every mask, GQA, bf16 and fp16, a window and
// soft-capping, ALiBi and sinks on the Hopper route; o, lse, dq, dk, dv (and dsink) against the per-sequence fp64
// reference.
std::vector<VarlenCase> head_dim_pair_gpu_grid() {
  std::vector<VarlenCase> cases;
  const std::vector<int32_t> self{1, 17, 1000, 0, 127, 3};
  const std::vector<int32_t> cq{5, 0, 130, 17, 9, 700}, ck{9, 40, 0, 17, 200, 513};
  int n = 0;
  for (Mask m : {Mask::none, Mask::top_left, Mask::bottom_right}) {
    const DType dt = n % 2 ? DType::bf16 : DType::f16;
    cases.push_back({self, self, 4, 2, 192, m, dt, n % 2 == 0, false, -1, -1, 0, 128});
    cases.push_back({cq, ck, 6, 2, 192, m, dt, n % 2 == 1, false, -1, -1, 0, 128});
    ++n;
  }
  cases.push_back({cq, ck, 4, 1, 192, Mask::bottom_right, DType::bf16, true, false, 50, -1, 30.0, 128});
  cases.push_back({cq, ck, 4, 2, 192, Mask::none, DType::f16, false, false, -1, -1, 0, 128, 2, true});
  // Runs of equal lengths, each one batched launch.
  cases.push_back({{17, 17, 17, 130, 130, 0, 0, 300, 300}, {17, 17, 17, 129, 129, 3, 3, 0, 290}, 4, 2, 192,
                   Mask::top_left, DType::bf16, true, false, -1, -1, 0, 128});
  return cases;
}

class VarlenCudaHeadDimPairVsReference : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCudaHeadDimPairVsReference, HopperMatchesPerSequenceReferenceInBothPasses) {
  SKIP_WITHOUT_HOPPER();
  const VarlenCase c = GetParam();
  const HopperAlibiSinkRoute route(true);
  Pack ours(c, c.dtype, 3900 + c.len_q.size(), c.padded_rows);
  Pack lowp(ours, c, c.dtype);
  Pack ref(ours, c, DType::f64);
  // "auto": a process-wide "mma" would keep the Hopper kernels out.
  with_kernel_choice("auto", [&] {
    ours.run_varlen_on_device(ours.options(c, AttentionImpl::flash), c.len_q.size() % 2 == 1);
  });
  lowp.run_varlen(lowp.options(c, AttentionImpl::naive));
  ref.run_per_sequence_reference(c);
  expect_close(ours, ref, lowp, c, "cuda flash (hopper, head dim pair)", 4);
  expect_empty_sequences_zero(ours, c, "cuda flash (hopper, head dim pair)");
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenCudaHeadDimPairVsReference, ::testing::ValuesIn(head_dim_pair_gpu_grid()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) {
                           return varlen_case_name(info.param);
                         });

// Head dims of v's own on packed sequences through the padded path in both passes, FLASHLM_ATTENTION_KERNEL=mma
// (each run of sequences pads its own views): the packs above at (192, 128), padded to 256, and pairs that pad
// one side only, (64, 128) and (128, 64), in both backward modes; o, lse, dq, dk, dv (and dsink) against the
// per-sequence fp64 reference.
std::vector<VarlenCase> padded_head_dim_pair_gpu_grid() {
  std::vector<VarlenCase> cases = head_dim_pair_gpu_grid();
  const std::vector<int32_t> cq{5, 0, 130, 17, 9, 700}, ck{9, 40, 0, 17, 200, 513};
  cases.push_back({cq, ck, 4, 2, 64, Mask::bottom_right, DType::bf16, true, true, -1, -1, 0, 128});
  cases.push_back({cq, ck, 6, 2, 128, Mask::top_left, DType::f16, false, false, -1, -1, 0, 64});
  cases.push_back({cq, ck, 4, 1, 192, Mask::none, DType::bf16, false, true, 40, 8, 0, 128, 1, true});
  return cases;
}

class VarlenCudaPaddedHeadDimPairVsReference : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCudaPaddedHeadDimPairVsReference, MmaSyncMatchesPerSequenceReference) {
  SKIP_WITHOUT_GPU();
  const VarlenCase c = GetParam();
  Pack ours(c, c.dtype, 4900 + c.len_q.size(), c.padded_rows);
  Pack lowp(ours, c, c.dtype);
  Pack ref(ours, c, DType::f64);
  AttentionOptions flash = ours.options(c, AttentionImpl::flash);
  flash.deterministic = c.deterministic;
  with_kernel_choice("mma", [&] { ours.run_varlen_on_device(flash, c.len_q.size() % 2 == 1); });
  lowp.run_varlen(lowp.options(c, AttentionImpl::naive));
  ref.run_per_sequence_reference(c);
  expect_close(ours, ref, lowp, c, "cuda flash (mma.sync, padded head dim pair)", 4);
  expect_empty_sequences_zero(ours, c, "cuda flash (mma.sync, padded head dim pair)");
}

INSTANTIATE_TEST_SUITE_P(Packs, VarlenCudaPaddedHeadDimPairVsReference,
                         ::testing::ValuesIn(padded_head_dim_pair_gpu_grid()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) {
                           return varlen_case_name(info.param);
                         });

struct VarlenArgs {
  VarlenCase c{{3, 5}, {4, 4}, 2, 1, 16, Mask::none, DType::f32, false};
  Pack p{c, DType::f32, 1, false};
  std::vector<int32_t> cu_q = p.cu_q, cu_k = p.cu_k;
  VarlenSequences s{cu_q.data(), cu_k.data(), 2, Device::cpu, 5, 4};
  TensorView Q = p.q.view, K = p.k.view, O = p.o.view, L = p.lse.view();
  void forward() { attention_varlen_forward(Q, K, p.v.view, O, L, s); }
  void backward() {
    attention_varlen_backward(Q, K, p.v.view, O, L, p.dout.view, p.dq.view, p.dk.view, p.dv.view, s);
  }
};

TEST(VarlenErrors, BadOffsetsAreRefusedWithTheirName) {
  {
    VarlenArgs a;
    a.cu_q = {0, 5, 3};  // decreasing (and the last = total_q = 8 fails too; the decrease is found first)
    expect_error([&] { a.forward(); }, {"attention_varlen_forward", "cu_seqlens_q", "decrease at sequence 1"});
  }
  {
    VarlenArgs a;
    a.cu_k = {0, 4, 7};
    expect_error([&] { a.backward(); }, {"attention_varlen_backward", "cu_seqlens_k", "last offset is 7", "total_k"});
  }
  {
    VarlenArgs a;
    a.cu_q = {1, 3, 8};
    expect_error([&] { a.forward(); }, {"cu_seqlens_q", "must start at 0, got 1"});
  }
  {
    VarlenArgs a;
    a.s.max_seqlen_q = 4;  // sequence 1 has 5 queries
    expect_error([&] { a.forward(); }, {"cu_seqlens_q", "sequence 1 has length 5", "max_seqlen_q = 4"});
  }
  {
    VarlenArgs a;
    a.s.max_seqlen_k = -1;
    expect_error([&] { a.forward(); }, {"max_seqlen_k", "expected a length >= 0"});
  }
  {
    VarlenArgs a;
    a.s.cu_seqlens_k = nullptr;
    expect_error([&] { a.forward(); }, {"cu_seqlens_k", "null pointer"});
  }
  {
    VarlenArgs a;
    a.s.batch = -1;
    expect_error([&] { a.forward(); }, {"batch", "got -1"});
  }
  {
    VarlenArgs a;
    a.s.batch = 1;  // two offsets: the last (3) is not total_q
    expect_error([&] { a.forward(); }, {"cu_seqlens_q", "last offset is 3"});
  }
  {
    VarlenArgs a;
    a.s.device = Device::cuda;
    expect_error([&] { a.forward(); }, {"cu_seqlens_q", "offsets in cuda memory for tensors on the cpu"});
  }
}

TEST(VarlenErrors, BadTensorsAreRefusedWithTheirName) {
  {
    VarlenArgs a;
    Tensor q4 = Tensor::empty({1, 8, 2, 16}, DType::f32);
    a.Q = q4;
    expect_error([&] { a.forward(); }, {"attention_varlen_forward", "q: expected 3 dimensions [total, heads, head_dim]"});
  }
  {
    VarlenArgs a;
    Tensor l = Tensor::empty({2, 7}, DType::f32);
    a.L = l;
    expect_error([&] { a.forward(); }, {"lse: expected shape [2, 8] (heads_q, total_q)"});
  }
  {
    VarlenArgs a;
    a.L = a.p.lse.view().slice(0, 0, 2);
    a.L.ndim = 3;  // [2, 8, 0]: not a [heads_q, total_q] view
    expect_error([&] { a.forward(); }, {"lse: expected 2 dimensions [heads_q, total_q]"});
  }
  {
    VarlenArgs a;
    a.O = a.Q;
    expect_error([&] { a.forward(); }, {"o: the output overlaps the input q"});
  }
  {
    // More rows than int32 offsets can address: refused before anything is read.
    // q: 2^31 rows, all of them one 16-element row of memory (stride 0), one head. The outputs may not
    // overlap themselves, so o and lse are views of 2^31 distinct rows at addresses no allocation of this
    // process reaches (2^46 bytes and up, below the heap): only their addresses are computed.
    VarlenArgs a;
    float cells[16] = {};
    a.Q.data = cells;
    a.Q.sizes = {int64_t{1} << 31, 1, 16};
    a.Q.strides = {0, 0, 1};
    a.O = a.Q;
    a.O.data = reinterpret_cast<void*>(uintptr_t{1} << 46);
    a.O.strides = {16, 16, 1};
    a.L.data = reinterpret_cast<void*>((uintptr_t{1} << 46) + (uintptr_t{1} << 40));
    a.L.sizes = {1, int64_t{1} << 31};
    a.L.strides = {int64_t{1} << 31, 1};
    expect_error([&] { a.forward(); }, {"total_q", "exceeds the int32 range"});
  }
}

}  // namespace
