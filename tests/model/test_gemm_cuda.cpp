// The cuBLASLt linear layers (model/cuda/gemm.h) against the CPU ops (OpenBLAS, model/ops_cpu.h) on the
// same inputs rounded to the dtype: forward, input gradient (= and +=), weight gradient (+= into fp32),
// bitwise reproducibility, plan reuse, streams, views that are not 256-byte aligned, and the argument
// errors. Outputs are poisoned with NaN (0xFF bytes) before each call that must overwrite them. GPU tests
// skip when no GPU is visible; the argument checks run in any CUDA build, since they throw before any
// CUDA call.
//
// Tolerances are per element, relative to s = Σ_k |a_ik|·|b_kj| (the same product on absolute values,
// plus |initial value| for += outputs), which bounds the rounding error of any summation order:
// |got - ref| <= 1e-5·s for fp32 results, plus u·|ref| for each rounding of a 16-bit result (u = 2^-8
// for bf16, 2^-11 for fp16). A wrong transpose or leading dimension gives errors of order |ref| ~ √k·s/k,
// far above these.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gpu_testing.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashlm/device.h"
#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "model/cuda/gemm.h"
#include "model/ops_cpu.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace flashlm;

#ifndef FLASHLM_WITH_CUDA

TEST(GemmCuda, NeedsCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }

#else

namespace {

constexpr double kFp32Rel = 1e-5;

// Unit roundoff of a result stored in t (0 for fp32: covered by kFp32Rel).
double unit_roundoff(DType t) {
  switch (t) {
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
    default: return 0.0;
  }
}

float round_to(DType t, float v) {
  switch (t) {
    case DType::bf16: return float(bf16_t(v));
    case DType::f16: return float(fp16_t(v));
    default: return v;
  }
}

// Values (already representable in t) as the bytes the device holds, and back.
std::vector<uint8_t> encode(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::f32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      const uint16_t bits = t == DType::bf16 ? bf16_t(v[i]).bits : fp16_t(v[i]).bits;
      std::memcpy(&out[i * 2], &bits, 2);
    }
  }
  return out;
}

std::vector<float> decode(const std::vector<uint8_t>& b, DType t) {
  const size_t e = dtype_size(t);
  std::vector<float> out(b.size() / e);
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == DType::f32) {
      std::memcpy(&out[i], &b[i * 4], 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &b[i * 2], 2);
      out[i] = t == DType::bf16 ? std::bit_cast<float>(uint32_t{bits} << 16) : fp16_t::to_float(bits);
    }
  }
  return out;
}

// Uniform in [-1, 1), rounded to t.
std::vector<float> random_values(int64_t count, DType t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& x : v) x = round_to(t, dist(rng));
  return v;
}

std::vector<float> abs_of(const std::vector<float>& v) {
  std::vector<float> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// A device array of `count` elements of t, optionally at an element offset inside a larger allocation
// (for pointers that are not 256-byte aligned).
class DeviceArray {
 public:
  DeviceArray(int64_t count, DType t, int64_t offset_elems = 0)
      : bytes_(static_cast<size_t>(count) * dtype_size(t)),
        offset_(static_cast<size_t>(offset_elems) * dtype_size(t)),
        buf_(Buffer::allocate(bytes_ + offset_, Device::cuda, "test_gemm_cuda")),
        type_(t) {}
  void* ptr() const { return static_cast<char*>(buf_.data()) + offset_; }
  float* fptr() const { return static_cast<float*>(ptr()); }
  size_t bytes() const { return bytes_; }

  void upload(const std::vector<float>& v) {
    const std::vector<uint8_t> b = encode(v, type_);
    cuda_ok(cudaMemcpy(ptr(), b.data(), b.size(), cudaMemcpyHostToDevice), "cudaMemcpy to device");
  }
  std::vector<uint8_t> raw() const {
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<uint8_t> b(bytes_);
    cuda_ok(cudaMemcpy(b.data(), ptr(), bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
    return b;
  }
  std::vector<float> download() const { return decode(raw(), type_); }
  void poison() { cuda_ok(cudaMemset(ptr(), 0xFF, bytes_), "cudaMemset"); }  // NaN in fp32, bf16 and fp16

 private:
  size_t bytes_, offset_;
  Buffer buf_;
  DType type_;
};

// Every element within kFp32Rel·scale + u·round_mag of ref (NaN fails); reports the count and the worst.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<float>& scale,
                  const std::vector<float>& round_mag, double u, const std::string& what, double rel = kFp32Rel) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int64_t bad = 0, worst = -1;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rel * scale[i] + u * round_mag[i];
    const double err = std::fabs(double(got[i]) - double(ref[i]));
    const double ratio = err / tol;
    if (!(err <= tol)) ++bad;
    if (!(ratio <= worst_ratio)) {  // NaN ratios win
      worst_ratio = ratio;
      worst = static_cast<int64_t>(i);
    }
  }
  if (bad > 0) {
    ADD_FAILURE() << what << ": " << bad << " of " << got.size() << " elements outside tolerance; worst at "
                  << worst << ": got " << got[worst] << ", want " << ref[worst] << ", scale " << scale[worst]
                  << ", error/tolerance " << worst_ratio;
  }
}

std::vector<float> plus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> s(a.size());
  for (size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i];
  return s;
}

// ---------------------------------------------------------------------------------------------------
// Against the CPU ops over a grid of dtypes and sizes.

struct Case {
  DType dtype;
  int64_t n, in, out;
};

std::string case_name(const Case& c) {
  return std::string(dtype_name(c.dtype)) + "_n" + std::to_string(c.n) + "_in" + std::to_string(c.in) + "_out" +
         std::to_string(c.out);
}
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

