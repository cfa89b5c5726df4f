// The CPU emulation of FP8 training's arithmetic (model/fp8.h): the reference of the CUDA cast kernels and
// FP8 GEMMs, and what the CPU tests exercise where there is no GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "flashlm/model.h"
#include "model/fp8.h"

namespace flashlm {

std::string_view fp8_format_name(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }

Fp8Format parse_fp8_format(std::string_view name) {
  if (name == "e4m3") return Fp8Format::e4m3;
  if (name == "e5m2") return Fp8Format::e5m2;
  fail_argument("unknown FP8 format '{}': expected e4m3 or e5m2", name);
}

std::string_view fp8_recipe_name(Fp8Recipe r) { return r == Fp8Recipe::tensorwise ? "tensorwise" : "rowwise"; }

Fp8Recipe parse_fp8_recipe(std::string_view name) {
  if (name == "tensorwise") return Fp8Recipe::tensorwise;
  if (name == "rowwise") return Fp8Recipe::rowwise;
  fail_argument("fp8 recipe (--fp8-recipe): unknown recipe '{}': expected tensorwise or rowwise", name);
}

uint8_t fp8_encode(float v, Fp8Format f) {
  return f == Fp8Format::e4m3 ? f8e4m3_t::from_float(v) : f8e5m2_t::from_float(v);
}

float fp8_decode(uint8_t bits, Fp8Format f) {
  return f == Fp8Format::e4m3 ? f8e4m3_t::to_float(bits) : f8e5m2_t::to_float(bits);
}

float fp8_amax_cpu(const float* x, int64_t count) {
  // As the GPU reduces it: the largest |x| by its bits, so NaN (whose magnitude bits exceed inf's) wins.
  uint32_t best = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof(bits));
    bits &= 0x7fffffffu;
    if (bits > best) best = bits;
  }
  float amax;
  std::memcpy(&amax, &best, sizeof(amax));
  return amax;
}

void fp8_encode_cpu(const float* x, int64_t count, float scale, Fp8Format f, uint8_t* q) {
  for (int64_t i = 0; i < count; ++i) q[i] = fp8_encode(x[i] * scale, f);
}

void fp8_dequantize_cpu(const uint8_t* q, int64_t count, float dequant, Fp8Format f, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = fp8_decode(q[i], f) * dequant;
}

float fp8_quantize_cpu(const float* x, int64_t count, Fp8Format f, uint8_t* q) {
  const float scale = fp8_scale(fp8_amax_cpu(x, count), f);
  fp8_encode_cpu(x, count, scale, f, q);
  return fp8_dequant_scale(scale);
}

namespace {

// One value rounded through FP8 with this scale and back.
float round_trip(float x, float scale, float dequant, Fp8Format f) { return fp8_decode(fp8_encode(x * scale, f), f) * dequant; }

}  // namespace

void fp8_round_trip_cpu(const float* x, int64_t count, float amax, Fp8Format f, float* out) {
  const float scale = fp8_scale(amax, f), dequant = fp8_dequant_scale(scale);
  for (int64_t i = 0; i < count; ++i) out[i] = round_trip(x[i], scale, dequant, f);
}

void fp8_amax_rows_cols_cpu(const float* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax) {
  FLASHLM_CHECK(rows >= 0 && cols >= 0, "fp8_amax_rows_cols_cpu: rows = {}, cols = {}, expected >= 0", rows, cols);
  if (row_amax) {
    for (int64_t r = 0; r < rows; ++r) row_amax[r] = fp8_amax_cpu(x + r * cols, cols);
  }
  if (col_amax) {
    std::fill(col_amax, col_amax + cols, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) col_amax[c] = fp8_amax_max(col_amax[c], std::fabs(x[r * cols + c]));
    }
  }
}

void fp8_cast_rowwise_cpu(const float* x, int64_t rows, int64_t cols, const float* row_amax, const float* col_amax,
                          Fp8Format f, uint8_t* q, uint8_t* qt, float* row_dequant, float* col_dequant) {
  FLASHLM_CHECK(rows >= 0 && cols >= 0, "fp8_cast_rowwise_cpu: rows = {}, cols = {}, expected >= 0", rows, cols);
  FLASHLM_CHECK(!q || (row_amax && row_dequant), "fp8_cast_rowwise_cpu: q needs row_amax and row_dequant");
  FLASHLM_CHECK(!qt || (col_amax && col_dequant), "fp8_cast_rowwise_cpu: qt needs col_amax and col_dequant");
  if (q) {
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = fp8_scale(row_amax[r], f);
      row_dequant[r] = fp8_dequant_scale(scale);
      fp8_encode_cpu(x + r * cols, cols, scale, f, q + r * cols);
    }
  }
  if (qt) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = fp8_scale(col_amax[c], f);
      col_dequant[c] = fp8_dequant_scale(scale);
      for (int64_t r = 0; r < rows; ++r) qt[c * rows + r] = fp8_encode(x[r * cols + c] * scale, f);
    }
  }
}

