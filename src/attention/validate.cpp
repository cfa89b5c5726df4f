#include <cmath>
#include <cstdint>
#include <algorithm>
#include <array>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "attention/problem.h"
#include "core/check.h"
#include "core/cuda_runtime.h"

namespace flashlm {

namespace {

void check_view(std::string_view fn, std::string_view name, const TensorView& t, int ndim, std::string_view dims) {
  FLASHLM_CHECK(t.ndim == ndim, "{}: {}: expected {} dimensions {}, got {}", fn, name, ndim, dims, t.shape_string());
  for (int d = 0; d < ndim; ++d) {
    FLASHLM_CHECK(t.size(d) >= 0, "{}: {}: negative size in dimension {} of {}", fn, name, d, t.shape_string());
    FLASHLM_CHECK(t.stride(d) >= 0, "{}: {}: negative stride {} in dimension {}", fn, name, t.stride(d), d);
  }
  FLASHLM_CHECK(t.data != nullptr || t.numel() == 0, "{}: {}: null data pointer for {}", fn, name, t.shape_string());
}

void check_qkv_like(std::string_view fn, std::string_view name, const TensorView& t) {
  check_view(fn, name, t, 4, "[batch, seq, heads, head_dim]");
  FLASHLM_CHECK(t.stride(3) == 1 || t.size(3) <= 1,
                "{}: {}: the head_dim dimension must have stride 1 (got stride {}); make the last dimension "
                "contiguous",
                fn, name, t.stride(3));
}

void check_same_shape(std::string_view fn, std::string_view name, const TensorView& t, std::string_view ref_name,
                      const TensorView& ref) {
  bool same = t.ndim == ref.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.size(d) == ref.size(d);
  FLASHLM_CHECK(same, "{}: {}: expected the shape of {} {}, got {}", fn, name, ref_name, ref.shape_string(),
                t.shape_string());
}

void check_same_device(std::string_view fn, std::string_view name, const TensorView& t, const TensorView& q) {
  FLASHLM_CHECK(t.device == q.device, "{}: {}: on {} but q is on {}", fn, name, device_name(t.device),
                device_name(q.device));
}

void check_same_kind(std::string_view fn, std::string_view name, const TensorView& t, const TensorView& q) {
  FLASHLM_CHECK(t.dtype == q.dtype, "{}: {}: dtype {} differs from q's {}", fn, name, dtype_name(t.dtype),
                dtype_name(q.dtype));
  check_same_device(fn, name, t, q);
}

// The bytes a view may touch, [begin, end); empty for a view without elements (or an option's view left
// empty: no data). Strides are >= 0 here (check_view), so the last element lies at the sum of (size - 1) * stride.
std::pair<uintptr_t, uintptr_t> byte_range(std::string_view name, const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) last = checked_add(last, checked_mul(t.size(d) - 1, t.stride(d), name), name);
  const int64_t bytes = checked_mul(last + 1, static_cast<int64_t>(dtype_size(t.dtype)), name);
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + static_cast<uintptr_t>(bytes)};
}

using NamedView = std::pair<std::string_view, const TensorView*>;

// An output written while an input is still read gives a wrong result, silently: every output's bytes must
// be apart from every input's. (A conservative test on the spans: an output interleaved with an input
// without sharing elements is refused too.)
void check_outputs_apart(std::string_view fn, std::initializer_list<NamedView> outputs,
                         std::initializer_list<NamedView> inputs) {
  for (const auto& [out_name, out] : outputs) {
    const auto [ob, oe] = byte_range(out_name, *out);
    for (const auto& [in_name, in] : inputs) {
      const auto [ib, ie] = byte_range(in_name, *in);
      FLASHLM_CHECK(ob == oe || ib == ie || oe <= ib || ie <= ob,
                    "{}: {}: the output overlaps the input {} (bytes [{:#x}, {:#x}) and [{:#x}, {:#x})); outputs "
                    "must not share memory with inputs",
                    fn, out_name, in_name, ob, oe, ib, ie);
    }
  }
}

// Every element of an output must be its own memory, or the kernels' writes of distinct elements race and
// the result is whichever landed last (a zero sequence stride makes every row write the same bytes). A
// sufficient test, as torch's has_internal_overlap is: with the dimensions longer than 1 ordered by stride,
// each stride must exceed the span of the dimensions below it. Views that interleave without sharing
// elements are refused too; no layout the kernels write (row-major in any dimension order) is.
void check_no_internal_overlap(std::string_view fn, std::string_view name, const TensorView& t) {
  if (t.numel() == 0) return;
  std::array<int, kMaxDims> dims{};  // the dimensions longer than 1, by ascending stride (insertion sort)
  int n = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.size(d) <= 1) continue;
    int i = n++;
    for (; i > 0 && t.stride(dims[static_cast<size_t>(i - 1)]) > t.stride(d); --i) {
      dims[static_cast<size_t>(i)] = dims[static_cast<size_t>(i - 1)];
    }
    dims[static_cast<size_t>(i)] = d;
  }
  int64_t span = 0;  // the largest element offset the dimensions so far reach
  for (int i = 0; i < n; ++i) {
    const int d = dims[static_cast<size_t>(i)];
    FLASHLM_CHECK(t.stride(d) > span,
                  "{}: {}: the output overlaps itself: dimension {} (size {}, stride {}) revisits elements that "
                  "the dimensions of smaller strides reach (shape {}); every element of an output needs its own "
                  "memory",
                  fn, name, d, t.size(d), t.stride(d), t.shape_string());
    span = checked_add(span, checked_mul(t.size(d) - 1, t.stride(d), name), name);
  }
}