std::vector<Case> grid() {
  std::vector<Case> cases;
  const std::pair<int64_t, int64_t> shapes[] = {{8, 8},      {8, 48},      {48, 8},     {48, 1600},
                                                {1600, 48}, {1600, 6400}, {6400, 1600}};
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t n : {1, 7, 257}) {
      for (auto [in, out] : shapes) cases.push_back({t, n, in, out});
    }
  }
  return cases;
}

class GemmVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(GemmVsCpu, ForwardAndBackwardMatchOpenBlas) {
  SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const DType t = c.dtype;
  const double u = unit_roundoff(t);
  const int64_t n = c.n, in = c.in, out = c.out;
  const uint64_t seed = static_cast<uint64_t>(n * 1000003 + in * 1009 + out) * 4 + static_cast<uint64_t>(t);
  const std::vector<float> x = random_values(n * in, t, seed), w = random_values(out * in, t, seed + 1),
                           dy = random_values(n * out, t, seed + 2), dx0 = random_values(n * in, t, seed + 3),
                           dw0 = random_values(out * in, DType::f32, seed + 4);
  const std::vector<float> ax = abs_of(x), aw = abs_of(w), ady = abs_of(dy);
  DeviceArray d_x(n * in, t), d_w(out * in, t), d_dy(n * out, t), d_y(n * out, t), d_y2(n * out, t),
      d_dx(n * in, t), d_dx2(n * in, t), d_dw(out * in, DType::f32), d_dw2(out * in, DType::f32);
  d_x.upload(x);
  d_w.upload(w);
  d_dy.upload(dy);

  // Forward: y = x·wᵀ, one rounding to t.
  std::vector<float> y_ref(n * out), y_scale(n * out);
  cpu::linear_forward(x.data(), w.data(), y_ref.data(), n, in, out);
  cpu::linear_forward(ax.data(), aw.data(), y_scale.data(), n, in, out);
  d_y.poison();
  linear_forward_cuda(d_x.ptr(), d_w.ptr(), d_y.ptr(), n, in, out, t, nullptr);
  const std::vector<uint8_t> y_bits = d_y.raw();
  expect_close(decode(y_bits, t), y_ref, y_scale, abs_of(y_ref), u, "y of " + case_name(c));

  // Backward, dx overwritten: dx = dy·w, dw = dw0 + dyᵀ·x.
  std::vector<float> dx_ref(n * in), dw_ref = dw0, dx_scale(n * in), dw_scale = abs_of(dw0);
  cpu::linear_backward(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), n, in, out, false);
  cpu::linear_backward(ady.data(), ax.data(), aw.data(), dx_scale.data(), dw_scale.data(), n, in, out, false);
  const std::vector<float> zeros_like_dw(dw0.size(), 0.0f);
  d_dx.poison();
  d_dw.upload(dw0);
  linear_backward_cuda(d_dy.ptr(), d_x.ptr(), d_w.ptr(), d_dx.ptr(), d_dw.fptr(), n, in, out, t, false, nullptr);
  const std::vector<uint8_t> dx_bits = d_dx.raw(), dw_bits = d_dw.raw();
  expect_close(decode(dx_bits, t), dx_ref, dx_scale, abs_of(dx_ref), u, "dx (=) of " + case_name(c));
  expect_close(decode(dw_bits, DType::f32), dw_ref, dw_scale, zeros_like_dw, 0.0, "dw of " + case_name(c));

  // Bitwise reproducible: the same calls again, into fresh outputs.
  d_y2.poison();
  linear_forward_cuda(d_x.ptr(), d_w.ptr(), d_y2.ptr(), n, in, out, t, nullptr);
  EXPECT_TRUE(d_y2.raw() == y_bits) << "forward of " << case_name(c) << " is not bitwise reproducible";
  d_dx2.poison();
  d_dw2.upload(dw0);
  linear_backward_cuda(d_dy.ptr(), d_x.ptr(), d_w.ptr(), d_dx2.ptr(), d_dw2.fptr(), n, in, out, t, false, nullptr);
  EXPECT_TRUE(d_dx2.raw() == dx_bits) << "dx of " << case_name(c) << " is not bitwise reproducible";
  EXPECT_TRUE(d_dw2.raw() == dw_bits) << "dw of " << case_name(c) << " is not bitwise reproducible";

  // Backward twice with accumulate_dx: dx = dx0 + 2·dy·w, dw = dw0 + 2·dyᵀ·x (dx rounded to t after each call).
  std::vector<float> dx1_ref = dx0, dx2_ref, dw2_ref = dw0, dxa_scale = abs_of(dx0), dwa_scale = abs_of(dw0);
  cpu::linear_backward(dy.data(), x.data(), w.data(), dx1_ref.data(), dw2_ref.data(), n, in, out, true);
  dx2_ref = dx1_ref;
  cpu::linear_backward(dy.data(), x.data(), w.data(), dx2_ref.data(), dw2_ref.data(), n, in, out, true);
  for (int rep = 0; rep < 2; ++rep) {
    cpu::linear_backward(ady.data(), ax.data(), aw.data(), dxa_scale.data(), dwa_scale.data(), n, in, out, true);
  }
  d_dx.upload(dx0);
  d_dw.upload(dw0);
  for (int rep = 0; rep < 2; ++rep) {
    linear_backward_cuda(d_dy.ptr(), d_x.ptr(), d_w.ptr(), d_dx.ptr(), d_dw.fptr(), n, in, out, t, true, nullptr);
  }
  // Rounding budget: dx rounded to t after each call, and the product dy·w rounded to t before beta·dx is
  // added (cuBLASLt's epilogue does that for bf16/fp16 outputs: seen on the H200 with cuBLAS 13.0, errors up
  // to a full ulp of dx that single rounding cannot explain).
  std::vector<float> product = dx_ref, rounding = plus(abs_of(dx1_ref), abs_of(dx2_ref));
  for (size_t i = 0; i < rounding.size(); ++i) rounding[i] += 2.0f * std::fabs(product[i]);
  expect_close(d_dx.download(), dx2_ref, dxa_scale, rounding, u, "dx (+= twice) of " + case_name(c));
  expect_close(d_dw.download(), dw2_ref, dwa_scale, zeros_like_dw, 0.0, "dw (+= twice) of " + case_name(c));
}