void fp8_round_trip_rows_cpu(const float* x, int64_t rows, int64_t cols, const float* row_amax, Fp8Format f,
                             float* out) {
  for (int64_t r = 0; r < rows; ++r) fp8_round_trip_cpu(x + r * cols, cols, row_amax[r], f, out + r * cols);
}

void fp8_round_trip_cols_cpu(const float* x, int64_t rows, int64_t cols, const float* col_amax, Fp8Format f,
                             float* out) {
  std::vector<float> scale(static_cast<size_t>(cols)), dequant(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    scale[size_t(c)] = fp8_scale(col_amax[c], f);
    dequant[size_t(c)] = fp8_dequant_scale(scale[size_t(c)]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = round_trip(x[r * cols + c], scale[size_t(c)], dequant[size_t(c)], f);
    }
  }
}

std::vector<Fp8ScaleGroup> fp8_scale_groups(const std::vector<ParameterInfo>& layout) {
  std::vector<Fp8ScaleGroup> groups;
  for (const ParameterInfo& p : layout) {
    constexpr std::string_view kLayers = "layers.";
    if (!p.name.starts_with(kLayers)) continue;
    const std::string_view name = std::string_view(p.name).substr(p.name.find('.', kLayers.size()) + 1);
    const auto* at = std::find(std::begin(kFp8BlockWeights), std::end(kFp8BlockWeights), name);
    if (at == std::end(kFp8BlockWeights)) continue;
    // k and v join q's group: they follow it directly in the layout.
    const bool joins = at != std::begin(kFp8BlockWeights) && size_t(at - std::begin(kFp8BlockWeights)) < kFp8SharedScaleWeights;
    if (joins) {
      FLASHLM_CHECK(!groups.empty() && groups.back().offset + groups.back().count == p.offset,
                    "fp8_scale_groups: '{}' does not follow q_proj in the layout", p.name);
      groups.back().count += p.numel();
    } else {
      groups.push_back({p.offset, p.numel()});
    }
  }
  return groups;
}

float fp8_amax_max(float a, float b) {
  uint32_t ab, bb;
  std::memcpy(&ab, &a, sizeof(ab));
  std::memcpy(&bb, &b, sizeof(bb));
  return (ab & 0x7fffffffu) >= (bb & 0x7fffffffu) ? a : b;
}

namespace {

// d = the decoded product times p_dequant[r · p_step] · q_dequant[c · q_step] (step 0: one scale, 1: a vector).
void matmul_nt(const char* fn, const uint8_t* p, Fp8Format pf, const float* p_dequant, int64_t p_step,
               const uint8_t* q, Fp8Format qf, const float* q_dequant, int64_t q_step, int64_t rows, int64_t cols,
               int64_t k, double* d) {
  FLASHLM_CHECK(rows >= 0 && cols >= 0 && k >= 0, "{}: rows {}, cols {}, k {}", fn, rows, cols, k);
  std::vector<double> pv(size_t(rows * k)), qv(size_t(cols * k));
  for (size_t i = 0; i < pv.size(); ++i) pv[i] = fp8_decode(p[i], pf);
  for (size_t i = 0; i < qv.size(); ++i) qv[i] = fp8_decode(q[i], qf);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      double acc = 0;
      for (int64_t i = 0; i < k; ++i) acc += pv[size_t(r * k + i)] * qv[size_t(c * k + i)];
      d[r * cols + c] = acc * (double(p_dequant[r * p_step]) * double(q_dequant[c * q_step]));
    }
  }
}

}  // namespace

void fp8_matmul_nt_cpu(const uint8_t* p, Fp8Format pf, float p_dequant, const uint8_t* q, Fp8Format qf, float q_dequant,
                       int64_t rows, int64_t cols, int64_t k, double* d) {
  matmul_nt("fp8_matmul_nt_cpu", p, pf, &p_dequant, 0, q, qf, &q_dequant, 0, rows, cols, k, d);
}

void fp8_matmul_nt_rowwise_cpu(const uint8_t* p, Fp8Format pf, const float* p_dequant, const uint8_t* q, Fp8Format qf,
                               const float* q_dequant, int64_t rows, int64_t cols, int64_t k, double* d) {
  matmul_nt("fp8_matmul_nt_rowwise_cpu", p, pf, p_dequant, 1, q, qf, q_dequant, 1, rows, cols, k, d);
}

