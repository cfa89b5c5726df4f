// The CPU emulation of FP8 training's arithmetic (model/fp8.h): the reference of the CUDA cast kernels and
// FP8 GEMMs, and what the CPU tests exercise where there is no GPU.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "model/fp8.h"

namespace flashlm {

std::string_view fp8_format_name(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }

Fp8Format parse_fp8_format(std::string_view name) {
  if (name == "e4m3") return Fp8Format::e4m3;
  if (name == "e5m2") return Fp8Format::e5m2;
  fail_argument("unknown FP8 format '{}': expected e4m3 or e5m2", name);
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

float fp8_quantize_cpu(const float* x, int64_t count, Fp8Format f, uint8_t* q) {
  const float scale = fp8_scale(fp8_amax_cpu(x, count), f);
  fp8_encode_cpu(x, count, scale, f, q);
  return fp8_dequant_scale(scale);
}

void fp8_round_trip_cpu(const float* x, int64_t count, float amax, Fp8Format f, float* out) {
  const float scale = fp8_scale(amax, f), dequant = fp8_dequant_scale(scale);
  for (int64_t i = 0; i < count; ++i) out[i] = fp8_decode(fp8_encode(x[i] * scale, f), f) * dequant;
}

float fp8_amax_max(float a, float b) {
  uint32_t ab, bb;
  std::memcpy(&ab, &a, sizeof(ab));
  std::memcpy(&bb, &b, sizeof(bb));
  return (ab & 0x7fffffffu) >= (bb & 0x7fffffffu) ? a : b;
}

void fp8_matmul_nt_cpu(const uint8_t* p, Fp8Format pf, float p_dequant, const uint8_t* q, Fp8Format qf, float q_dequant,
                       int64_t rows, int64_t cols, int64_t k, double* d) {
  FLASHLM_CHECK(rows >= 0 && cols >= 0 && k >= 0, "fp8_matmul_nt_cpu: rows {}, cols {}, k {}", rows, cols, k);
  std::vector<double> pv(size_t(rows * k)), qv(size_t(cols * k));
  for (size_t i = 0; i < pv.size(); ++i) pv[i] = fp8_decode(p[i], pf);
  for (size_t i = 0; i < qv.size(); ++i) qv[i] = fp8_decode(q[i], qf);
  const double dequant = double(p_dequant) * double(q_dequant);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      double acc = 0;
      for (int64_t i = 0; i < k; ++i) acc += pv[size_t(r * k + i)] * qv[size_t(c * k + i)];
      d[r * cols + c] = acc * dequant;
    }
  }
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

}  // namespace

void fp8_linear_forward_cpu(const float* x, const float* w, double* y, int64_t n, int64_t in, int64_t out) {
  const Quantised qx = quantise(x, n * in, Fp8Format::e4m3), qw = quantise(w, out * in, Fp8Format::e4m3);
  fp8_matmul_nt_cpu(qx.q.data(), Fp8Format::e4m3, qx.dequant, qw.q.data(), Fp8Format::e4m3, qw.dequant, n, out, in, y);
}

void fp8_linear_backward_cpu(const float* dy, const float* x, const float* w, double* dx, double* dw, int64_t n,
                             int64_t in, int64_t out, Fp8Format grad_format) {
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