INSTANTIATE_TEST_SUITE_P(Grid, GemmVsCpu, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); });

// ---------------------------------------------------------------------------------------------------
// Streams, views inside larger buffers, odd fp32 sizes, TF32, n = 0, plan reuse.

// Forward and backward of one case on `stream` with every operand at `offset` elements into its
// allocation, against the CPU; rel is the fp32 tolerance (looser for TF32).
void check_case(const Case& c, void* stream, int64_t offset, bool allow_tf32, double rel, const std::string& what) {
  const DType t = c.dtype;
  const double u = unit_roundoff(t);
  const int64_t n = c.n, in = c.in, out = c.out;
  const std::vector<float> x = random_values(n * in, t, 11), w = random_values(out * in, t, 12),
                           dy = random_values(n * out, t, 13), dw0 = random_values(out * in, DType::f32, 14);
  const std::vector<float> ax = abs_of(x), aw = abs_of(w), ady = abs_of(dy);
  DeviceArray d_x(n * in, t, offset), d_w(out * in, t, offset), d_dy(n * out, t, offset), d_y(n * out, t, offset),
      d_dx(n * in, t, offset), d_dw(out * in, DType::f32, offset);
  d_x.upload(x);
  d_w.upload(w);
  d_dy.upload(dy);
  d_dw.upload(dw0);
  d_y.poison();
  d_dx.poison();
  // The copies and memsets ran on the legacy default stream, which a non-blocking stream does not wait for.
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  linear_forward_cuda(d_x.ptr(), d_w.ptr(), d_y.ptr(), n, in, out, t, stream, allow_tf32);
  linear_backward_cuda(d_dy.ptr(), d_x.ptr(), d_w.ptr(), d_dx.ptr(), d_dw.fptr(), n, in, out, t, false, stream,
                       allow_tf32);
  cuda_ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");

  std::vector<float> y_ref(n * out), y_scale(n * out), dx_ref(n * in), dx_scale(n * in), dw_ref = dw0,
                                                                                        dw_scale = abs_of(dw0);
  cpu::linear_forward(x.data(), w.data(), y_ref.data(), n, in, out);
  cpu::linear_forward(ax.data(), aw.data(), y_scale.data(), n, in, out);
  cpu::linear_backward(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), n, in, out, false);
  cpu::linear_backward(ady.data(), ax.data(), aw.data(), dx_scale.data(), dw_scale.data(), n, in, out, false);
  expect_close(d_y.download(), y_ref, y_scale, abs_of(y_ref), u, "y of " + what, rel);
  expect_close(d_dx.download(), dx_ref, dx_scale, abs_of(dx_ref), u, "dx of " + what, rel);
  expect_close(d_dw.download(), dw_ref, dw_scale, std::vector<float>(dw0.size(), 0.0f), 0.0, "dw of " + what, rel);
}

class Stream {
 public:
  Stream() { cuda_ok(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s_); }
  void* get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

TEST(GemmCuda, NonDefaultStreamAndViewsNotAlignedTo256Bytes) {
  SKIP_WITHOUT_GPU();
  Stream stream;
  // 16-bit operands 16 bytes past a 256-byte boundary (the smallest alignment the API accepts for them).
  check_case({DType::bf16, 33, 48, 1600}, stream.get(), 8, false, kFp32Rel, "bf16 at +16 bytes on a stream");
  check_case({DType::f16, 33, 1600, 48}, stream.get(), 8, false, kFp32Rel, "fp16 at +16 bytes on a stream");
  // fp32 takes any sizes and any 4-byte aligned pointer.
  check_case({DType::f32, 7, 13, 5}, stream.get(), 1, false, kFp32Rel, "fp32 13->5 at +4 bytes on a stream");
  check_case({DType::f32, 257, 1601, 47}, nullptr, 3, false, kFp32Rel, "fp32 1601->47 at +12 bytes");
}

TEST(GemmCuda, Tf32OnlyWhenAsked) {
  SKIP_WITHOUT_GPU();
  // TF32 keeps 10 mantissa bits of each input: products are off by up to ~2^-10 relative (truncation) each.
  check_case({DType::f32, 257, 1600, 48}, nullptr, 0, true, std::ldexp(1.0, -8), "fp32 with TF32 allowed");
  // Without the flag, fp32 stays within 1e-5 (the grid checks that for every size; one more here).
  check_case({DType::f32, 257, 1600, 48}, nullptr, 0, false, kFp32Rel, "fp32 without TF32");
}

TEST(GemmCuda, EmptyBatchWritesNothing) {
  SKIP_WITHOUT_GPU();
  DeviceArray x(8 * 8, DType::bf16), w(8 * 8, DType::bf16), y(8 * 8, DType::bf16), dw(8 * 8, DType::f32);
  y.poison();
  const std::vector<float> dw0 = random_values(64, DType::f32, 5);
  dw.upload(dw0);
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), 0, 8, 8, DType::bf16, nullptr);
  linear_backward_cuda(y.ptr(), x.ptr(), w.ptr(), nullptr, dw.fptr(), 0, 8, 8, DType::bf16, false, nullptr);
  for (uint8_t b : y.raw()) ASSERT_EQ(b, 0xFF) << "n = 0 wrote to y";
  EXPECT_EQ(dw.download(), dw0) << "n = 0 changed dw";
}