// t's shape with its last dimension `d` (o and dout: q's shape with v's head dim).
TensorView with_head_dim(const TensorView& t, int64_t d) {
  TensorView out = t;
  out.sizes[static_cast<size_t>(t.ndim - 1)] = d;
  return out;
}

bool given(const TensorView& t) { return t.ndim != 0 || t.data != nullptr; }

// A per-head fp32 vector or matrix on q's device (the ALiBi slopes, the sinks and the sink's gradient).
void check_fp32_on(std::string_view fn, std::string_view name, const TensorView& t, const AttentionProblem& p) {
  FLASHLM_CHECK(t.dtype == DType::f32, "{}: {}: expected dtype fp32, got {}", fn, name, dtype_name(t.dtype));
  FLASHLM_CHECK(t.device == p.device, "{}: {}: on {} but q is on {}", fn, name, device_name(t.device),
                device_name(p.device));
}

// ALiBi slopes: [heads_q] or [sequences, heads_q] (flash-attn's alibi_slopes), fp32, finite where they can be
// read here (cpu; a CUDA problem's slopes are device memory, never read on the host).
void describe_alibi(std::string_view fn, const TensorView& slopes, int64_t sequences, AttentionProblem& p) {
  if (!given(slopes)) return;
  FLASHLM_CHECK(slopes.ndim == 1 || slopes.ndim == 2,
                "{}: alibi_slopes: expected [heads_q] or [batch, heads_q] = [{}] or [{}, {}], got {}", fn, p.heads_q,
                sequences, p.heads_q, slopes.shape_string());
  check_view(fn, "alibi_slopes", slopes, slopes.ndim, "[heads_q] or [batch, heads_q]");
  const bool per_batch = slopes.ndim == 2;
  FLASHLM_CHECK(slopes.size(slopes.ndim - 1) == p.heads_q && (!per_batch || slopes.size(0) == sequences),
                "{}: alibi_slopes: expected [heads_q] or [batch, heads_q] = [{}] or [{}, {}], got {}", fn, p.heads_q,
                sequences, p.heads_q, slopes.shape_string());
  check_fp32_on(fn, "alibi_slopes", slopes, p);
  p.alibi = true;
  p.alibi_slopes = slopes.ptr<const float>();
  p.alibi_batch_stride = per_batch ? slopes.stride(0) : 0;
  p.alibi_head_stride = slopes.stride(slopes.ndim - 1);
  if (p.device != Device::cpu) return;
  for (int64_t b = 0; b < (per_batch ? sequences : 1); ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const float s = p.alibi_slopes[b * p.alibi_batch_stride + h * p.alibi_head_stride];
      FLASHLM_CHECK(std::isfinite(s), "{}: alibi_slopes: slope of batch {} head {} is {}; expected a finite number",
                    fn, b, h, s);
    }
  }
}

// Sinks: [heads_q] fp32, each finite or -inf (no sink for that head); NaN and +inf are refused where they can
// be read here (cpu; a CUDA problem's sinks are device memory, never read on the host).
void describe_sink(std::string_view fn, const TensorView& sink, AttentionProblem& p) {
  if (!given(sink)) return;
  check_view(fn, "learnable_sink", sink, 1, "[heads_q]");
  FLASHLM_CHECK(sink.size(0) == p.heads_q, "{}: learnable_sink: expected shape [{}] (heads_q), got {}", fn, p.heads_q,
                sink.shape_string());
  check_fp32_on(fn, "learnable_sink", sink, p);
  p.sink = true;
  p.learnable_sink = sink.ptr<const float>();
  p.sink_stride = sink.stride(0);
  if (p.device != Device::cpu) return;
  for (int64_t h = 0; h < p.heads_q; ++h) {
    const float s = p.learnable_sink[h * p.sink_stride];
    FLASHLM_CHECK(std::isfinite(s) || s == -std::numeric_limits<float>::infinity(),
                  "{}: learnable_sink: the sink of head {} is {}; expected a finite number or -inf (no sink)", fn, h,
                  s);
  }
}