namespace {

std::vector<float> transposed(const float* a, int64_t rows, int64_t cols) {
  std::vector<float> t(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[r * cols + c];
  }
  return t;
}

// Quantised tensorwise, the bytes and the dequantisation scale.
struct Quantised {
  std::vector<uint8_t> q;
  float dequant;
};
Quantised quantise(const float* x, int64_t count, Fp8Format f) {
  Quantised out{std::vector<uint8_t>(size_t(count)), 0.0f};
  out.dequant = fp8_quantize_cpu(x, count, f, out.q.data());
  return out;
}

// Rowwise, the bytes of a tensor [rows, cols] scaled per row (straight) and per column (transposed, [cols, rows]),
// with their dequantisation vectors, as the CUDA cast writes them.
struct QuantisedRowwise {
  std::vector<uint8_t> q, qt;
  std::vector<float> row_dequant, col_dequant;
};
QuantisedRowwise quantise_rowwise(const float* x, int64_t rows, int64_t cols, Fp8Format f) {
  QuantisedRowwise out{std::vector<uint8_t>(size_t(rows * cols)), std::vector<uint8_t>(size_t(rows * cols)),
                       std::vector<float>(size_t(rows)), std::vector<float>(size_t(cols))};
  std::vector<float> row_amax(static_cast<size_t>(rows)), col_amax(static_cast<size_t>(cols));
  fp8_amax_rows_cols_cpu(x, rows, cols, row_amax.data(), col_amax.data());
  fp8_cast_rowwise_cpu(x, rows, cols, row_amax.data(), col_amax.data(), f, out.q.data(), out.qt.data(),
                       out.row_dequant.data(), out.col_dequant.data());
  return out;
}

}  // namespace

void fp8_linear_forward_cpu(const float* x, const float* w, double* y, int64_t n, int64_t in, int64_t out,
                            Fp8Recipe recipe) {
  if (recipe == Fp8Recipe::rowwise) {
    const QuantisedRowwise qx = quantise_rowwise(x, n, in, Fp8Format::e4m3), qw = quantise_rowwise(w, out, in, Fp8Format::e4m3);
    fp8_matmul_nt_rowwise_cpu(qx.q.data(), Fp8Format::e4m3, qx.row_dequant.data(), qw.q.data(), Fp8Format::e4m3,
                              qw.row_dequant.data(), n, out, in, y);
    return;
  }
  const Quantised qx = quantise(x, n * in, Fp8Format::e4m3), qw = quantise(w, out * in, Fp8Format::e4m3);
  fp8_matmul_nt_cpu(qx.q.data(), Fp8Format::e4m3, qx.dequant, qw.q.data(), Fp8Format::e4m3, qw.dequant, n, out, in, y);
}

void fp8_linear_backward_cpu(const float* dy, const float* x, const float* w, double* dx, double* dw, int64_t n,
                             int64_t in, int64_t out, Fp8Format grad_format, Fp8Recipe recipe) {
  if (recipe == Fp8Recipe::rowwise) {
    // dy per token for dx, per output channel (its transposed copy) for dw; w per input column (wᵀ's rows);
    // x per input column (xᵀ's rows).
    const QuantisedRowwise qdy = quantise_rowwise(dy, n, out, grad_format);
    if (dx) {
      const QuantisedRowwise qw = quantise_rowwise(w, out, in, Fp8Format::e4m3);
      fp8_matmul_nt_rowwise_cpu(qdy.q.data(), grad_format, qdy.row_dequant.data(), qw.qt.data(), Fp8Format::e4m3,
                                qw.col_dequant.data(), n, in, out, dx);
    }
    if (dw) {
      const QuantisedRowwise qx = quantise_rowwise(x, n, in, Fp8Format::e4m3);
      fp8_matmul_nt_rowwise_cpu(qdy.qt.data(), grad_format, qdy.col_dequant.data(), qx.qt.data(), Fp8Format::e4m3,
                                qx.col_dequant.data(), out, in, n, dw);
    }
    return;
  }
  // The scale of a tensor does not depend on its layout: quantising the transpose gives the transposed bytes.
  const Quantised qdy = quantise(dy, n * out, grad_format);
  if (dx) {
    const std::vector<float> wt = transposed(w, out, in);  // [in, out]
    const Quantised qwt = quantise(wt.data(), in * out, Fp8Format::e4m3);
    fp8_matmul_nt_cpu(qdy.q.data(), grad_format, qdy.dequant, qwt.q.data(), Fp8Format::e4m3, qwt.dequant, n, in, out,
                      dx);
  }
  if (dw) {
    const std::vector<float> dyt = transposed(dy, n, out), xt = transposed(x, n, in);  // [out, n], [in, n]
    const Quantised qdyt = quantise(dyt.data(), out * n, grad_format), qxt = quantise(xt.data(), in * n, Fp8Format::e4m3);
    fp8_matmul_nt_cpu(qdyt.q.data(), grad_format, qdyt.dequant, qxt.q.data(), Fp8Format::e4m3, qxt.dequant, out, in, n,
                      dw);
  }
}

}  // namespace flashlm