TEST(GemmCuda, OnlyOneGradient) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 9, in = 16, out = 24;
  const DType t = DType::f16;
  const std::vector<float> x = random_values(n * in, t, 21), w = random_values(out * in, t, 22),
                           dy = random_values(n * out, t, 23), dw0 = random_values(out * in, DType::f32, 24);
  DeviceArray d_x(n * in, t), d_w(out * in, t), d_dy(n * out, t), d_dx(n * in, t), d_dw(out * in, DType::f32);
  d_x.upload(x);
  d_w.upload(w);
  d_dy.upload(dy);
  d_dw.upload(dw0);
  d_dx.poison();
  // dx only (x may be null), then dw only (w may be null).
  linear_backward_cuda(d_dy.ptr(), nullptr, d_w.ptr(), d_dx.ptr(), nullptr, n, in, out, t, false, nullptr);
  EXPECT_EQ(d_dw.download(), dw0) << "dw changed though it was not asked for";
  linear_backward_cuda(d_dy.ptr(), d_x.ptr(), nullptr, nullptr, d_dw.fptr(), n, in, out, t, false, nullptr);

  std::vector<float> dx_ref(n * in), dw_ref = dw0, dx_scale(n * in), dw_scale = abs_of(dw0);
  cpu::linear_backward(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), n, in, out, false);
  const std::vector<float> ax = abs_of(x), aw = abs_of(w), ady = abs_of(dy);
  cpu::linear_backward(ady.data(), ax.data(), aw.data(), dx_scale.data(), dw_scale.data(), n, in, out, false);
  expect_close(d_dx.download(), dx_ref, dx_scale, abs_of(dx_ref), unit_roundoff(t), "dx alone");
  expect_close(d_dw.download(), dw_ref, dw_scale, std::vector<float>(dw0.size(), 0.0f), 0.0, "dw alone");
}

TEST(GemmCuda, RepeatedCallsReuseThePlan) {
  SKIP_WITHOUT_GPU();
  // A shape no other test uses, so that the first call must build a plan.
  const int64_t n = 5, in = 40, out = 56;
  DeviceArray x(n * in, DType::bf16), x2(n * in, DType::bf16), w(out * in, DType::bf16), y(n * out, DType::bf16);
  x.upload(random_values(n * in, DType::bf16, 31));
  x2.upload(random_values(n * in, DType::bf16, 32));
  w.upload(random_values(out * in, DType::bf16, 33));
  const int64_t before = gemm_cuda_heuristic_queries();
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), n, in, out, DType::bf16, nullptr);
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 1);
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), n, in, out, DType::bf16, nullptr);
  linear_forward_cuda(x2.ptr(), w.ptr(), y.ptr(), n, in, out, DType::bf16, nullptr);  // other data, same alignment
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 1) << "a repeated call queried the heuristic again";
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), n, in, out, DType::bf16, nullptr, /*allow_tf32*/ true);
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 1) << "allow_tf32 must not change a bf16 plan";
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), n - 1, in, out - 8, DType::bf16, nullptr);  // new shape
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 2);
}

// y = x·wᵀ + r with the residual added in the epilogue: within the forward's bound plus one rounding of
// |r| (the sum is rounded once, in the dtype), in fp32, bf16 and fp16, on ragged shapes.
TEST(GemmCuda, ResidualIsAddedInTheEpilogue) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : {Case{DType::f32, 37, 13, 29}, Case{DType::bf16, 37, 48, 1600}, Case{DType::f16, 130, 1600, 56}}) {
    const DType t = c.dtype;
    const std::vector<float> x = random_values(c.n * c.in, t, 41), w = random_values(c.out * c.in, t, 42),
                             r = random_values(c.n * c.out, t, 43);
    DeviceArray d_x(c.n * c.in, t), d_w(c.out * c.in, t), d_r(c.n * c.out, t), d_y(c.n * c.out, t);
    d_x.upload(x);
    d_w.upload(w);
    d_r.upload(r);
    d_y.poison();
    linear_forward_residual_cuda(d_x.ptr(), d_w.ptr(), d_r.ptr(), d_y.ptr(), c.n, c.in, c.out, t, nullptr);
    std::vector<float> ref(c.n * c.out), scale(c.n * c.out);
    cpu::linear_forward(x.data(), w.data(), ref.data(), c.n, c.in, c.out);
    const std::vector<float> ax = abs_of(x), aw = abs_of(w);
    cpu::linear_forward(ax.data(), aw.data(), scale.data(), c.n, c.in, c.out);
    ref = plus(ref, r);
    scale = plus(scale, abs_of(r));
    expect_close(d_y.download(), ref, scale, abs_of(ref), t == DType::f32 ? 0.0 : unit_roundoff(t),
                 "y = x·wᵀ + residual, " + case_name(c));
    EXPECT_EQ(d_r.download(), r) << "the residual changed, " << case_name(c);
  }
}

// accumulate_dw = false writes dw over whatever it held (NaN here: never read), and matches the product
// accumulated onto zeros bit for bit (the same algorithm, beta 0 instead of 1 on zeros). With no rows it
// writes the empty product, zeros.
TEST(GemmCuda, OverwrittenWeightGradientIsNeverRead) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 70, in = 48, out = 40;
  for (DType t : {DType::f32, DType::bf16}) {
    const std::vector<float> x = random_values(n * in, t, 51), dy = random_values(n * out, t, 52);
    DeviceArray d_x(n * in, t), d_dy(n * out, t), d_dw(out * in, DType::f32), d_zeroed(out * in, DType::f32);
    d_x.upload(x);
    d_dy.upload(dy);
    d_dw.poison();
    d_zeroed.upload(std::vector<float>(size_t(out * in), 0.0f));
    linear_backward_cuda(d_dy.ptr(), d_x.ptr(), nullptr, nullptr, d_dw.fptr(), n, in, out, t, false, nullptr, false,
                         /*accumulate_dw*/ false);
    linear_backward_cuda(d_dy.ptr(), d_x.ptr(), nullptr, nullptr, d_zeroed.fptr(), n, in, out, t, false, nullptr);
    const std::vector<float> got = d_dw.download();
    for (float v : got) ASSERT_FALSE(std::isnan(v)) << "the poisoned dw was read, " << dtype_name(t);
    EXPECT_EQ(got, d_zeroed.download()) << "dw = differs from dw += onto zeros, " << dtype_name(t);

    d_dw.poison();
    linear_backward_cuda(d_dy.ptr(), d_x.ptr(), nullptr, nullptr, d_dw.fptr(), 0, in, out, t, false, nullptr, false,
                         /*accumulate_dw*/ false);
    EXPECT_EQ(d_dw.download(), std::vector<float>(size_t(out * in), 0.0f)) << "n = 0, dw =, " << dtype_name(t);
  }
}