// Per-head descales of fp8 inputs (AttentionOptions::*_descale_heads): fp32 [batch, heads_k] on q's device, in
// place of the tensor's scalar descale (which must stay 1), each finite and > 0 where it can be read here (cpu;
// a CUDA problem's are device memory, never read on the host).
void describe_head_descales(std::string_view fn, const TensorView& q, const AttentionOptions& options,
                            AttentionProblem& p) {
  struct Named {
    const char* name;
    const TensorView& t;
    float scalar;
    AttentionProblem::HeadDescales& out;
  };
  for (const Named& d : {Named{"q_descale_heads", options.q_descale_heads, options.q_descale, p.q_descale_heads},
                         Named{"k_descale_heads", options.k_descale_heads, options.k_descale, p.k_descale_heads},
                         Named{"v_descale_heads", options.v_descale_heads, options.v_descale, p.v_descale_heads}}) {
    if (!given(d.t)) continue;
    FLASHLM_CHECK(q.dtype == DType::f8e4m3, "{}: {}: descale factors apply to fp8_e4m3 inputs only (q is {})", fn,
                  d.name, dtype_name(q.dtype));
    check_view(fn, d.name, d.t, 2, "[batch, heads_k]");
    FLASHLM_CHECK(d.t.size(0) == p.batch && d.t.size(1) == p.heads_k,
                  "{}: {}: expected shape [{}, {}] (batch, heads_k), got {}", fn, d.name, p.batch, p.heads_k,
                  d.t.shape_string());
    check_fp32_on(fn, d.name, d.t, p);
    FLASHLM_CHECK(d.scalar == 1.0f, "{}: {}: given with the per-tensor descale {} (expected 1): one or the other", fn,
                  d.name, d.scalar);
    d.out = {d.t.ptr<const float>(), d.t.stride(0), d.t.stride(1)};
    if (p.device != Device::cpu) continue;
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t h = 0; h < p.heads_k; ++h) {
        const double x = d.out.at(b, h);
        FLASHLM_CHECK(std::isfinite(x) && x > 0, "{}: {}: the descale of batch {} head {} is {}; expected a finite "
                      "number > 0", fn, d.name, b, h, x);
      }
    }
  }
}

AttentionProblem describe(std::string_view fn, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& o, const TensorView& lse, const AttentionOptions& options,
                          int64_t sequences) {
  check_qkv_like(fn, "q", q);
  check_qkv_like(fn, "k", k);
  check_qkv_like(fn, "v", v);
  check_qkv_like(fn, "o", o);
  check_same_kind(fn, "k", k, q);
  check_same_kind(fn, "v", v, q);
  if (q.dtype == DType::f8e4m3) {
    // The FP8 forward writes bf16 (FlashAttention-3's choice: e4m3 keeps too few bits for an output).
    FLASHLM_CHECK(o.dtype == DType::bf16, "{}: o: expected dtype bf16 for fp8_e4m3 inputs, got {}", fn,
                  dtype_name(o.dtype));
    check_same_device(fn, "o", o, q);
  } else {
    check_same_kind(fn, "o", o, q);
  }

  AttentionProblem p;
  p.batch = q.size(0);
  p.seq_q = q.size(1);
  p.heads_q = q.size(2);
  p.head_dim = q.size(3);
  p.head_dim_v = v.size(3);
  p.seq_k = k.size(1);
  p.heads_k = k.size(2);
  p.dtype = q.dtype;
  p.device = q.device;
  FLASHLM_CHECK(k.size(0) == p.batch, "{}: k: batch {} differs from q's batch {}", fn, k.size(0), p.batch);
  FLASHLM_CHECK(k.size(3) == p.head_dim, "{}: k: head_dim {} differs from q's head_dim {}", fn, k.size(3),
                p.head_dim);
  // (After k's checks.) v matches k but for its head dim (head_dim_v may differ from head_dim); o takes q's shape with v's head dim.
  FLASHLM_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
                "{}: v: expected k's batch, seq_k and heads_k {} (any head_dim_v), got {}", fn, k.shape_string(),
                v.shape_string());
  check_same_shape(fn, "o", o, "q with v's head_dim_v", with_head_dim(q, v.size(3)));
  FLASHLM_CHECK(p.head_dim >= 1, "{}: q: head_dim must be at least 1, got {}", fn, p.head_dim);
  FLASHLM_CHECK(p.head_dim_v >= 1, "{}: v: head_dim_v must be at least 1, got {}", fn, p.head_dim_v);
  FLASHLM_CHECK(p.heads_k >= 1, "{}: k: heads_k must be at least 1, got {}", fn, p.heads_k);
  FLASHLM_CHECK(p.heads_q % p.heads_k == 0,
                "{}: q: heads_q = {} is not a multiple of k's heads_k = {} (GQA/MQA needs heads_q = n * heads_k)", fn,
                p.heads_q, p.heads_k);

  check_view(fn, "lse", lse, 3, "[batch, heads_q, seq_q]");
  FLASHLM_CHECK(lse.size(0) == p.batch && lse.size(1) == p.heads_q && lse.size(2) == p.seq_q,
                "{}: lse: expected shape [{}, {}, {}] (batch, heads_q, seq_q), got {}", fn, p.batch, p.heads_q,
                p.seq_q, lse.shape_string());
  FLASHLM_CHECK(lse.dtype == DType::f32 || (lse.dtype == DType::f64 && q.dtype == DType::f64),
                "{}: lse: expected dtype fp32{}, got {}", fn, q.dtype == DType::f64 ? " or fp64" : "",
                dtype_name(lse.dtype));
  FLASHLM_CHECK(lse.device == q.device, "{}: lse: on {} but q is on {}", fn, device_name(lse.device),
                device_name(q.device));

  p.scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  FLASHLM_CHECK(std::isfinite(p.scale), "{}: scale: expected a finite number, got {}", fn, p.scale);
  for (auto [name, d] : {std::pair{"q_descale", options.q_descale}, {"k_descale", options.k_descale},
                         {"v_descale", options.v_descale}}) {
    if (q.dtype == DType::f8e4m3) {
      FLASHLM_CHECK(std::isfinite(d) && d > 0, "{}: {}: expected a finite number > 0, got {}", fn, name, d);
    } else {
      FLASHLM_CHECK(d == 1.0f, "{}: {}: descale factors apply to fp8_e4m3 inputs only (q is {}); got {}", fn, name,
                    dtype_name(q.dtype), d);
    }
  }
  p.q_descale = options.q_descale;
  p.k_descale = options.k_descale;
  p.v_descale = options.v_descale;
  p.causal = options.causal;
  p.causal_offset = options.align == CausalAlign::bottom_right ? p.seq_k - p.seq_q : 0;
  for (auto [name, w] : {std::pair{"window_size_left", options.window_size_left},
                         {"window_size_right", options.window_size_right}}) {
    FLASHLM_CHECK(w >= -1, "{}: {}: expected -1 (unbounded) or a number of keys >= 0, got {}", fn, name, w);
  }
  p.window_left = options.window_size_left;
  p.window_right = options.causal ? 0 : options.window_size_right;
  FLASHLM_CHECK(std::isfinite(options.softcap) && options.softcap >= 0,
                "{}: softcap: expected a finite number >= 0 (0 is off), got {}", fn, options.softcap);
  p.softcap = options.softcap;
  describe_alibi(fn, options.alibi_slopes, sequences, p);
  describe_sink(fn, options.learnable_sink, p);
  describe_head_descales(fn, q, options, p);
  return p;
}

