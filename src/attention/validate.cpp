#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <utility>

#include "attention/problem.h"
#include "core/check.h"

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

void check_same_kind(std::string_view fn, std::string_view name, const TensorView& t, const TensorView& q) {
  FLASHLM_CHECK(t.dtype == q.dtype, "{}: {}: dtype {} differs from q's {}", fn, name, dtype_name(t.dtype),
                dtype_name(q.dtype));
  FLASHLM_CHECK(t.device == q.device, "{}: {}: on {} but q is on {}", fn, name, device_name(t.device),
                device_name(q.device));
}

// The bytes a view may touch, [begin, end); empty for a view without elements. Strides are >= 0 here
// (check_view), so the last element lies at the sum of (size - 1) * stride.
std::pair<uintptr_t, uintptr_t> byte_range(std::string_view name, const TensorView& t) {
  if (t.numel() == 0) return {0, 0};
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

AttentionProblem describe(std::string_view fn, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& o, const TensorView& lse, const AttentionOptions& options) {
  check_qkv_like(fn, "q", q);
  check_qkv_like(fn, "k", k);
  check_qkv_like(fn, "v", v);
  check_qkv_like(fn, "o", o);
  check_same_kind(fn, "k", k, q);
  check_same_kind(fn, "v", v, q);
  check_same_kind(fn, "o", o, q);
  check_same_shape(fn, "v", v, "k", k);
  check_same_shape(fn, "o", o, "q", q);

  AttentionProblem p;
  p.batch = q.size(0);
  p.seq_q = q.size(1);
  p.heads_q = q.size(2);
  p.head_dim = q.size(3);
  p.seq_k = k.size(1);
  p.heads_k = k.size(2);
  p.dtype = q.dtype;
  p.device = q.device;
  FLASHLM_CHECK(k.size(0) == p.batch, "{}: k: batch {} differs from q's batch {}", fn, k.size(0), p.batch);
  FLASHLM_CHECK(k.size(3) == p.head_dim, "{}: k: head_dim {} differs from q's head_dim {}", fn, k.size(3),
                p.head_dim);
  FLASHLM_CHECK(p.head_dim >= 1, "{}: q: head_dim must be at least 1, got {}", fn, p.head_dim);
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
  p.causal = options.causal;
  p.causal_offset = options.align == CausalAlign::bottom_right ? p.seq_k - p.seq_q : 0;
  return p;
}

}  // namespace

AttentionProblem validate_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& o, const TensorView& lse,
                                            const AttentionOptions& options) {
  constexpr std::string_view fn = "attention_forward";
  AttentionProblem p = describe(fn, q, k, v, o, lse, options);
  check_outputs_apart(fn, {{"o", &o}, {"lse", &lse}}, {{"q", &q}, {"k", &k}, {"v", &v}});
  check_outputs_apart(fn, {{"lse", &lse}}, {{"o", &o}});
  return p;
}

AttentionProblem validate_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const TensorView& o, const TensorView& lse, const TensorView& dout,
                                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                             const AttentionOptions& options) {
  constexpr std::string_view fn = "attention_backward";
  AttentionProblem p = describe(fn, q, k, v, o, lse, options);
  for (auto [name, t] : {std::pair{"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
    check_qkv_like(fn, name, *t);
    check_same_kind(fn, name, *t, q);
  }
  check_same_shape(fn, "dout", dout, "q", q);
  check_same_shape(fn, "dq", dq, "q", q);
  check_same_shape(fn, "dk", dk, "k", k);
  check_same_shape(fn, "dv", dv, "v", v);
  check_outputs_apart(fn, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}},
                      {{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"lse", &lse}, {"dout", &dout}});
  return p;
}

}  // namespace flashlm