// Autotuning times the candidates into a scratch output: the call's own outputs are written once (dx and
// dw accumulate exactly one product), within the bound of the grid's += case. That bound includes u·|dy·w|
// for a 16-bit dx: some cuBLASLt algorithms round the product to the output type before the epilogue adds
// beta·C (GemmVsCpu's comment), and a tuned plan may be one of them where the heuristic's first choice is
// not. With only u·|ref| this test failed on the H200 (1812 of 14400 elements, worst 12× the bound); a
// host model of that double rounding on these shapes gives 1747 and 7.9× (an fp32 epilogue: 0), while a
// product accumulated twice (a timing run landing in dx) is off by |dy·w|, ~100× this bound.
TEST(GemmCuda, AutotunedPlansWriteTheirOutputsOnce) {
  SKIP_WITHOUT_GPU();
  struct Restore {
    ~Restore() { set_gemm_autotune(0); }
  } restore;
  set_gemm_autotune(8);
  EXPECT_EQ(gemm_autotune(), 8);
  // Shapes no other test uses, so that new (tuned) plans are built.
  const int64_t n = 200, in = 72, out = 88;
  const DType t = DType::bf16;
  const std::vector<float> x = random_values(n * in, t, 61), w = random_values(out * in, t, 62),
                           dy = random_values(n * out, t, 63), dx0 = random_values(n * in, t, 64),
                           dw0 = random_values(out * in, DType::f32, 65);
  DeviceArray d_x(n * in, t), d_w(out * in, t), d_dy(n * out, t), d_dx(n * in, t), d_dw(out * in, DType::f32);
  d_x.upload(x);
  d_w.upload(w);
  d_dy.upload(dy);
  d_dx.upload(dx0);
  d_dw.upload(dw0);
  const size_t tuned_before = gemm_autotune_results().size();
  linear_backward_cuda(d_dy.ptr(), d_x.ptr(), d_w.ptr(), d_dx.ptr(), d_dw.fptr(), n, in, out, t, true, nullptr);
  std::vector<float> dx_ref = dx0, dw_ref = dw0, dx_scale = abs_of(dx0), dw_scale = abs_of(dw0);
  cpu::linear_backward(dy.data(), x.data(), w.data(), dx_ref.data(), dw_ref.data(), n, in, out, true);
  const std::vector<float> ax = abs_of(x), aw = abs_of(w), ady = abs_of(dy);
  cpu::linear_backward(ady.data(), ax.data(), aw.data(), dx_scale.data(), dw_scale.data(), n, in, out, true);
  std::vector<float> product(dx_ref.size()), unused_dw(dw0.size());
  cpu::linear_backward(dy.data(), x.data(), w.data(), product.data(), unused_dw.data(), n, in, out, false);
  expect_close(d_dx.download(), dx_ref, dx_scale, plus(abs_of(dx_ref), abs_of(product)), unit_roundoff(t),
               "tuned dx +=");
  expect_close(d_dw.download(), dw_ref, dw_scale, std::vector<float>(dw0.size(), 0.0f), 0.0, "tuned dw +=");
  const std::vector<GemmTuning> tuned = gemm_autotune_results();
  for (size_t i = tuned_before; i < tuned.size(); ++i) {
    EXPECT_GE(tuned[i].candidates, 2) << tuned[i].product;
    EXPECT_LT(tuned[i].chosen, tuned[i].candidates) << tuned[i].product;
    EXPECT_LE(tuned[i].chosen_ms, tuned[i].first_ms) << tuned[i].product;
  }
}

TEST(GemmCuda, SmReserveHasItsOwnPlanAndTheSameProduct) {
  SKIP_WITHOUT_GPU();
  // A shape no other test uses: the reserve must query the heuristic once more (its own plan), give the
  // same product up to the accumulation order of another algorithm, and restore the previous setting.
  const int64_t n = 96, in = 136, out = 200;
  DeviceArray x(n * in, DType::bf16), w(out * in, DType::bf16), y(n * out, DType::bf16), y2(n * out, DType::bf16);
  x.upload(random_values(n * in, DType::bf16, 41));
  w.upload(random_values(out * in, DType::bf16, 42));
  ASSERT_EQ(gemm_sm_reserve(), 0);
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), n, in, out, DType::bf16, nullptr);  // the full-device plan exists
  const int64_t before = gemm_cuda_heuristic_queries();
  {
    const ScopedGemmSmReserve reserve(16);
    EXPECT_EQ(gemm_sm_reserve(), 16);
    linear_forward_cuda(x.ptr(), w.ptr(), y2.ptr(), n, in, out, DType::bf16, nullptr);
    linear_forward_cuda(x.ptr(), w.ptr(), y2.ptr(), n, in, out, DType::bf16, nullptr);
    // One more query the first time this process uses the reserve for this shape, none after.
    EXPECT_LE(gemm_cuda_heuristic_queries(), before + 1) << "the reserved plan must be cached";
  }
  EXPECT_EQ(gemm_sm_reserve(), 0);
  const int64_t with_reserve = gemm_cuda_heuristic_queries();
  linear_forward_cuda(x.ptr(), w.ptr(), y.ptr(), n, in, out, DType::bf16, nullptr);
  EXPECT_EQ(gemm_cuda_heuristic_queries(), with_reserve) << "back to the cached full-device plan";
  {
    const ScopedGemmSmReserve all(100000);  // more SMs than any GPU has: a clear error, not a 1-SM plan
    try {
      linear_forward_cuda(x.ptr(), w.ptr(), y2.ptr(), n, in, out, DType::bf16, nullptr);
      ADD_FAILURE() << "a reserve of every SM was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("leaves no SM"), std::string::npos) << e.what();
    }
  }
  const std::vector<float> a = y.download(), b = y2.download();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], 1e-2 * (1 + std::abs(a[i]))) << "element " << i;  // one bf16 rounding apart at most
  }
}