AttentionProblem check_forward(std::string_view fn, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& o, const TensorView& lse, const AttentionOptions& options,
                               int64_t sequences) {
  AttentionProblem p = describe(fn, q, k, v, o, lse, options, sequences);
  check_no_internal_overlap(fn, "o", o);
  check_no_internal_overlap(fn, "lse", lse);
  check_outputs_apart(fn, {{"o", &o}, {"lse", &lse}},
                      {{"q", &q},
                       {"k", &k},
                       {"v", &v},
                       {"alibi_slopes", &options.alibi_slopes},
                       {"learnable_sink", &options.learnable_sink},
                       {"q_descale_heads", &options.q_descale_heads},
                       {"k_descale_heads", &options.k_descale_heads},
                       {"v_descale_heads", &options.v_descale_heads}});
  check_outputs_apart(fn, {{"lse", &lse}}, {{"o", &o}});
  return p;
}

AttentionProblem check_backward(std::string_view fn, const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& o, const TensorView& lse, const TensorView& dout,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const AttentionOptions& options, int64_t sequences) {
  AttentionProblem p = describe(fn, q, k, v, o, lse, options, sequences);
  if (q.dtype == DType::f8e4m3) {
    // dout is the gradient of the bf16 o; dq, dk, dv are gradients of the dequantised values, which e4m3 holds
    // too coarsely (its 3 mantissa bits would lose most of a gradient), so they take bf16 or fp32, all one.
    check_qkv_like(fn, "dout", dout);
    FLASHLM_CHECK(dout.dtype == DType::bf16, "{}: dout: expected dtype bf16 (o's) for fp8_e4m3 inputs, got {}", fn,
                  dtype_name(dout.dtype));
    check_same_device(fn, "dout", dout, q);
    for (auto [name, t] : {std::pair{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
      check_qkv_like(fn, name, *t);
      FLASHLM_CHECK(t->dtype == DType::bf16 || t->dtype == DType::f32,
                    "{}: {}: expected dtype bf16 or fp32 for the gradients of fp8_e4m3 inputs, got {}", fn, name,
                    dtype_name(t->dtype));
      FLASHLM_CHECK(t->dtype == dq.dtype, "{}: {}: dtype {} differs from dq's {} (the gradients share one dtype)",
                    fn, name, dtype_name(t->dtype), dtype_name(dq.dtype));
      check_same_device(fn, name, *t, q);
    }
  } else {
    for (auto [name, t] : {std::pair{"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
      check_qkv_like(fn, name, *t);
      check_same_kind(fn, name, *t, q);
    }
  }
  check_same_shape(fn, "dout", dout, "o", o);
  check_same_shape(fn, "dq", dq, "q", q);
  check_same_shape(fn, "dk", dk, "k", k);
  check_same_shape(fn, "dv", dv, "v", v);
  for (auto [name, t] : {std::pair{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) check_no_internal_overlap(fn, name, *t);
  const TensorView& dsink = options.dlearnable_sink;
  if (given(dsink)) {
    FLASHLM_CHECK(p.sink, "{}: dlearnable_sink: given without learnable_sink (the gradient of which sink?)", fn);
    check_view(fn, "dlearnable_sink", dsink, 1, "[heads_q]");
    FLASHLM_CHECK(dsink.size(0) == p.heads_q, "{}: dlearnable_sink: expected shape [{}] (heads_q), got {}", fn,
                  p.heads_q, dsink.shape_string());
    check_fp32_on(fn, "dlearnable_sink", dsink, p);
    check_no_internal_overlap(fn, "dlearnable_sink", dsink);
    p.dlearnable_sink = dsink.ptr<float>();
    p.dsink_stride = dsink.stride(0);
  }
  check_outputs_apart(fn, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dlearnable_sink", &dsink}},
                      {{"q", &q},
                       {"k", &k},
                       {"v", &v},
                       {"o", &o},
                       {"lse", &lse},
                       {"dout", &dout},
                       {"alibi_slopes", &options.alibi_slopes},
                       {"learnable_sink", &options.learnable_sink},
                       {"q_descale_heads", &options.q_descale_heads},
                       {"k_descale_heads", &options.k_descale_heads},
                       {"v_descale_heads", &options.v_descale_heads}});
  if (given(dsink)) check_outputs_apart(fn, {{"dlearnable_sink", &dsink}}, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  return p;
}

// A packed [total, heads, head_dim] tensor as the [1, total, heads, head_dim] view the common checks and the
// backends take (and a [heads_q, total_q] lse as [1, heads_q, total_q]).
TensorView as_batch_of_one(std::string_view fn, std::string_view name, const TensorView& t, int ndim,
                           std::string_view dims) {
  FLASHLM_CHECK(t.ndim == ndim, "{}: {}: expected {} dimensions {}, got {}", fn, name, ndim, dims, t.shape_string());
  TensorView out = t;
  out.ndim = ndim + 1;
  for (int d = ndim; d > 0; --d) {
    out.sizes[static_cast<size_t>(d)] = t.size(d - 1);
    out.strides[static_cast<size_t>(d)] = t.stride(d - 1);
  }
  out.sizes[0] = 1;
  out.strides[0] = 0;
  return out;
}

TensorView packed_rows(std::string_view fn, std::string_view name, const TensorView& t) {
  return as_batch_of_one(fn, name, t, 3, "[total, heads, head_dim] (packed sequences)");
}

// lse [heads_q, total_q] of the 3-dimensional q, checked here so that the message names the varlen shape.
TensorView packed_lse(std::string_view fn, const TensorView& lse, const TensorView& q) {
  const TensorView out = as_batch_of_one(fn, "lse", lse, 2, "[heads_q, total_q]");
  FLASHLM_CHECK(lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                "{}: lse: expected shape [{}, {}] (heads_q, total_q), got {}", fn, q.size(1), q.size(0),
                lse.shape_string());
  return out;
}

// The host copy of one offsets array, checked: batch + 1 int32 entries from 0, non-decreasing, ending at
// `total`, no sequence longer than max_seqlen.
std::vector<int32_t> checked_offsets(std::string_view fn, std::string_view name, const int32_t* offsets,
                                     const VarlenSequences& seqs, Device tensors_device, int64_t total,
                                     std::string_view total_name, int64_t max_seqlen, std::string_view max_name,
                                     void* stream) {
  FLASHLM_CHECK(offsets != nullptr, "{}: {}: null pointer (expected batch + 1 = {} int32 offsets)", fn, name,
                seqs.batch + 1);
  FLASHLM_CHECK(total <= std::numeric_limits<int32_t>::max(),
                "{}: {}: {} = {} exceeds the int32 range of the offsets (at most {})", fn, name, total_name, total,
                std::numeric_limits<int32_t>::max());
  FLASHLM_CHECK(max_seqlen >= 0, "{}: {}: expected a length >= 0, got {}", fn, max_name, max_seqlen);
  std::vector<int32_t> host(static_cast<size_t>(seqs.batch + 1));
  if (seqs.device == Device::cuda) {
    FLASHLM_CHECK(tensors_device == Device::cuda, "{}: {}: offsets in cuda memory for tensors on the cpu", fn, name);
    FLASHLM_CHECK(cuda_pointer_device(offsets) == cuda_current_device(),
                  "{}: {}: the offsets are said to be on cuda but are not memory of the current device cuda:{}", fn,
                  name, cuda_current_device());
    cuda_copy_async(host.data(), offsets, host.size() * sizeof(int32_t), stream);
    cuda_stream_synchronize(stream);
  } else {
    std::copy(offsets, offsets + host.size(), host.begin());
  }
  FLASHLM_CHECK(host[0] == 0, "{}: {}: the offsets must start at 0, got {}", fn, name, host[0]);
  for (int64_t b = 0; b < seqs.batch; ++b) {
    const int64_t len = int64_t{host[static_cast<size_t>(b + 1)]} - host[static_cast<size_t>(b)];
    FLASHLM_CHECK(len >= 0, "{}: {}: the offsets decrease at sequence {} ({} then {}); they must be non-decreasing",
                  fn, name, b, host[static_cast<size_t>(b)], host[static_cast<size_t>(b + 1)]);
    FLASHLM_CHECK(len <= max_seqlen, "{}: {}: sequence {} has length {}, more than {} = {}", fn, name, b, len,
                  max_name, max_seqlen);
  }
  FLASHLM_CHECK(host.back() == total, "{}: {}: the last offset is {}, expected {} = {}", fn, name, host.back(),
                total_name, total);
  return host;
}

VarlenProblem describe_varlen(std::string_view fn, const TensorView& q, const TensorView& k, const VarlenSequences& seqs,
                              const AttentionOptions& options) {
  FLASHLM_CHECK(seqs.batch >= 0 && seqs.batch < std::numeric_limits<int32_t>::max(),
                "{}: batch: expected a number of sequences in [0, {}), got {}", fn,
                std::numeric_limits<int32_t>::max(), seqs.batch);
  VarlenProblem vp;
  vp.align = options.align;
  vp.cu_q = checked_offsets(fn, "cu_seqlens_q", seqs.cu_seqlens_q, seqs, q.device, q.size(0), "total_q (q's rows)",
                            seqs.max_seqlen_q, "max_seqlen_q", options.stream);
  vp.cu_k = checked_offsets(fn, "cu_seqlens_k", seqs.cu_seqlens_k, seqs, q.device, k.size(0), "total_k (k's rows)",
                            seqs.max_seqlen_k, "max_seqlen_k", options.stream);
  return vp;
}

}  // namespace

int64_t VarlenProblem::run_end(int64_t b) const {
  int64_t e = b + 1;
  while (e < batch() && len_q(e) == len_q(b) && len_k(e) == len_k(b)) ++e;
  return e;
}

AttentionProblem VarlenProblem::run(int64_t b, int64_t n) const {
  AttentionProblem p = packed;
  p.batch = n;
  p.seq_q = len_q(b);
  p.seq_k = len_k(b);
  p.causal_offset = align == CausalAlign::bottom_right ? p.seq_k - p.seq_q : 0;
  p.alibi_slopes = packed.alibi_slopes + (packed.alibi ? b * packed.alibi_batch_stride : 0);
  return p;
}

TensorView VarlenProblem::rows(const TensorView& t, int seq_dim, const std::vector<int32_t>& cu, int64_t b,
                               int64_t n) {
  const int64_t begin = cu[static_cast<size_t>(b)], length = cu[static_cast<size_t>(b + 1)] - begin;
  TensorView out = t.slice(seq_dim, begin, begin + length);
  out.sizes[0] = n;
  out.strides[0] = length * t.stride(seq_dim);
  return out;
}

AttentionProblem validate_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& o, const TensorView& lse,
                                            const AttentionOptions& options) {
  return check_forward("attention_forward", q, k, v, o, lse, options, q.size(0));
}

AttentionProblem validate_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const TensorView& o, const TensorView& lse, const TensorView& dout,
                                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                             const AttentionOptions& options) {
  return check_backward("attention_backward", q, k, v, o, lse, dout, dq, dk, dv, options, q.size(0));
}

VarlenProblem validate_attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                const TensorView& o, const TensorView& lse,
                                                const VarlenSequences& seqs, const AttentionOptions& options) {
  constexpr std::string_view fn = "attention_varlen_forward";
  FLASHLM_CHECK(q.dtype != DType::f8e4m3, "{}: q: dtype fp8_e4m3 is not supported for packed sequences", fn);
  const TensorView q1 = packed_rows(fn, "q", q), k1 = packed_rows(fn, "k", k), v1 = packed_rows(fn, "v", v);
  const TensorView o1 = packed_rows(fn, "o", o);
  const TensorView lse1 = packed_lse(fn, lse, q);
  const AttentionProblem packed = check_forward(fn, q1, k1, v1, o1, lse1, options, seqs.batch);
  VarlenProblem vp = describe_varlen(fn, q, k, seqs, options);
  vp.packed = packed;
  vp.q = q1, vp.k = k1, vp.v = v1, vp.o = o1, vp.lse = lse1;
  return vp;
}

VarlenProblem validate_attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                 const TensorView& o, const TensorView& lse, const TensorView& dout,
                                                 const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                                 const VarlenSequences& seqs, const AttentionOptions& options) {
  constexpr std::string_view fn = "attention_varlen_backward";
  FLASHLM_CHECK(q.dtype != DType::f8e4m3, "{}: q: dtype fp8_e4m3 is not supported for packed sequences", fn);
  const TensorView q1 = packed_rows(fn, "q", q), k1 = packed_rows(fn, "k", k), v1 = packed_rows(fn, "v", v);
  const TensorView o1 = packed_rows(fn, "o", o), dout1 = packed_rows(fn, "dout", dout);
  const TensorView dq1 = packed_rows(fn, "dq", dq), dk1 = packed_rows(fn, "dk", dk), dv1 = packed_rows(fn, "dv", dv);
  const TensorView lse1 = packed_lse(fn, lse, q);
  const AttentionProblem packed = check_backward(fn, q1, k1, v1, o1, lse1, dout1, dq1, dk1, dv1, options, seqs.batch);
  VarlenProblem vp = describe_varlen(fn, q, k, seqs, options);
  vp.packed = packed;
  vp.q = q1, vp.k = k1, vp.v = v1, vp.o = o1, vp.lse = lse1;
  vp.dout = dout1, vp.dq = dq1, vp.dk = dk1, vp.dv = dv1;
  return vp;
}

// flash_attention_with_kvcache: the cache's own checks, then the common ones (describe) on the
// [batch, 0, heads_k, head_dim] key view the cache stands for, so that the options are checked in one place.
KvCacheProblem validate_attention_with_kvcache(const TensorView& q, const TensorView& k_cache,
                                               const TensorView& v_cache, const KvCacheIndex& index,
                                               const TensorView& k_new, const TensorView& v_new,
                                               const TensorView& o, const TensorView& lse,
                                               const AttentionOptions& options) {
  constexpr std::string_view fn = "flash_attention_with_kvcache";
  check_qkv_like(fn, "q", q);
  check_qkv_like(fn, "k_cache", k_cache);
  check_qkv_like(fn, "v_cache", v_cache);
  check_same_kind(fn, "k_cache", k_cache, q);
  check_same_kind(fn, "v_cache", v_cache, q);
  check_same_shape(fn, "v_cache", v_cache, "k_cache", k_cache);
  FLASHLM_CHECK(q.dtype != DType::f8e4m3, "{}: q: dtype fp8_e4m3 is not supported with a KV cache", fn);
  const int64_t batch = q.size(0), heads_k = k_cache.size(2), head_dim = q.size(3);
  FLASHLM_CHECK(k_cache.size(3) == head_dim, "{}: k_cache: head_dim {} differs from q's head_dim {}", fn,
                k_cache.size(3), head_dim);

  KvCacheProblem kp;
  kp.paged = index.block_table != nullptr;
  if (kp.paged) {
    kp.page_size = k_cache.size(1);
    kp.num_pages = k_cache.size(0);
    kp.max_pages = index.max_pages;
    FLASHLM_CHECK(kp.page_size >= 16 && kp.page_size <= 256 && kp.page_size % 16 == 0,
                  "{}: k_cache: page_size (dimension 1 of the paged cache {}) must be a multiple of 16 in [16, 256], "
                  "got {}",
                  fn, k_cache.shape_string(), kp.page_size);
    FLASHLM_CHECK(kp.max_pages >= 1, "{}: block_table: max_pages must be at least 1, got {}", fn, kp.max_pages);
    kp.block_table_stride = index.block_table_stride == 0 ? kp.max_pages : index.block_table_stride;
    FLASHLM_CHECK(kp.block_table_stride >= kp.max_pages,
                  "{}: block_table: row stride {} is smaller than max_pages = {} (rows would overlap)", fn,
                  kp.block_table_stride, kp.max_pages);
    checked_mul(batch, kp.block_table_stride, "flash_attention_with_kvcache: block_table: entries");
  } else {
    FLASHLM_CHECK(index.max_pages == 0 && index.block_table_stride == 0,
                  "{}: block_table: max_pages = {} and block_table_stride = {} given without a block table (the "
                  "non-paged cache takes neither)",
                  fn, index.max_pages, index.block_table_stride);
    FLASHLM_CHECK(k_cache.size(0) == batch,
                  "{}: k_cache: the non-paged cache [batch, max_seq, heads_k, head_dim] has batch {}, q has {}", fn,
                  k_cache.size(0), batch);
    kp.page_size = k_cache.size(1);
    kp.num_pages = batch;
    kp.max_pages = 1;
    kp.block_table_stride = 1;
  }
  const int64_t capacity = checked_mul(kp.max_pages, kp.page_size, "flash_attention_with_kvcache: keys per sequence");
  FLASHLM_CHECK(capacity <= std::numeric_limits<int32_t>::max(),
                "{}: k_cache: {} keys per sequence exceed the int32 range of cache_seqlens", fn, capacity);
  FLASHLM_CHECK(batch == 0 || index.cache_seqlens != nullptr,
                "{}: cache_seqlens: null pointer (expected batch = {} int32 lengths)", fn, batch);

  const bool has_new = k_new.ndim != 0 || v_new.ndim != 0;
  if (has_new) {
    check_qkv_like(fn, "k_new", k_new);
    check_qkv_like(fn, "v_new", v_new);
    check_same_kind(fn, "k_new", k_new, q);
    check_same_kind(fn, "v_new", v_new, q);
    check_same_shape(fn, "v_new", v_new, "k_new", k_new);
    FLASHLM_CHECK(k_new.size(0) == batch && k_new.size(2) == heads_k && k_new.size(3) == head_dim,
                  "{}: k_new: expected shape [{}, seq_new, {}, {}] (batch, seq_new, heads_k, head_dim), got {}", fn,
                  batch, heads_k, head_dim, k_new.shape_string());
    kp.seq_new = k_new.size(1);
  }
  kp.has_lse = lse.ndim != 0;

  // The common checks (shapes of q and o, heads, scale, window, softcap, descales) on the key view the cache
  // stands for; without lse, a stand-in of the right shape that nothing reads.
  TensorView keys = k_cache;
  keys.sizes = {batch, 0, heads_k, head_dim};
  TensorView lse_view = lse;
  if (!kp.has_lse) {
    lse_view = TensorView::contiguous(q.data, DType::f32, {batch, q.size(2), q.size(1)}, q.device);
  }
  kp.attn = describe(fn, q, keys, keys, o, lse_view, options, batch);
  // The decoding kernels have neither (the CPU one neither): an error, never a silently plain softmax.
  FLASHLM_CHECK(!kp.attn.alibi, "{}: alibi_slopes is not supported when decoding over a KV cache", fn);
  FLASHLM_CHECK(!kp.attn.sink, "{}: learnable_sink is not supported when decoding over a KV cache", fn);
  kp.attn.seq_k = capacity;

  check_no_internal_overlap(fn, "o", o);
  if (kp.has_lse) check_no_internal_overlap(fn, "lse", lse);
  // An absent tensor (a 0-dimensional TensorView{}, one element by numel()) takes part as an empty one.
  const TensorView none = TensorView::contiguous(nullptr, q.dtype, {0}, q.device);
  const TensorView& lse_out = kp.has_lse ? lse : none;
  const TensorView& k_in = has_new ? k_new : none;
  const TensorView& v_in = has_new ? v_new : none;
  check_outputs_apart(fn, {{"o", &o}, {"lse", &lse_out}},
                      {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"k_new", &k_in}, {"v_new", &v_in}});
  check_outputs_apart(fn, {{"lse", &lse_out}}, {{"o", &o}});
  if (has_new) {
    check_no_internal_overlap(fn, "k_cache", k_cache);
    check_no_internal_overlap(fn, "v_cache", v_cache);
    check_outputs_apart(fn, {{"k_cache", &k_cache}, {"v_cache", &v_cache}},
                        {{"q", &q}, {"k_new", &k_new}, {"v_new", &v_new}});
    check_outputs_apart(fn, {{"k_cache", &k_cache}}, {{"v_cache", &v_cache}});
  }

  // The values, on the CPU only: CUDA callers guarantee them (no host copy, so that the call can be captured
  // in a CUDA graph), and the kernels check them cheaply (flashlm/attention.h).
  if (q.device == Device::cpu && batch > 0) {
    kp.seqlens.assign(index.cache_seqlens, index.cache_seqlens + batch);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = kp.seqlens[static_cast<size_t>(b)];
      FLASHLM_CHECK(len >= 0, "{}: cache_seqlens: sequence {} has length {}; lengths must be >= 0", fn, b, len);
      FLASHLM_CHECK(len + kp.seq_new <= capacity,
                    "{}: cache_seqlens: sequence {} holds {} keys{}, more than its {} (max_pages {} x page_size {})",
                    fn, b, len + kp.seq_new,
                    kp.seq_new > 0 ? fmt::format(" after appending {}", kp.seq_new) : std::string(), capacity,
                    kp.max_pages, kp.page_size);
      if (!kp.paged) continue;
      const int64_t pages = (len + kp.seq_new + kp.page_size - 1) / kp.page_size;
      for (int64_t i = 0; i < pages; ++i) {
        const int64_t page = index.block_table[b * kp.block_table_stride + i];
        FLASHLM_CHECK(page >= 0 && page < kp.num_pages,
                      "{}: block_table: entry [{}, {}] = {} is not a page of k_cache (expected [0, {}))", fn, b, i,
                      page, kp.num_pages);
      }
    }
  }
  return kp;
}

}  // namespace flashlm