// The pair products (SwiGLU's w1 and w3 with w2 between them): both operands of a pair in one buffer a
// gap apart, the gap and the outputs poisoned. Each output against the CPU as one product; the gap never
// written. Laid out as the model lays them (one GEMM), and with the second output before the first (a
// negative distance: two GEMMs), whose results must agree with the first layout's within the tolerance.
TEST(GemmCuda, PairProductsMatchTheCpuAndLeaveTheGapAlone) {
  SKIP_WITHOUT_GPU();
  for (const Case& c : {Case{DType::f32, 37, 24, 40}, Case{DType::bf16, 130, 48, 1600}, Case{DType::bf16, 7, 1600, 64},
                        Case{DType::f16, 257, 64, 48}}) {
    const DType t = c.dtype;
    const double u = unit_roundoff(t);
    const int64_t n = c.n, in = c.in, out = c.out, nx = n * in, nw = out * in, ny = n * out;
    const std::vector<float> x = random_values(nx, t, 61), w0 = random_values(nw, t, 62),
                             w1 = random_values(nw, t, 63), dy0 = random_values(ny, t, 64),
                             dy1 = random_values(ny, t, 65), dw_init = random_values(3 * nw, DType::f32, 66);
    const std::vector<float> ax = abs_of(x);
    DeviceArray d_x(nx, t), d_w(3 * nw, t), d_y(3 * ny, t), d_dy(3 * ny, t), d_dw(3 * nw, DType::f32);
    d_x.upload(x);
    std::vector<float> w_all(size_t(3 * nw), 0.5f), dy_all(size_t(3 * ny), 0.25f);
    std::copy(w0.begin(), w0.end(), w_all.begin());
    std::copy(w1.begin(), w1.end(), w_all.begin() + 2 * nw);
    std::copy(dy0.begin(), dy0.end(), dy_all.begin());
    std::copy(dy1.begin(), dy1.end(), dy_all.begin() + 2 * ny);
    d_w.upload(w_all);
    d_dy.upload(dy_all);
    auto el = [&](const DeviceArray& a, int64_t i, DType dt) {
      return static_cast<void*>(static_cast<char*>(a.ptr()) + size_t(i) * dtype_size(dt));
    };
    for (bool swapped : {false, true}) {
      const std::string what = case_name(c) + (swapped ? ", second output first" : "");
      // y_b's slot: 0 and 2 (the model's order) or 2 and 0.
      const int64_t slot0 = swapped ? 2 : 0, slot1 = swapped ? 0 : 2;
      d_y.poison();
      linear_forward_pair_cuda(d_x.ptr(), el(d_w, 0, t), el(d_w, 2 * nw, t), el(d_y, slot0 * ny, t),
                               el(d_y, slot1 * ny, t), n, in, out, t, nullptr);
      const std::vector<float> y = d_y.download();
      for (int b = 0; b < 2; ++b) {
        const std::vector<float>& wb = b == 0 ? w0 : w1;
        const std::vector<float> aw = abs_of(wb);
        std::vector<float> ref(static_cast<size_t>(ny)), scale(static_cast<size_t>(ny));
        cpu::linear_forward(x.data(), wb.data(), ref.data(), n, in, out);
        cpu::linear_forward(ax.data(), aw.data(), scale.data(), n, in, out);
        const int64_t at = (b == 0 ? slot0 : slot1) * ny;
        expect_close(std::vector<float>(y.begin() + at, y.begin() + at + ny), ref, scale, abs_of(ref), u,
                     fmt::format("y{} of {}", b, what));
      }
      for (int64_t i = ny; i < 2 * ny; ++i) ASSERT_TRUE(std::isnan(y[size_t(i)])) << "the gap of y was written, " << what;

      for (bool accumulate : {false, true}) {
        if (accumulate) {
          d_dw.upload(dw_init);
        } else {
          d_dw.poison();
        }
        linear_weight_grad_pair_cuda(el(d_dy, slot0 * ny, t), el(d_dy, slot1 * ny, t), d_x.ptr(),
                                     static_cast<float*>(el(d_dw, 0, DType::f32)),
                                     static_cast<float*>(el(d_dw, 2 * nw, DType::f32)), n, in, out, t, accumulate,
                                     nullptr);
        const std::vector<float> dw = d_dw.download();
        for (int b = 0; b < 2; ++b) {
          // dy_b is the one at dy's slot of output b: dy0 at slot 0, dy1 at slot 2.
          const std::vector<float>& dyb = (b == 0 ? slot0 : slot1) == 0 ? dy0 : dy1;
          const std::vector<float> ady = abs_of(dyb);
          const int64_t at = b == 0 ? 0 : 2 * nw;
          std::vector<float> ref(size_t(nw), 0.0f), scale(size_t(nw), 0.0f);
          if (accumulate) {
            std::copy(dw_init.begin() + at, dw_init.begin() + at + nw, ref.begin());
            scale = abs_of(ref);
          }
          std::vector<float> unused_dx(static_cast<size_t>(nx));  // the CPU op computes dx too
          cpu::linear_backward(dyb.data(), x.data(), w0.data(), unused_dx.data(), ref.data(), n, in, out, false);
          cpu::linear_backward(ady.data(), ax.data(), w0.data(), unused_dx.data(), scale.data(), n, in, out, false);
          expect_close(std::vector<float>(dw.begin() + at, dw.begin() + at + nw), ref, scale,
                       std::vector<float>(size_t(nw), 0.0f), 0.0,
                       fmt::format("dw{} {} of {}", b, accumulate ? "(+=)" : "(=)", what));
        }
        for (int64_t i = nw; i < 2 * nw; ++i) {
          const float want = accumulate ? dw_init[size_t(i)] : NAN;
          const float got = dw[size_t(i)];
          ASSERT_TRUE(std::isnan(want) ? std::isnan(got) : got == want) << "the gap of dw was written, " << what;
        }
      }
    }
  }
}

// Laid out as the model lays them, a pair is one cuBLASLt plan per direction (one GEMM), not two: the
// strided batch with a shared operand (stride 0) is accepted. Shapes no other test uses.
TEST(GemmCuda, PairProductsAreOneGemm) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 11, in = 56, out = 72;
  DeviceArray x(n * in, DType::bf16), w(3 * out * in, DType::bf16), y(3 * n * out, DType::bf16),
      dw(3 * out * in, DType::f32);
  x.upload(random_values(n * in, DType::bf16, 71));
  w.upload(random_values(3 * out * in, DType::bf16, 72));
  auto* wp = static_cast<uint16_t*>(w.ptr());
  auto* yp = static_cast<uint16_t*>(y.ptr());
  auto* dwp = dw.fptr();
  const int64_t before = gemm_cuda_heuristic_queries();
  linear_forward_pair_cuda(x.ptr(), wp, wp + 2 * out * in, yp, yp + 2 * n * out, n, in, out, DType::bf16, nullptr);
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 1) << "the forward pair was not one batched GEMM";
  linear_weight_grad_pair_cuda(yp, yp + 2 * n * out, x.ptr(), dwp, dwp + 2 * out * in, n, in, out, DType::bf16, false,
                               nullptr);
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 2) << "the weight-gradient pair was not one batched GEMM";
  linear_forward_pair_cuda(x.ptr(), wp, wp + 2 * out * in, yp, yp + 2 * n * out, n, in, out, DType::bf16, nullptr);
  EXPECT_EQ(gemm_cuda_heuristic_queries(), before + 2) << "a repeated pair queried the heuristic again";
}

TEST(GemmCuda, HostPointersAreErrors) {
  SKIP_WITHOUT_GPU();
  alignas(256) static float host[64 * 64];
  DeviceArray x(64, DType::f32), w(64, DType::f32), y(64, DType::f32);
  try {
    linear_forward_cuda(x.ptr(), host, y.ptr(), 8, 8, 8, DType::f32, nullptr);
    ADD_FAILURE() << "a host w was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w = "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("host memory"), std::string::npos) << e.what();
  }
  try {
    linear_backward_cuda(x.ptr(), host, w.ptr(), y.ptr(), host + 64 * 32, 8, 8, 8, DType::f32, false, nullptr);
    ADD_FAILURE() << "a host x was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x = "), std::string::npos) << e.what();
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Argument errors: thrown before any CUDA call, so these run without a GPU.

namespace {

// Runs fn and expects flashlm::Error (not CudaError) whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<const char*> parts, const char* what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const CudaError& e) {
    ADD_FAILURE() << what << ": CudaError instead of an argument error: " << e.what();
  } catch (const Error& e) {
    for (const char* p : parts) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << what << ": '" << p << "' not in: " << e.what();
    }
  }
}

TEST(GemmCudaArgs, AutotuneCandidatesAreBounded) {
  expect_error([] { set_gemm_autotune(-1); }, {"set_gemm_autotune", "-1", "0 to 64"}, "autotune -1");
  expect_error([] { set_gemm_autotune(65); }, {"set_gemm_autotune", "65", "0 to 64"}, "autotune 65");
  EXPECT_EQ(gemm_autotune(), 0);
}

TEST(GemmCudaArgs, ResidualMustExistAndNotOverlapTheOutput) {
  alignas(256) static unsigned char mem[3][1 << 12];
  void *a = mem[0], *b = mem[1], *c = mem[2];
  const DType bf = DType::bf16;
  expect_error([&] { linear_forward_residual_cuda(a, b, nullptr, c, 4, 8, 8, bf, nullptr); },
               {"linear_forward_residual_cuda", "residual is null"}, "null residual");
  expect_error([&] { linear_forward_residual_cuda(a, b, c, c, 4, 8, 8, bf, nullptr); },
               {"linear_forward_residual_cuda", "y and residual overlap"}, "residual is y");
}

TEST(GemmCudaArgs, PairOutputsMustNotOverlapEachOtherOrAnInput) {
  alignas(16) static uint16_t fake[4096];
  void* p = fake;
  void* q = fake + 1024;
  void* r = fake + 2048;
  // y1 starts inside y0 (n·out = 64 elements).
  expect_error([&] { linear_forward_pair_cuda(p, q, q, r, static_cast<uint16_t*>(r) + 8, 8, 8, 8, DType::bf16, nullptr); },
               {"linear_forward_pair_cuda", "y0 and y1 overlap"}, "overlapping outputs");
  expect_error([&] { linear_forward_pair_cuda(p, q, r, r, fake + 3072, 8, 8, 8, DType::bf16, nullptr); },
               {"linear_forward_pair_cuda", "y0 and w1 overlap"}, "an output over an input");
  float* f = reinterpret_cast<float*>(fake + 3072);
  expect_error([&] { linear_weight_grad_pair_cuda(p, q, r, f, f, 8, 8, 8, DType::bf16, false, nullptr); },
               {"linear_weight_grad_pair_cuda", "dw0 and dw1 overlap"}, "overlapping gradients");
  expect_error([&] { linear_weight_grad_pair_cuda(p, q, nullptr, f, f + 64, 8, 8, 8, DType::bf16, false, nullptr); },
               {"linear_weight_grad_pair_cuda", "x is null"}, "a null input");
}

TEST(GemmCudaArgs, NegativeSmReserveIsAnError) {
  expect_error([] { set_gemm_sm_reserve(-1); }, {"set_gemm_sm_reserve", "-1", ">= 0"}, "reserve -1");
  EXPECT_EQ(gemm_sm_reserve(), 0);
}

TEST(GemmCudaArgs, BadShapesDtypesAndPointersNameTheArgument) {
  // Host memory stands in for device memory: every case below fails before the pointers are looked at.
  alignas(256) static unsigned char mem[5][1 << 16];
  void *a = mem[0], *b = mem[1], *c = mem[2], *d = mem[3];
  float* f = reinterpret_cast<float*>(mem[4]);
  const DType bf = DType::bf16;

  // 16-bit sizes must keep rows 16-byte aligned.
  expect_error([&] { linear_forward_cuda(a, b, c, 4, 12, 16, bf, nullptr); },
               {"linear_forward_cuda", "in = 12", "multiple of 8", "bf16"}, "bf16 in = 12");
  expect_error([&] { linear_forward_cuda(a, b, c, 4, 16, 20, DType::f16, nullptr); },
               {"out = 20", "multiple of 8", "fp16"}, "fp16 out = 20");
  expect_error([&] { linear_backward_cuda(a, b, c, d, f, 4, 16, 1601, bf, false, nullptr); },
               {"linear_backward_cuda", "out = 1601"}, "bf16 backward out = 1601");
  // Sizes and dtypes.
  expect_error([&] { linear_forward_cuda(a, b, c, -1, 8, 8, bf, nullptr); }, {"n = -1"}, "n < 0");
  expect_error([&] { linear_forward_cuda(a, b, c, 4, 0, 8, bf, nullptr); }, {"in = 0"}, "in = 0");
  expect_error([&] { linear_backward_cuda(a, b, c, d, f, 4, 8, 0, bf, false, nullptr); }, {"out = 0"}, "out = 0");
  expect_error([&] { linear_forward_cuda(a, b, c, 4, 8, 8, DType::f64, nullptr); }, {"act = fp64"}, "fp64");
  // Null and misaligned pointers.
  expect_error([&] { linear_forward_cuda(nullptr, b, c, 4, 8, 8, bf, nullptr); }, {"x is null"}, "null x");
  expect_error([&] { linear_forward_cuda(a, nullptr, c, 4, 8, 8, bf, nullptr); }, {"w is null"}, "null w");
  expect_error([&] { linear_forward_cuda(a, b, nullptr, 4, 8, 8, bf, nullptr); }, {"y is null"}, "null y");
  expect_error([&] { linear_forward_cuda(a, static_cast<char*>(b) + 2, c, 4, 8, 8, bf, nullptr); },
               {"w = ", "16-byte aligned"}, "bf16 w at +2 bytes");
  expect_error([&] { linear_forward_cuda(static_cast<char*>(a) + 2, b, c, 4, 8, 8, DType::f32, nullptr); },
               {"x = ", "4-byte aligned"}, "fp32 x at +2 bytes");
  expect_error([&] { linear_backward_cuda(nullptr, b, c, d, f, 4, 8, 8, bf, false, nullptr); }, {"dy is null"},
               "null dy");
  expect_error([&] { linear_backward_cuda(a, b, nullptr, c, f, 4, 8, 8, bf, false, nullptr); }, {"w is null"},
               "dx without w");
  expect_error([&] { linear_backward_cuda(a, nullptr, c, b, f, 4, 8, 8, bf, false, nullptr); }, {"x is null"},
               "dw without x");
  expect_error([&] { linear_backward_cuda(a, b, c, nullptr, nullptr, 4, 8, 8, bf, false, nullptr); },
               {"dx and dw are both null"}, "no outputs");
  expect_error(
      [&] {
        linear_backward_cuda(a, b, c, d, reinterpret_cast<float*>(static_cast<char*>(a) + 2), 4, 8, 8, bf, false,
                             nullptr);
      },
      {"dw = ", "4-byte aligned"}, "dw at +2 bytes");
  // Outputs overlapping inputs.
  expect_error([&] { linear_forward_cuda(a, b, a, 4, 8, 8, bf, nullptr); }, {"y and x overlap"}, "y over x");
  expect_error([&] { linear_forward_cuda(a, b, static_cast<char*>(b) + 16, 4, 8, 8, bf, nullptr); },
               {"y and w overlap"}, "y over w");
  expect_error([&] { linear_backward_cuda(a, b, c, a, f, 4, 8, 8, bf, true, nullptr); }, {"dx and dy overlap"},
               "dx over dy");
  expect_error([&] { linear_backward_cuda(a, b, c, c, f, 4, 8, 8, bf, false, nullptr); }, {"dx and w overlap"},
               "dx over w");
  expect_error([&] { linear_backward_cuda(a, b, c, d, reinterpret_cast<float*>(b), 4, 8, 8, bf, false, nullptr); },
               {"dw and x overlap"}, "dw over x");
}

}  // namespace

#endif  // FLASHLM_WITH_CUDA
