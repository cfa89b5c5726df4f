// FP8 training's CUDA pieces against the CPU emulation (model/fp8.h): the amax + cast kernel (bit-exact,
// straight and transposed, both formats, ragged shapes, bf16 and fp32 inputs, poisoned outputs), the FP8
// GEMM (fp8_gemm_cuda) against the fp64 product of the same FP8 operands, and CudaModel's FP8 linear layer
// (Fp8Linear: casts and GEMMs chained, forward and both backward products) against the emulated layer, and
// the layer reading FSDP's gathered FP8 bytes (and their transpose, gpu::fp8_transpose) instead of a bf16 weight.
// GPU tests skip without a GPU; the argument checks that throw before any CUDA call run in any CUDA build.
//
// GEMM tolerance, per element: |got - ref| <= 2^-10·s + u·|ref| with s = dq_p·dq_q·Σ_k |p_ik|·|q_jk| (the
// product on absolute values) and u = 2^-8 for a bf16 result (0 for fp32); plus |c| · 2^-8 where a bf16 C is
// added. 2^-10 leaves room for the tensor cores' FP8 accumulation (narrower than fp32 inside one MMA, then
// promoted); it is 64 times below e4m3's own quantisation step, and a wrong layout, operand or scale gives
// errors of order s/√k or more.
#include <gtest/gtest.h>

#include "gpu_testing.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "flashlm/model.h"
#include "model/fp8.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_runtime.h"
#include "model/cuda/fp8.h"
#include "model/cuda/fp8_linear.h"
#include "model/cuda/gemm.h"
#endif

using namespace flashlm;

#ifndef FLASHLM_WITH_CUDA

TEST(Fp8Cuda, NeedsCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }

#else

namespace {

void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// A device array of raw bytes.
struct Dev {
  Buffer buf;
  size_t bytes;
  explicit Dev(size_t n) : buf(Buffer::allocate(std::max<size_t>(n, 16), Device::cuda, "test_fp8_cuda")), bytes(n) {}
  void* ptr() const { return buf.data(); }
  template <class T>
  T* as() const {
    return static_cast<T*>(buf.data());
  }
  template <class T>
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size() * sizeof(T), bytes);
    cuda_ok(cudaMemcpy(ptr(), v.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
  }
  template <class T>
  std::vector<T> download() const {
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<T> v(bytes / sizeof(T));
    cuda_ok(cudaMemcpy(v.data(), ptr(), bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
    return v;
  }
  void poison(uint8_t byte = 0xAB) { cuda_ok(cudaMemset(ptr(), byte, bytes), "cudaMemset"); }
};

// Normal values of varied magnitude (a few large outliers, some tiny ones: subnormals after scaling),
// rounded to bf16.
std::vector<float> random_bf16_values(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(count));
  for (size_t i = 0; i < v.size(); ++i) {
    float x = normal(rng);
    if (rng() % 50 == 0) x *= 40.0f;
    if (rng() % 20 == 0) x *= 1e-4f;
    v[i] = float(bf16_t(x));
  }
  return v;
}

std::vector<bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = bf16_t(v[i]);
  return b;
}

std::vector<float> transposed(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  }
  return t;
}

// fn() throws an Error whose message contains `part`.
template <class Fn>
void expect_error(Fn&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// The cast: amax, scale and every byte as the CPU emulation computes them.

TEST(Fp8Cast, MatchesTheCpuEmulationBitExactly) {
  SKIP_WITHOUT_GPU();
  // Multiples of 8 take the packed cast (a partial tile at the edges too: 136 x 200), the others the
  // byte-wide one; the amax reduction's packed loop leaves a tail where the count is not a multiple of 8.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},      {1, 40},    {17, 33},   {64, 48}, {8, 8},
                                                {136, 200}, {100, 257}, {2048, 80}, {33, 2049}};
  uint64_t seed = 1;
  for (auto [rows, cols] : shapes) {
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      for (bool fp32_input : {false, true}) {
        const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                 std::string(fp8_format_name(f)) + (fp32_input ? " fp32" : " bf16");
        std::vector<float> x = random_bf16_values(rows * cols, seed++);
        if (fp32_input) {
          std::mt19937 rng(static_cast<unsigned>(seed));
          for (float& v : x) v *= 1.0f + 1e-3f * float(rng() % 1000) / 1000.0f;  // not bf16-representable
        }
        const int64_t count = rows * cols;
        std::vector<uint8_t> want(static_cast<size_t>(count));
        const float want_dequant = fp8_quantize_cpu(x.data(), count, f, want.data());
        const float want_amax = fp8_amax_cpu(x.data(), count);

        Dev dx(size_t(count) * (fp32_input ? 4 : 2)), dq(static_cast<size_t>(count)), dqt(static_cast<size_t>(count)), ds(kFp8ScaleSlotFloats * sizeof(float));
        if (fp32_input) dx.upload(x); else dx.upload(to_bf16(x));
        dq.poison();
        dqt.poison();
        ds.poison();
        if (fp32_input) {
          gpu::fp8_quantize(dx.as<float>(), rows, cols, f, dq.as<uint8_t>(), dqt.as<uint8_t>(), ds.as<float>(), nullptr);
        } else {
          gpu::fp8_quantize(dx.as<bf16_t>(), rows, cols, f, dq.as<uint8_t>(), dqt.as<uint8_t>(), ds.as<float>(),
                            nullptr);
        }
        const auto scales = ds.download<float>();
        EXPECT_EQ(std::bit_cast<uint32_t>(scales[kFp8AmaxIndex]), std::bit_cast<uint32_t>(want_amax)) << what << ": amax";
        EXPECT_EQ(std::bit_cast<uint32_t>(scales[kFp8DequantIndex]), std::bit_cast<uint32_t>(want_dequant)) << what << ": dequant";
        const auto q = dq.download<uint8_t>(), qt = dqt.download<uint8_t>();
        int64_t bad = 0, bad_t = 0;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            bad += q[size_t(r * cols + c)] != want[size_t(r * cols + c)];
            bad_t += qt[size_t(c * rows + r)] != want[size_t(r * cols + c)];
          }
        }
        EXPECT_EQ(bad, 0) << what << ": straight copy differs from the CPU emulation";
        EXPECT_EQ(bad_t, 0) << what << ": transposed copy differs from the CPU emulation";

        // Only the transposed copy, only the straight one: the same bytes, the other array untouched.
        dq.poison(0x5C);
        dqt.poison(0x5C);
        if (!fp32_input) {
          gpu::fp8_quantize(dx.as<bf16_t>(), rows, cols, f, nullptr, dqt.as<uint8_t>(), ds.as<float>(), nullptr);
          EXPECT_EQ(dqt.download<uint8_t>(), qt) << what;
          for (uint8_t b : dq.download<uint8_t>()) ASSERT_EQ(b, 0x5C) << what << ": q written though null";
          gpu::fp8_quantize(dx.as<bf16_t>(), rows, cols, f, dq.as<uint8_t>(), nullptr, ds.as<float>(), nullptr);
          EXPECT_EQ(dq.download<uint8_t>(), q) << what;
        }
      }
    }
  }
}

// A misaligned input takes the byte-wide cast and the element-wise amax loop: the same bytes and scales as
// the packed path over the same values.
TEST(Fp8Cast, MisalignedInputsMatchTheAlignedOnes) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 72, cols = 136, count = rows * cols;
  const std::vector<float> x = random_bf16_values(count, 99);
  std::vector<float> shifted(size_t(count + 1), 0.0f);
  std::copy(x.begin(), x.end(), shifted.begin() + 1);
  const size_t n = static_cast<size_t>(count);
  Dev dx{n * 2}, dxs{(n + 1) * 2}, dq{n}, dqt{n}, dqs{n}, dqts{n}, ds{2 * kFp8ScaleSlotFloats * sizeof(float)};
  dx.upload(to_bf16(x));
  dxs.upload(to_bf16(shifted));
  for (Dev* d : {&dq, &dqt, &dqs, &dqts}) d->poison();
  gpu::fp8_quantize(dx.as<bf16_t>(), rows, cols, Fp8Format::e4m3, dq.as<uint8_t>(), dqt.as<uint8_t>(), ds.as<float>(),
                    nullptr);
  gpu::fp8_quantize(dxs.as<bf16_t>() + 1, rows, cols, Fp8Format::e4m3, dqs.as<uint8_t>(), dqts.as<uint8_t>(),
                    ds.as<float>() + kFp8ScaleSlotFloats, nullptr);
  const auto scales = ds.download<float>();
  EXPECT_EQ(scales[kFp8AmaxIndex], scales[kFp8ScaleSlotFloats + kFp8AmaxIndex]);
  EXPECT_EQ(scales[kFp8DequantIndex], scales[kFp8ScaleSlotFloats + kFp8DequantIndex]);
  EXPECT_EQ(dq.download<uint8_t>(), dqs.download<uint8_t>()) << "straight copy";
  EXPECT_EQ(dqt.download<uint8_t>(), dqts.download<uint8_t>()) << "transposed copy";
  std::vector<uint8_t> want(n);
  fp8_quantize_cpu(x.data(), count, Fp8Format::e4m3, want.data());
  EXPECT_EQ(dq.download<uint8_t>(), want) << "against the CPU emulation";
}

TEST(Fp8Cast, ZerosGiveZerosAndANaNPoisonsTheTensor) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 48, cols = 32;
  std::vector<float> x(size_t(rows * cols), 0.0f);
  Dev dx(x.size() * 4), dq(x.size()), ds(kFp8ScaleSlotFloats * sizeof(float));
  dx.upload(x);
  dq.poison();
  gpu::fp8_quantize(dx.as<float>(), rows, cols, Fp8Format::e4m3, dq.as<uint8_t>(), nullptr, ds.as<float>(), nullptr);
  for (uint8_t b : dq.download<uint8_t>()) ASSERT_EQ(b, 0);
  EXPECT_EQ(ds.download<float>()[kFp8DequantIndex], fp8_dequant_scale(fp8_scale(0.0f, Fp8Format::e4m3)));
  x[777] = NAN;
  x[5] = 3.0f;
  dx.upload(x);
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    gpu::fp8_quantize(dx.as<float>(), rows, cols, f, dq.as<uint8_t>(), nullptr, ds.as<float>(), nullptr);
    EXPECT_TRUE(std::isnan(ds.download<float>()[kFp8AmaxIndex])) << "amax of a tensor with a NaN";
    for (uint8_t b : dq.download<uint8_t>()) ASSERT_TRUE(std::isnan(fp8_decode(b, f))) << fp8_format_name(f);
  }
}

// ---------------------------------------------------------------------------------------------------
// The FP8 GEMM against the fp64 product of the same FP8 operands and scales.

namespace {

// Two operands' scale slots (model/fp8.h): the dequantisation scales at the start of each, 16-byte aligned.
constexpr size_t kTwoSlotsBytes = 2 * kFp8ScaleSlotFloats * sizeof(float);
std::vector<float> two_slots(float p_dequant, float q_dequant) {
  std::vector<float> v(2 * kFp8ScaleSlotFloats, 0.0f);
  v[kFp8DequantIndex] = p_dequant;
  v[kFp8ScaleSlotFloats + kFp8DequantIndex] = q_dequant;
  return v;
}

struct GemmCase {
  int64_t rows, cols, k;
  Fp8Format pf, qf;
};

// Random FP8 operands: random values quantised by the CPU emulation (so every code class occurs).
std::vector<uint8_t> random_fp8(int64_t count, Fp8Format f, uint64_t seed, float* dequant) {
  const std::vector<float> v = random_bf16_values(count, seed);
  std::vector<uint8_t> q(static_cast<size_t>(count));
  *dequant = fp8_quantize_cpu(v.data(), count, f, q.data());
  return q;
}

// The products' accumulation error, relative to Σ|terms|. Hopper's FP8 tensor cores add into an accumulator
// that keeps about 14 mantissa bits between cuBLASLt's promotions to fp32 (DeepSeek-V3's report, §3.3.2), so
// the fp32 reference's 2^-10 is not met: on an H100 (cuBLASLt 13.1) the worst element was 1.43 · 2^-10 ·
// Σ|terms| (k from 16 to 4800). A wrong scale, operand or tile is off by far more at these shapes.
constexpr double kFp8AccumulationBound = 0x1p-8;

std::string gemm_case_name(const GemmCase& g, DType out, int mode) {
  return std::to_string(g.rows) + "x" + std::to_string(g.cols) + "x" + std::to_string(g.k) + " " +
         std::string(fp8_format_name(g.pf)) + "·" + std::string(fp8_format_name(g.qf)) + " -> " +
         std::string(dtype_name(out)) + (mode == 0 ? "" : mode == 1 ? " +=" : " + residual");
}

// Runs d = p · qᵀ (beta 0; mode 1: += d; mode 2: + residual) with the operands on the device and checks every
// element against ref (+ C) within kFp8AccumulationBound of s (Σ|terms|) plus the output's rounding.
void expect_gemm_matches(const std::string& what, const GemmCase& g, DType out, int mode, uint64_t seed,
                         const std::vector<double>& ref, const std::vector<double>& s, const Fp8Operand& p,
                         const Fp8Operand& q) {
  const size_t esz = dtype_size(out);
  Dev dd(ref.size() * esz), dr(ref.size() * esz);
  // The initial d (mode 1) or residual (mode 2): values of the product's size, exact in the output type.
  std::vector<float> c(ref.size(), 0.0f);
  if (mode != 0) {
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < c.size(); ++i) c[i] = float(bf16_t(float(std::sqrt(s[i] + 1e-30)) * normal(rng)));
  }
  const auto upload_out = [&](Dev& d, const std::vector<float>& v) {
    if (out == DType::f32) d.upload(v); else d.upload(to_bf16(v));
  };
  if (mode == 1) upload_out(dd, c); else dd.poison(0xFF);
  if (mode == 2) upload_out(dr, c);
  fp8_gemm_cuda(p, q, dd.ptr(), out, g.rows, g.cols, g.k, mode == 0 ? 0.0f : 1.0f, mode == 2 ? dr.ptr() : nullptr,
                nullptr);
  std::vector<float> got(ref.size());
  if (out == DType::f32) {
    got = dd.download<float>();
  } else {
    const auto b = dd.download<uint16_t>();
    for (size_t i = 0; i < b.size(); ++i) got[i] = std::bit_cast<float>(uint32_t{b[i]} << 16);
  }
  const double u = out == DType::f32 ? 0.0 : 0x1p-8;
  int64_t bad = 0;
  double worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double want = ref[i] + double(c[i]);
    // u·|ref| as well: an algorithm may round the product to a 16-bit output before adding C (test_gemm_cuda).
    const double tol = kFp8AccumulationBound * s[i] + u * (std::fabs(want) + std::fabs(ref[i]) + std::fabs(c[i])) + 1e-30;
    const double ratio = std::fabs(double(got[i]) - want) / tol;
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst)) worst = ratio, worst_at = i;
  }
  EXPECT_EQ(bad, 0) << what << ": worst at " << worst_at << ": got " << got[worst_at] << ", want "
                    << ref[worst_at] + c[worst_at] << ", error/tolerance " << worst;
}

void check_gemm(const GemmCase& g, DType out, int mode) {  // mode 0: beta 0; 1: += d; 2: + residual
  const std::string what = gemm_case_name(g, out, mode);
  float dqp = 0, dqq = 0;
  const uint64_t seed = uint64_t(g.rows * 7 + g.cols * 13 + g.k * 3 + mode);
  const std::vector<uint8_t> p = random_fp8(g.rows * g.k, g.pf, seed, &dqp), q = random_fp8(g.cols * g.k, g.qf, seed + 1, &dqq);
  std::vector<double> ref(size_t(g.rows * g.cols)), s(ref.size());
  fp8_matmul_nt_cpu(p.data(), g.pf, dqp, q.data(), g.qf, dqq, g.rows, g.cols, g.k, ref.data());
  std::vector<uint8_t> pa(p.size()), qa(q.size());
  for (size_t i = 0; i < p.size(); ++i) pa[i] = p[i] & 0x7f;  // |p|, |q|: the magnitude sum
  for (size_t i = 0; i < q.size(); ++i) qa[i] = q[i] & 0x7f;
  fp8_matmul_nt_cpu(pa.data(), g.pf, dqp, qa.data(), g.qf, dqq, g.rows, g.cols, g.k, s.data());

  Dev dp(p.size()), dq(q.size()), dsc(kTwoSlotsBytes);
  dp.upload(p);
  dq.upload(q);
  dsc.upload(two_slots(dqp, dqq));
  expect_gemm_matches(what, g, out, mode, seed, ref, s, {dp.ptr(), g.pf, dsc.as<float>()},
                      {dq.ptr(), g.qf, dsc.as<float>() + kFp8ScaleSlotFloats});
}

}  // namespace

TEST(Fp8Gemm, MatchesTheFp64ProductOfTheSameFp8Operands) {
  SKIP_WITHOUT_GPU();
  const GemmCase cases[] = {
      {16, 16, 16, Fp8Format::e4m3, Fp8Format::e4m3},     {48, 80, 112, Fp8Format::e4m3, Fp8Format::e4m3},
      {128, 96, 2048, Fp8Format::e4m3, Fp8Format::e4m3},  {2048, 64, 48, Fp8Format::e4m3, Fp8Format::e4m3},
      {64, 1600, 4800, Fp8Format::e4m3, Fp8Format::e4m3}, {48, 80, 112, Fp8Format::e5m2, Fp8Format::e4m3},
      {256, 192, 2048, Fp8Format::e5m2, Fp8Format::e4m3}, {48, 80, 112, Fp8Format::e4m3, Fp8Format::e5m2},
      {160, 32, 1024, Fp8Format::e4m3, Fp8Format::e5m2},
  };
  for (const GemmCase& g : cases) {
    for (DType out : {DType::bf16, DType::f32}) {
      for (int mode : {0, 1, 2}) {
        if (mode == 2 && out == DType::f32) continue;  // the residual is the bf16 forward's
        check_gemm(g, out, mode);
      }
    }
  }
}

TEST(Fp8Gemm, RepeatedCallsGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  float dqp = 0, dqq = 0;
  const auto p = random_fp8(256 * 512, Fp8Format::e4m3, 5, &dqp), q = random_fp8(384 * 512, Fp8Format::e4m3, 6, &dqq);
  Dev dp(p.size()), dq(q.size()), dd(256 * 384 * 2), dsc(kTwoSlotsBytes);
  dp.upload(p);
  dq.upload(q);
  dsc.upload(two_slots(dqp, dqq));
  std::vector<uint16_t> first;
  for (int i = 0; i < 3; ++i) {
    dd.poison(0xFF);
    fp8_gemm_cuda({dp.ptr(), Fp8Format::e4m3, dsc.as<float>()}, {dq.ptr(), Fp8Format::e4m3, dsc.as<float>() + kFp8ScaleSlotFloats},
                  dd.ptr(), DType::bf16, 256, 384, 512, 0.0f, nullptr, nullptr);
    const auto got = dd.download<uint16_t>();
    if (i == 0) first = got; else EXPECT_EQ(got, first);
  }
}

TEST(Fp8Gemm, BadArgumentsAreErrors) {
  // Checked before any CUDA call: no GPU needed.
  alignas(16) static uint8_t a[256], b[256], d[1024];
  alignas(16) static float scale[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const Fp8Operand p{a, Fp8Format::e4m3, scale}, q{b, Fp8Format::e4m3, scale};
  const auto gemm = [&](const Fp8Operand& pp, const Fp8Operand& qq, void* dd, DType out, int64_t rows, int64_t k,
                        float beta) { fp8_gemm_cuda(pp, qq, dd, out, rows, 16, k, beta, nullptr, nullptr); };
  expect_error([&] { gemm({a, Fp8Format::e5m2, scale}, {b, Fp8Format::e5m2, scale}, d, DType::bf16, 16, 16, 0); },
               "both e5m2");
  expect_error([&] { gemm(p, q, d, DType::bf16, 8, 16, 0); }, "multiples of 16");
  expect_error([&] { gemm(p, q, d, DType::bf16, 16, 24, 0); }, "multiples of 16");
  expect_error([&] { gemm(p, q, d, DType::f16, 16, 16, 0); }, "expected bf16 or fp32");
  expect_error([&] { gemm(p, q, d, DType::bf16, 16, 16, 0.5f); }, "expected 0 or 1");
  expect_error([&] { gemm({a + 1, Fp8Format::e4m3, scale}, q, d, DType::bf16, 16, 16, 0); }, "16-byte aligned");
  expect_error([&] { gemm({nullptr, Fp8Format::e4m3, scale}, q, d, DType::bf16, 16, 16, 0); }, "p is null");
  // cuBLASLt refuses a scale pointer off 16 bytes (NOT_SUPPORTED from the matmul): an error naming it first.
  expect_error([&] { gemm(p, {b, Fp8Format::e4m3, scale + 1}, d, DType::bf16, 16, 16, 0); },
               "q.dequant = ");
  expect_error([&] { gemm({a, Fp8Format::e4m3, nullptr}, q, d, DType::bf16, 16, 16, 0); }, "p.dequant is null");
  expect_error([&] { gemm(p, q, a, DType::bf16, 16, 16, 0); }, "overlap");
}

// ---------------------------------------------------------------------------------------------------
// Rowwise: the row/column amax and cast kernels bit-exact against the CPU emulation, and the GEMM with scale
// vectors (outer-vector scaling) against the fp64 product of the same FP8 operands and vectors.

namespace {

// The rowwise cast of x [rows, cols] on the GPU (input bf16 or fp32, at `offset` elements past an aligned
// address) against fp8_amax_rows_cols_cpu and fp8_cast_rowwise_cpu: every amax, dequantisation scale and byte.
void check_rowwise_cast(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Format f, bool fp32_input,
                        int64_t offset, const std::string& what) {
  const size_t count = size_t(rows * cols), esz = fp32_input ? 4 : 2;
  std::vector<float> row_amax(static_cast<size_t>(rows)), col_amax(static_cast<size_t>(cols)), row_dq(static_cast<size_t>(rows)), col_dq(static_cast<size_t>(cols));
  std::vector<uint8_t> want_q(count), want_qt(count);
  fp8_amax_rows_cols_cpu(x.data(), rows, cols, row_amax.data(), col_amax.data());
  fp8_cast_rowwise_cpu(x.data(), rows, cols, row_amax.data(), col_amax.data(), f, want_q.data(), want_qt.data(),
                       row_dq.data(), col_dq.data());
  std::vector<float> shifted(count + size_t(offset), 0.0f);
  std::copy(x.begin(), x.end(), shifted.begin() + offset);
  // Four vectors, each on its own 256 bytes past 16-byte aligned starts.
  const auto vec_bytes = [](int64_t n) { return size_t((n * 4 + 255) / 256 * 256); };
  Dev dx(shifted.size() * esz), dq(count), dqt(count), dv(2 * vec_bytes(rows) + 2 * vec_bytes(cols));
  if (fp32_input) dx.upload(shifted); else dx.upload(to_bf16(shifted));
  dq.poison();
  dqt.poison();
  dv.poison();
  uint8_t* base = dv.as<uint8_t>();
  const gpu::Fp8ScaleVectors v{reinterpret_cast<float*>(base), reinterpret_cast<float*>(base + vec_bytes(rows)),
                               reinterpret_cast<float*>(base + vec_bytes(rows) + vec_bytes(cols)),
                               reinterpret_cast<float*>(base + 2 * vec_bytes(rows) + vec_bytes(cols))};
  const auto quantize = [&](uint8_t* q, uint8_t* qt) {
    if (fp32_input) {
      gpu::fp8_quantize_rowwise(dx.as<float>() + offset, rows, cols, f, q, qt, v, nullptr);
    } else {
      gpu::fp8_quantize_rowwise(dx.as<bf16_t>() + offset, rows, cols, f, q, qt, v, nullptr);
    }
  };
  quantize(dq.as<uint8_t>(), dqt.as<uint8_t>());
  const auto vectors = dv.download<float>();
  const auto at = [&](const float* p) { return size_t(p - reinterpret_cast<float*>(base)); };
  // Bit for bit, except that any NaN matches any NaN: a CUDA division's NaN is 0x7fffffff and the host's
  // 0x7fc00000, and a NaN row's bytes are FP8 NaNs whose sign follows that payload's.
  const auto bits_equal = [&](const float* dev, const std::vector<float>& want, const char* name) {
    int64_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const float got = vectors[at(dev) + i];
      bad += std::bit_cast<uint32_t>(got) != std::bit_cast<uint32_t>(want[i]) && !(std::isnan(got) && std::isnan(want[i]));
    }
    EXPECT_EQ(bad, 0) << what << ": " << name << " differ from the CPU emulation's";
  };
  const auto bytes_differing = [&](const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
    int64_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      bad += got[i] != want[i] && !(std::isnan(fp8_decode(got[i], f)) && std::isnan(fp8_decode(want[i], f)));
    }
    return bad;
  };
  bits_equal(v.row_amax, row_amax, "row amaxes");
  bits_equal(v.col_amax, col_amax, "column amaxes");
  bits_equal(v.row_dequant, row_dq, "row dequantisation scales");
  bits_equal(v.col_dequant, col_dq, "column dequantisation scales");
  EXPECT_EQ(bytes_differing(dq.download<uint8_t>(), want_q), 0) << what << ": straight copy (per row)";
  EXPECT_EQ(bytes_differing(dqt.download<uint8_t>(), want_qt), 0) << what << ": transposed copy (per column)";
  // One copy at a time: the same bytes, the other array untouched.
  dq.poison(0x5C);
  dqt.poison(0x5C);
  quantize(nullptr, dqt.as<uint8_t>());
  EXPECT_EQ(bytes_differing(dqt.download<uint8_t>(), want_qt), 0) << what << ": transposed copy alone";
  for (uint8_t b : dq.download<uint8_t>()) ASSERT_EQ(b, 0x5C) << what << ": q written though null";
  quantize(dq.as<uint8_t>(), nullptr);
  EXPECT_EQ(bytes_differing(dq.download<uint8_t>(), want_q), 0) << what << ": straight copy alone";
}

}  // namespace

TEST(Fp8CastRowwise, MatchesTheCpuEmulationBitExactly) {
  SKIP_WITHOUT_GPU();
  // Multiples of 8 take the packed cast, the others (and the misaligned inputs) the byte-wide one; 2048 rows
  // span several tile rows per block of the reduction.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {1, 40},     {17, 33},  {64, 48},
                                                {136, 200}, {100, 257}, {2048, 80}, {33, 2049}};
  uint64_t seed = 300;
  for (auto [rows, cols] : shapes) {
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      for (bool fp32_input : {false, true}) {
        for (int64_t offset : {0, 1}) {
          std::vector<float> x = random_bf16_values(rows * cols, seed++);
          // Rows of very different magnitudes: what rowwise scaling is for.
          for (int64_t r = 0; r < rows; ++r) {
            const float m = std::ldexp(1.0f, int((r * 7) % 41) - 20);
            for (int64_t c = 0; c < cols; ++c) x[size_t(r * cols + c)] = float(bf16_t(m * x[size_t(r * cols + c)]));
          }
          const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   std::string(fp8_format_name(f)) + (fp32_input ? " fp32" : " bf16") +
                                   (offset ? " misaligned" : "");
          check_rowwise_cast(x, rows, cols, f, fp32_input, offset, what);
        }
      }
    }
  }
}

// NaN, infinite and zero rows (and so columns through them): the CPU emulation's bits, spelled out there
// (Fp8Rowwise.RowsAndColumnsAreQuantisedEachAlone).
TEST(Fp8CastRowwise, NaNInfAndZeroRowsMatchTheCpuEmulation) {
  SKIP_WITHOUT_GPU();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{48, 32}, {37, 29}}) {
    std::vector<float> x = random_bf16_values(rows * cols, 77);
    for (int64_t c = 0; c < cols; ++c) x[size_t(5 * cols + c)] = 0.0f;  // a zero row
    x[size_t(7 * cols + 3)] = NAN;
    x[size_t(11 * cols + 4)] = -INFINITY;
    for (int64_t r = 0; r < rows; ++r) x[size_t(r * cols + cols - 1)] = 0.0f;  // a zero column
    for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      for (bool fp32_input : {false, true}) {
        check_rowwise_cast(x, rows, cols, f, fp32_input, 0,
                           std::to_string(rows) + "x" + std::to_string(cols) + " special rows " +
                               std::string(fp8_format_name(f)) + (fp32_input ? " fp32" : " bf16"));
      }
    }
  }
}

namespace {

// The rowwise GEMM: operands quantised per row by the CPU emulation, their vectors uploaded 16-byte aligned,
// against fp8_matmul_nt_rowwise_cpu; check_gemm's tolerance, s the product of the magnitudes with the same
// vectors.
void check_gemm_rowwise(const GemmCase& g, DType out, int mode) {  // mode 0: beta 0; 1: += d; 2: + residual
  const std::string what = gemm_case_name(g, out, mode) + ", per-row scales";
  const uint64_t seed = uint64_t(g.rows * 5 + g.cols * 11 + g.k * 17 + mode);
  const auto quantise_rows = [](int64_t rows, int64_t k, Fp8Format f, uint64_t sd, std::vector<float>* dequant) {
    std::vector<float> v = random_bf16_values(rows * k, sd);
    for (int64_t r = 0; r < rows; ++r) {  // rows of different magnitudes
      for (int64_t i = 0; i < k; ++i) v[size_t(r * k + i)] *= std::ldexp(1.0f, int((r * 5) % 17) - 8);
    }
    std::vector<float> amax(static_cast<size_t>(rows));
    std::vector<uint8_t> q(v.size());
    dequant->resize(size_t(rows));
    fp8_amax_rows_cols_cpu(v.data(), rows, k, amax.data(), nullptr);
    fp8_cast_rowwise_cpu(v.data(), rows, k, amax.data(), nullptr, f, q.data(), nullptr, dequant->data(), nullptr);
    return q;
  };
  std::vector<float> dqp, dqq;
  const std::vector<uint8_t> p = quantise_rows(g.rows, g.k, g.pf, seed, &dqp), q = quantise_rows(g.cols, g.k, g.qf, seed + 1, &dqq);
  std::vector<double> ref(size_t(g.rows * g.cols)), s(ref.size());
  fp8_matmul_nt_rowwise_cpu(p.data(), g.pf, dqp.data(), q.data(), g.qf, dqq.data(), g.rows, g.cols, g.k, ref.data());
  std::vector<uint8_t> pa(p.size()), qa(q.size());
  for (size_t i = 0; i < p.size(); ++i) pa[i] = p[i] & 0x7f;
  for (size_t i = 0; i < q.size(); ++i) qa[i] = q[i] & 0x7f;
  fp8_matmul_nt_rowwise_cpu(pa.data(), g.pf, dqp.data(), qa.data(), g.qf, dqq.data(), g.rows, g.cols, g.k, s.data());

  const size_t q_vec_at = size_t((g.rows + 63) / 64 * 64);  // q's vector 256 bytes past a multiple of p's
  std::vector<float> vectors(q_vec_at + size_t(g.cols), 0.0f);
  std::copy(dqp.begin(), dqp.end(), vectors.begin());
  std::copy(dqq.begin(), dqq.end(), vectors.begin() + std::ptrdiff_t(q_vec_at));
  Dev dp(p.size()), dq(q.size()), dv(vectors.size() * 4);
  dp.upload(p);
  dq.upload(q);
  dv.upload(vectors);
  expect_gemm_matches(what, g, out, mode, seed, ref, s, {dp.ptr(), g.pf, dv.as<float>(), Fp8Scaling::per_row},
                      {dq.ptr(), g.qf, dv.as<float>() + q_vec_at, Fp8Scaling::per_row});
}

}  // namespace

// The three products of a rowwise layer (forward bf16 out, dx bf16, dw fp32), both gradient formats in p.
TEST(Fp8Gemm, PerRowScalesMatchTheFp64Product) {
  SKIP_WITHOUT_GPU();
  const GemmCase cases[] = {
      {16, 16, 16, Fp8Format::e4m3, Fp8Format::e4m3},     {48, 80, 112, Fp8Format::e4m3, Fp8Format::e4m3},
      {2048, 64, 48, Fp8Format::e4m3, Fp8Format::e4m3},   {64, 1600, 4800, Fp8Format::e4m3, Fp8Format::e4m3},
      {48, 80, 112, Fp8Format::e5m2, Fp8Format::e4m3},    {256, 192, 2048, Fp8Format::e5m2, Fp8Format::e4m3},
      {48, 80, 112, Fp8Format::e4m3, Fp8Format::e5m2},
  };
  for (const GemmCase& g : cases) {
    for (DType out : {DType::bf16, DType::f32}) {
      for (int mode : {0, 1, 2}) {
        if (mode == 2 && out == DType::f32) continue;
        check_gemm_rowwise(g, out, mode);
      }
    }
  }
}

TEST(Fp8Gemm, PerRowScaleVectorsAreChecked) {
  // Checked before any CUDA call: no GPU needed.
  alignas(16) static uint8_t a[256], b[256], d[1024];
  alignas(16) static float scale[40] = {};
  const auto gemm = [&](const Fp8Operand& pp, const Fp8Operand& qq, void* dd) {
    fp8_gemm_cuda(pp, qq, dd, DType::bf16, 16, 16, 16, 0.0f, nullptr, nullptr);
  };
  const Fp8Operand p{a, Fp8Format::e4m3, scale, Fp8Scaling::per_row}, q{b, Fp8Format::e4m3, scale + 16, Fp8Scaling::per_row};
  expect_error([&] { gemm(p, {b, Fp8Format::e4m3, scale + 17, Fp8Scaling::per_row}, d); }, "q.dequant = ");
  expect_error([&] { gemm({a, Fp8Format::e4m3, nullptr, Fp8Scaling::per_row}, q, d); }, "p.dequant is null");
  // d over p's 16 scales: they are read while d is written.
  expect_error([&] { gemm(p, q, scale); }, "overlap");
}

// ---------------------------------------------------------------------------------------------------
// CudaModel's FP8 linear layer: casts and GEMMs chained, against the emulated layer from the same bf16
// inputs (the same quantised operands, so the same fp64 reference), forward with and without the residual,
// dx = and +=, dw = and += (fp32), both gradient formats.

namespace {

// The layer tests' model: d_model 64, d_ff 160 (the Fp8Linear widths they use: 64 in, 160 out).
ModelConfig layer_test_config() {
  ModelConfig c = ModelConfig::named("tiny", 64, 128);
  c.d_model = 64;
  c.d_ff = 160;
  return c;
}

}  // namespace

namespace {

void expect_layer_matches_the_emulated_one(Fp8Recipe recipe) {
  const ModelConfig c = layer_test_config();
  const int64_t n = 96;
  const std::pair<int64_t, int64_t> layers[] = {{64, 192}, {64, 64}, {64, 160}, {160, 64}};  // qkv, proj, w1, w2
  uint64_t seed = 40;
  for (Fp8Format g : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    Fp8Linear fp8(c, n, g, recipe);
    for (auto [in, out] : layers) {
      const std::string what = std::to_string(in) + " -> " + std::to_string(out) + ", " +
                               std::string(fp8_format_name(g)) + " gradients, " +
                               std::string(fp8_recipe_name(recipe));
      const std::vector<float> x = random_bf16_values(n * in, seed++), w = random_bf16_values(out * in, seed++),
                               dy = random_bf16_values(n * out, seed++), r = random_bf16_values(n * out, seed++),
                               dx0 = random_bf16_values(n * in, seed++), dw0 = random_bf16_values(out * in, seed++);
      Dev dx_(x.size() * 2), dw_(w.size() * 2), ddy(dy.size() * 2), dr(r.size() * 2), dy_out(dy.size() * 2),
          ddx(x.size() * 2), ddw(w.size() * 4);
      dx_.upload(to_bf16(x));
      dw_.upload(to_bf16(w));
      ddy.upload(to_bf16(dy));
      dr.upload(to_bf16(r));
      std::vector<double> y(size_t(n * out)), gx(size_t(n * in)), gw(size_t(out * in));
      fp8_linear_forward_cpu(x.data(), w.data(), y.data(), n, in, out, recipe);
      fp8_linear_backward_cpu(dy.data(), x.data(), w.data(), gx.data(), gw.data(), n, in, out, g, recipe);
      // Magnitude sums for the tolerance: the exact products of |x|, |w|, |dy| bound the FP8 ones' within 13%.
      const auto absmat = [](const std::vector<float>& a, const std::vector<float>& b, int64_t rows, int64_t cols,
                             int64_t k, bool a_t, bool b_t) {
        std::vector<double> s(size_t(rows * cols));
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < cols; ++j) {
            double acc = 0;
            for (int64_t t = 0; t < k; ++t) {
              const float av = a_t ? a[size_t(t * rows + i)] : a[size_t(i * k + t)];
              const float bv = b_t ? b[size_t(j * k + t)] : b[size_t(t * cols + j)];
              acc += std::fabs(double(av) * bv);
            }
            s[size_t(i * cols + j)] = 1.2 * acc;
          }
        }
        return s;
      };
      const auto check = [&](const std::vector<float>& got, const std::vector<double>& want,
                             const std::vector<double>& s, double u, const std::string& name) {
        int64_t bad = 0;
        size_t worst_at = 0;
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          const double tol = kFp8AccumulationBound * s[i] + u * 2 * std::fabs(want[i]) + 1e-30;
          const double ratio = std::fabs(double(got[i]) - want[i]) / tol;
          if (!(ratio <= 1.0)) ++bad;
          if (!(ratio <= worst)) worst = ratio, worst_at = i;
        }
        EXPECT_EQ(bad, 0) << what << ", " << name << ": worst at " << worst_at << ": got " << got[worst_at]
                          << ", want " << want[worst_at] << ", error/tolerance " << worst;
      };
      const auto bf16_down = [](const Dev& d) {
        const auto b = d.download<uint16_t>();
        std::vector<float> v(b.size());
        for (size_t i = 0; i < b.size(); ++i) v[i] = std::bit_cast<float>(uint32_t{b[i]} << 16);
        return v;
      };
      const std::vector<double> sy = absmat(x, transposed(w, out, in), n, out, in, false, false);
      const std::vector<double> sx = absmat(dy, w, n, in, out, false, false);
      const std::vector<double> sw = absmat(dy, x, out, in, n, true, false);

      dy_out.poison(0xFF);
      fp8.forward(dx_.as<bf16_t>(), dw_.as<bf16_t>(), nullptr, dy_out.as<bf16_t>(), in, out, nullptr);
      check(bf16_down(dy_out), y, sy, 0x1p-8, "forward");
      fp8.forward(dx_.as<bf16_t>(), dw_.as<bf16_t>(), dr.as<bf16_t>(), dy_out.as<bf16_t>(), in, out, nullptr);
      std::vector<double> yr(y);
      for (size_t i = 0; i < yr.size(); ++i) yr[i] += r[i];
      std::vector<double> syr(sy);
      for (size_t i = 0; i < syr.size(); ++i) syr[i] += 1024.0 * 0x1p-8 * std::fabs(r[i]);
      check(bf16_down(dy_out), yr, syr, 0x1p-8, "forward + residual");

      ddx.poison(0xFF);
      ddw.poison(0xFF);
      fp8.backward(ddy.as<bf16_t>(), dx_.as<bf16_t>(), dw_.as<bf16_t>(), ddx.as<bf16_t>(), ddw.as<float>(), in, out,
                   false, false, nullptr);
      check(bf16_down(ddx), gx, sx, 0x1p-8, "dx =");
      check(ddw.download<float>(), gw, sw, 0.0, "dw =");
      // Accumulating: dx += onto bf16 values, dw += onto fp32 ones.
      ddx.upload(to_bf16(dx0));
      ddw.upload(dw0);
      fp8.backward(ddy.as<bf16_t>(), dx_.as<bf16_t>(), dw_.as<bf16_t>(), ddx.as<bf16_t>(), ddw.as<float>(), in, out,
                   true, true, nullptr);
      std::vector<double> gx_acc(gx), gw_acc(gw), sx_acc(sx);
      for (size_t i = 0; i < gx.size(); ++i) gx_acc[i] += dx0[i], sx_acc[i] += 1024.0 * 0x1p-8 * std::fabs(dx0[i]);
      for (size_t i = 0; i < gw.size(); ++i) gw_acc[i] += dw0[i];
      check(bf16_down(ddx), gx_acc, sx_acc, 0x1p-8, "dx +=");
      check(ddw.download<float>(), gw_acc, sw, 0.0, "dw +=");
    }
  }
}

}  // namespace

TEST(Fp8Linear, MatchesTheEmulatedLayer) {
  SKIP_WITHOUT_GPU();
  expect_layer_matches_the_emulated_one(Fp8Recipe::tensorwise);
}

// Rowwise: the same chain with the row and column casts and the vector-scaled GEMMs, against the emulated
// rowwise layer (each operand scaled per row of the dimension its product does not sum over).
TEST(Fp8Linear, RowwiseMatchesTheEmulatedLayer) {
  SKIP_WITHOUT_GPU();
  expect_layer_matches_the_emulated_one(Fp8Recipe::rowwise);
}

// A named weight's FP8 copies are cast at its first product of a pass and reused by the pass's later ones (the
// backward's dx): the same bits as casting each time; a new pass casts the weight as it is then.
namespace {

void expect_named_weights_cast_once_per_pass(Fp8Recipe recipe) {
  const ModelConfig c = layer_test_config();
  const int64_t n = 96, in = 64, out = 160;
  Fp8Linear cached(c, n, Fp8Format::e5m2, recipe), fresh(c, n, Fp8Format::e5m2, recipe);
  // Tensorwise also: the weight listed to begin_pass (its amax reduced there, its cast alone) and the input's
  // transposed copy kept from the forward for the backward (keep_inputs): the same bits.
  const bool tensorwise = recipe == Fp8Recipe::tensorwise;
  Fp8Linear listed(c, n, Fp8Format::e5m2, recipe, /*keep_inputs*/ tensorwise);
  const std::vector<float> x = random_bf16_values(n * in, 71), w1 = random_bf16_values(out * in, 72),
                           w2 = random_bf16_values(out * in, 73), dy = random_bf16_values(n * out, 74);
  Dev dx(x.size() * 2), dw(w1.size() * 2), ddy(dy.size() * 2), y_a(dy.size() * 2), y_b(dy.size() * 2),
      gx_a(x.size() * 2), gx_b(x.size() * 2), gw_a(w1.size() * 4), gw_b(w1.size() * 4), y_c(dy.size() * 2),
      gx_c(x.size() * 2), gw_c(w1.size() * 4);
  dx.upload(to_bf16(x));
  ddy.upload(to_bf16(dy));
  for (const std::vector<float>* w : {&w1, &w2}) {
    const std::string what = w == &w1 ? "first pass" : "second pass, the weight changed";
    dw.upload(to_bf16(*w));
    cached.begin_pass();
    const Fp8WeightRef ref{"layers.0.ffn.w1", dw.as<bf16_t>(), in, out};
    listed.begin_pass(tensorwise ? std::span(&ref, 1) : std::span<const Fp8WeightRef>{}, nullptr);
    for (Dev* d : {&y_a, &y_b, &gx_a, &gx_b, &gw_a, &gw_b, &y_c, &gx_c, &gw_c}) d->poison(0xFF);
    cached.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_a.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w1");
    cached.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_a.as<bf16_t>(), gw_a.as<float>(), in, out,
                    false, false, nullptr, "layers.0.ffn.w1");
    fresh.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_b.as<bf16_t>(), in, out, nullptr);
    fresh.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_b.as<bf16_t>(), gw_b.as<float>(), in, out,
                   false, false, nullptr);
    listed.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_c.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w1");
    listed.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_c.as<bf16_t>(), gw_c.as<float>(), in, out,
                    false, false, nullptr, "layers.0.ffn.w1");
    EXPECT_EQ(y_a.download<uint16_t>(), y_b.download<uint16_t>()) << what << ": y";
    EXPECT_EQ(gx_a.download<uint16_t>(), gx_b.download<uint16_t>()) << what << ": dx";
    EXPECT_EQ(gw_a.download<uint32_t>(), gw_b.download<uint32_t>()) << what << ": dw";
    EXPECT_EQ(y_c.download<uint16_t>(), y_b.download<uint16_t>()) << what << ": y, listed weight, kept input";
    EXPECT_EQ(gx_c.download<uint16_t>(), gx_b.download<uint16_t>()) << what << ": dx, listed weight, kept input";
    EXPECT_EQ(gw_c.download<uint32_t>(), gw_b.download<uint32_t>()) << what << ": dw, listed weight, kept input";
  }
  // Within a pass the cached copies stand for the weight: a weight rewritten mid-pass is not seen (the model
  // never does that; begin_pass() is where a changed weight is picked up).
  const auto y_w2 = y_a.download<uint16_t>();
  dw.upload(to_bf16(w1));
  cached.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_a.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w1");
  EXPECT_EQ(y_a.download<uint16_t>(), y_w2);
  // A name seen with another shape, or more weights than the model's blocks hold, is an error.
  expect_error([&] { cached.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_a.as<bf16_t>(), in, 64, nullptr,
                                    "layers.0.ffn.w1"); }, "was 10240 elements");
  expect_error([&] {
    for (int i = 0; i < 1000; ++i) {
      cached.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_a.as<bf16_t>(), in, out, nullptr, std::to_string(i));
    }
  }, "does not fit the FP8 weight cache");
}

}  // namespace

// Many tensors' amaxes in one launch (the weights' at the start of a pass): each segment's amax is fp8_amax's,
// over ragged sizes (one element, under a pack, one chunk and a bit, several chunks), a misaligned start, a
// NaN in one segment only, an all-zero one.
TEST(Fp8Cast, AmaxSegmentsGiveEachTensorsAmax) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> counts = {1, 7, gpu::kFp8AmaxChunk + 3, 3 * gpu::kFp8AmaxChunk, 1000, 64};
  std::vector<int64_t> offsets;
  int64_t total = 1;  // segment 1 starts one element in: misaligned for 16-byte loads
  for (int64_t n : counts) offsets.push_back(total), total += n + 8;
  std::vector<float> values = random_bf16_values(total, 91);
  values[size_t(offsets[3] + 12345)] = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < counts[4]; ++i) values[size_t(offsets[4] + i)] = 0.0f;
  Dev x(size_t(total) * 2), amaxes(counts.size() * 16), expected(counts.size() * 16), table(counts.size() * sizeof(gpu::Fp8AmaxSegment));
  x.upload(to_bf16(values));
  std::vector<gpu::Fp8AmaxSegment> host;
  int64_t chunks = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    host.push_back({x.as<bf16_t>() + offsets[i], counts[i], chunks, amaxes.as<float>() + 4 * i});
    chunks += gpu::fp8_amax_chunks(counts[i]);
    gpu::fp8_amax(x.as<bf16_t>() + offsets[i], counts[i], expected.as<float>() + 4 * i, nullptr);
  }
  table.upload(host);
  amaxes.poison(0);
  gpu::fp8_amax_segments(table.as<gpu::Fp8AmaxSegment>(), int(host.size()), chunks, nullptr);
  const std::vector<uint32_t> got = amaxes.download<uint32_t>(), want = expected.download<uint32_t>();
  for (size_t i = 0; i < counts.size(); ++i) {
    EXPECT_EQ(got[4 * i], want[4 * i]) << "segment " << i << " of " << counts[i] << " elements";
  }
  EXPECT_TRUE(std::isnan(std::bit_cast<float>(got[4 * 3])));
  EXPECT_EQ(got[4 * 4], 0u);
  EXPECT_GT(std::bit_cast<float>(got[0]), 0.0f);
  expect_error([&] { gpu::fp8_amax_segments(table.as<gpu::Fp8AmaxSegment>(), 0, chunks, nullptr); }, "segments");
}

TEST(Fp8Linear, NamedWeightsAreCastOncePerPass) {
  SKIP_WITHOUT_GPU();
  expect_named_weights_cast_once_per_pass(Fp8Recipe::tensorwise);
}

// Rowwise: the cached copies with their scale vectors give the bits of casting each time.
TEST(Fp8Linear, RowwiseNamedWeightsAreCastOncePerPass) {
  SKIP_WITHOUT_GPU();
  expect_named_weights_cast_once_per_pass(Fp8Recipe::rowwise);
}

// w1 and w3 of the feed-forward read one input: the second product reuses the first's cast of x (forward)
// and of xᵀ (backward), with the bits of casting it afresh; a stale or different input is refused.
namespace {

void expect_products_of_one_input_share_its_cast(Fp8Recipe recipe) {
  const ModelConfig c = layer_test_config();
  const int64_t n = 96, in = 64, out = 160;
  Fp8Linear shared(c, n, Fp8Format::e4m3, recipe), fresh(c, n, Fp8Format::e4m3, recipe);
  const std::vector<float> x = random_bf16_values(n * in, 81), x2 = random_bf16_values(n * in, 82),
                           wa = random_bf16_values(out * in, 83), wb = random_bf16_values(out * in, 84),
                           dya = random_bf16_values(n * out, 85), dyb = random_bf16_values(n * out, 86);
  Dev dx{x.size() * 2}, dx2{x.size() * 2}, dwa{wa.size() * 2}, dwb{wb.size() * 2}, ddya{dya.size() * 2},
      ddyb{dyb.size() * 2}, ya{dya.size() * 2}, yb{dya.size() * 2}, yb_fresh{dya.size() * 2}, gxa{x.size() * 2},
      gxb{x.size() * 2}, gxb_fresh{x.size() * 2}, gwa{wa.size() * 4}, gwb{wa.size() * 4}, gwb_fresh{wa.size() * 4};
  dx.upload(to_bf16(x));
  dx2.upload(to_bf16(x2));
  dwa.upload(to_bf16(wa));
  dwb.upload(to_bf16(wb));
  ddya.upload(to_bf16(dya));
  ddyb.upload(to_bf16(dyb));
  for (Dev* d : {&yb, &yb_fresh, &gxb, &gxb_fresh, &gwb, &gwb_fresh}) d->poison(0xFF);
  shared.begin_pass();
  shared.forward(dx.as<bf16_t>(), dwa.as<bf16_t>(), nullptr, ya.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w1");
  shared.forward(dx.as<bf16_t>(), dwb.as<bf16_t>(), nullptr, yb.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w3",
                 /*same_input*/ true);
  fresh.forward(dx.as<bf16_t>(), dwb.as<bf16_t>(), nullptr, yb_fresh.as<bf16_t>(), in, out, nullptr);
  EXPECT_EQ(yb.download<uint16_t>(), yb_fresh.download<uint16_t>()) << "y of the second product";
  // Another x, or the first product's x after a backward overwrote the scratch: refused.
  expect_error([&] { shared.forward(dx2.as<bf16_t>(), dwb.as<bf16_t>(), nullptr, yb.as<bf16_t>(), in, out, nullptr,
                                    "layers.0.ffn.w3", true); }, "holds no cast of this x");

  shared.backward(ddya.as<bf16_t>(), dx.as<bf16_t>(), dwa.as<bf16_t>(), gxa.as<bf16_t>(), gwa.as<float>(), in, out,
                  false, false, nullptr, "layers.0.ffn.w1");
  // dx accumulates onto the first product's, as the feed-forward's dh does.
  const std::vector<uint16_t> dx_first = gxa.download<uint16_t>();
  gxb.upload(dx_first);
  gxb_fresh.upload(dx_first);
  shared.backward(ddyb.as<bf16_t>(), dx.as<bf16_t>(), dwb.as<bf16_t>(), gxb.as<bf16_t>(), gwb.as<float>(), in, out,
                  true, false, nullptr, "layers.0.ffn.w3", /*same_input*/ true);
  fresh.backward(ddyb.as<bf16_t>(), dx.as<bf16_t>(), dwb.as<bf16_t>(), gxb_fresh.as<bf16_t>(), gwb_fresh.as<float>(),
                 in, out, true, false, nullptr);
  EXPECT_EQ(gxb.download<uint16_t>(), gxb_fresh.download<uint16_t>()) << "dx of the second product";
  EXPECT_EQ(gwb.download<uint32_t>(), gwb_fresh.download<uint32_t>()) << "dw of the second product";
  expect_error([&] { shared.forward(dx.as<bf16_t>(), dwb.as<bf16_t>(), nullptr, yb.as<bf16_t>(), in, out, nullptr,
                                    "layers.0.ffn.w3", true); }, "holds no cast of this x");
  expect_error([&] { shared.backward(ddyb.as<bf16_t>(), dx2.as<bf16_t>(), dwb.as<bf16_t>(), gxb.as<bf16_t>(),
                                     gwb.as<float>(), in, out, false, false, nullptr, "layers.0.ffn.w3", true); },
               "holds no cast of this xᵀ");
  // A new pass forgets both casts.
  shared.forward(dx.as<bf16_t>(), dwa.as<bf16_t>(), nullptr, ya.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w1");
  shared.begin_pass();
  expect_error([&] { shared.forward(dx.as<bf16_t>(), dwb.as<bf16_t>(), nullptr, yb.as<bf16_t>(), in, out, nullptr,
                                    "layers.0.ffn.w3", true); }, "holds no cast of this x");
}

}  // namespace

TEST(Fp8Linear, ProductsOfOneInputShareItsCast) {
  SKIP_WITHOUT_GPU();
  expect_products_of_one_input_share_its_cast(Fp8Recipe::tensorwise);
}

// Rowwise: the shared casts carry their scale vectors (x's row scales forward, xᵀ's column scales backward).
TEST(Fp8Linear, RowwiseProductsOfOneInputShareItsCast) {
  SKIP_WITHOUT_GPU();
  expect_products_of_one_input_share_its_cast(Fp8Recipe::rowwise);
}

// Rowwise reduces per row and column itself: no producer amaxes, and one handed in is an error.
TEST(Fp8Linear, RowwiseTakesNoProducerAmax) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = layer_test_config();
  const int64_t n = 96, in = 64, out = 160;
  Fp8Linear rowwise(c, n, Fp8Format::e5m2, Fp8Recipe::rowwise);
  EXPECT_EQ(rowwise.produced_amax(0, Fp8Produced::h1), nullptr);
  Dev dx{size_t(n * in) * 2}, dw{size_t(out * in) * 2}, dy{size_t(n * out) * 2}, amax{16}, gx{size_t(n * in) * 2};
  expect_error([&] { rowwise.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, dy.as<bf16_t>(), in, out, nullptr, {},
                                     false, amax.as<float>()); }, "x_amax given");
  expect_error([&] { rowwise.backward(dy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx.as<bf16_t>(), nullptr, in,
                                      out, false, false, nullptr, {}, false, amax.as<float>()); }, "dy_amax given");
}

// An amax handed in by the tensor's producer (x_amax, dy_amax) stands for the reduction the layer would do:
// the same bits forward and backward (the backward's xᵀ cast reads the producer's amax too).
TEST(Fp8Linear, ProducerAmaxGivesTheBitsOfReducingHere) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = layer_test_config();
  const int64_t n = 96, in = 64, out = 160;
  Fp8Linear given(c, n, Fp8Format::e5m2), fresh(c, n, Fp8Format::e5m2);
  const std::vector<float> x = random_bf16_values(n * in, 91), w = random_bf16_values(out * in, 92),
                           dy = random_bf16_values(n * out, 93);
  Dev dx{x.size() * 2}, dw{w.size() * 2}, ddy{dy.size() * 2}, amax{2 * kFp8ScaleSlotFloats * sizeof(float)},
      y_a{dy.size() * 2}, y_b{dy.size() * 2}, gx_a{x.size() * 2}, gx_b{x.size() * 2}, gw_a{w.size() * 4},
      gw_b{w.size() * 4};
  dx.upload(to_bf16(x));
  dw.upload(to_bf16(w));
  ddy.upload(to_bf16(dy));
  gpu::fp8_amax(dx.as<bf16_t>(), n * in, amax.as<float>(), nullptr);
  gpu::fp8_amax(ddy.as<bf16_t>(), n * out, amax.as<float>() + kFp8ScaleSlotFloats, nullptr);
  for (Dev* d : {&y_a, &y_b, &gx_a, &gx_b, &gw_a, &gw_b}) d->poison(0xFF);
  given.begin_pass();
  given.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_a.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w2",
                false, amax.as<float>());
  given.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_a.as<bf16_t>(), gw_a.as<float>(), in, out,
                 false, false, nullptr, "layers.0.ffn.w2", false, amax.as<float>() + kFp8ScaleSlotFloats);
  fresh.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_b.as<bf16_t>(), in, out, nullptr);
  fresh.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_b.as<bf16_t>(), gw_b.as<float>(), in, out,
                 false, false, nullptr);
  EXPECT_EQ(y_a.download<uint16_t>(), y_b.download<uint16_t>()) << "y";
  EXPECT_EQ(gx_a.download<uint16_t>(), gx_b.download<uint16_t>()) << "dx";
  EXPECT_EQ(gw_a.download<uint32_t>(), gw_b.download<uint32_t>()) << "dw";
  // The amaxes handed in are the ones read: three times the true ones (not a power of two, which would only
  // shift the codes' exponents) round the values to other FP8 codes.
  std::vector<float> tripled = amax.download<float>();
  tripled[0] *= 3.0f;
  tripled[kFp8ScaleSlotFloats] *= 3.0f;
  amax.upload(tripled);
  given.begin_pass();
  given.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_a.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w2",
                false, amax.as<float>());
  given.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_a.as<bf16_t>(), gw_a.as<float>(), in, out,
                 false, false, nullptr, "layers.0.ffn.w2", false, amax.as<float>() + kFp8ScaleSlotFloats);
  EXPECT_NE(y_a.download<uint16_t>(), y_b.download<uint16_t>()) << "y with three times x's amax";
  EXPECT_NE(gx_a.download<uint16_t>(), gx_b.download<uint16_t>()) << "dx with three times dy's amax";
  EXPECT_NO_THROW(given.produced_amax(c.layers - 1, Fp8Produced::dg));
  expect_error([&] { given.produced_amax(c.layers, Fp8Produced::h1); }, "produced_amax");
}

// The weights' amaxes from their writer (the AdamW step's StoredAmaxes into weight_amax's slots): a begin_pass
// right after set_weight_amaxes_current takes the slots as they are (here planted at three times the true amax,
// so that taking them shows in the slot), once; the next pass, or one over another list, or one after
// weights_changed(), reduces the weights again (fp8_amax's bits). Rowwise has no such slots.
TEST(Fp8Linear, WeightAmaxesFromTheirWriterAreTakenOnce) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = layer_test_config();
  const int64_t n = 96, in = 64, out = 160;
  Fp8Linear layer(c, n, Fp8Format::e5m2);
  const std::vector<float> w1 = random_bf16_values(out * in, 94), w2 = random_bf16_values(out * in, 95);
  Dev dw1{w1.size() * 2}, dw2{w2.size() * 2}, want{2 * sizeof(float)};
  dw1.upload(to_bf16(w1));
  dw2.upload(to_bf16(w2));
  gpu::fp8_amax(dw1.as<bf16_t>(), out * in, want.as<float>(), nullptr);
  gpu::fp8_amax(dw2.as<bf16_t>(), out * in, want.as<float>() + 1, nullptr);
  const std::vector<float> truth = want.download<float>();
  const std::vector<Fp8WeightRef> both = {{"layers.0.ffn.w1.weight", dw1.as<bf16_t>(), in, out},
                                          {"layers.0.ffn.w3.weight", dw2.as<bf16_t>(), in, out}};
  float* slots[2] = {layer.weight_amax(both[0]), layer.weight_amax(both[1])};
  const auto slot = [&](int i) {
    float v = 0;
    cuda_stream_synchronize(nullptr);
    cuda_copy(&v, slots[i], sizeof v);
    return v;
  };
  const auto plant = [&] {  // what a writer would have left, distinguishable from the reduction's
    layer.clear_weight_amaxes(nullptr);
    for (int i = 0; i < 2; ++i) {
      const float planted = 3.0f * truth[size_t(i)];
      cuda_stream_synchronize(nullptr);
      cuda_copy(slots[i], &planted, sizeof planted);
    }
    layer.set_weight_amaxes_current(both);
  };
  plant();
  EXPECT_TRUE(layer.weight_amaxes_current());
  layer.begin_pass(both, nullptr);
  EXPECT_FALSE(layer.weight_amaxes_current());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(slot(i), 3.0f * truth[size_t(i)]) << "taken as written, weight " << i;
  layer.begin_pass(both, nullptr);  // taken once
  for (int i = 0; i < 2; ++i) EXPECT_EQ(std::bit_cast<uint32_t>(slot(i)), std::bit_cast<uint32_t>(truth[size_t(i)]));
  plant();
  layer.weights_changed();  // a load, an init, a pointer handed out
  layer.begin_pass(both, nullptr);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(slot(i), truth[size_t(i)]) << "stale: reduced, weight " << i;
  plant();
  layer.begin_pass(std::span(both).first(1), nullptr);  // another list than the writer's
  EXPECT_EQ(slot(0), truth[0]);

  Fp8Linear rowwise(c, n, Fp8Format::e5m2, Fp8Recipe::rowwise);
  expect_error([&] { rowwise.weight_amax(both[0]); }, "rowwise");
  Fp8Linear unnamed(c, n, Fp8Format::e5m2);
  expect_error([&] { unnamed.set_weight_amaxes_current(both); }, "no amax slot");
}

// FSDP's FP8 gather hands a named weight over as e4m3 bytes and a scale slot (Fp8LinearWeight): the forward
// multiplies the bytes as they stand and the backward's dx product their transpose. Bytes from the cast of the
// bf16 weight (what the gather writes, bit for bit: tests/dist/test_fp8_gather.cpp) give y, dx and dw bit for
// bit as the bf16 weight cast by the layer (both operands 256-byte aligned, so the GEMMs' plans are the same);
// rowwise refuses them, and bytes without a scale slot are refused.
TEST(Fp8Linear, GatheredBytesGiveTheBitsOfCastingTheBf16Weight) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = layer_test_config();
  const int64_t n = 96, in = 64, out = 160;
  Fp8Linear gathered(c, n, Fp8Format::e5m2), cast(c, n, Fp8Format::e5m2);
  const std::vector<float> x = random_bf16_values(n * in, 101), w = random_bf16_values(out * in, 102),
                           dy = random_bf16_values(n * out, 103);
  Dev dx{x.size() * 2}, dw{w.size() * 2}, ddy{dy.size() * 2}, q{w.size()}, slot{kFp8ScaleSlotFloats * sizeof(float)},
      y_a{dy.size() * 2}, y_b{dy.size() * 2}, gx_a{x.size() * 2}, gx_b{x.size() * 2}, gw_a{w.size() * 4},
      gw_b{w.size() * 4};
  dx.upload(to_bf16(x));
  dw.upload(to_bf16(w));
  ddy.upload(to_bf16(dy));
  gpu::fp8_quantize(dw.as<bf16_t>(), out, in, Fp8Format::e4m3, q.as<uint8_t>(), nullptr, slot.as<float>(), nullptr);
  const Fp8LinearWeight bytes(q.as<uint8_t>(), slot.as<float>());
  for (Dev* d : {&y_a, &y_b, &gx_a, &gx_b, &gw_a, &gw_b}) d->poison(0xFF);
  for (int pass = 0; pass < 2; ++pass) {  // the second pass: the named weight's entry exists
    gathered.begin_pass();
    cast.begin_pass();
    gathered.forward(dx.as<bf16_t>(), bytes, nullptr, y_a.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w2");
    gathered.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), bytes, gx_a.as<bf16_t>(), gw_a.as<float>(), in, out, false,
                      false, nullptr, "layers.0.ffn.w2");
    cast.forward(dx.as<bf16_t>(), dw.as<bf16_t>(), nullptr, y_b.as<bf16_t>(), in, out, nullptr, "layers.0.ffn.w2");
    cast.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), dw.as<bf16_t>(), gx_b.as<bf16_t>(), gw_b.as<float>(), in, out,
                  false, false, nullptr, "layers.0.ffn.w2");
    EXPECT_EQ(y_a.download<uint16_t>(), y_b.download<uint16_t>()) << "y, pass " << pass;
    EXPECT_EQ(gx_a.download<uint16_t>(), gx_b.download<uint16_t>()) << "dx, pass " << pass;
    EXPECT_EQ(gw_a.download<uint32_t>(), gw_b.download<uint32_t>()) << "dw, pass " << pass;
  }
  // The transpose of the bytes is the transposed cast.
  Dev qt{w.size()}, qt_cast{w.size()}, slot_cast{kFp8ScaleSlotFloats * sizeof(float)};
  gpu::fp8_transpose(q.as<uint8_t>(), out, in, qt.as<uint8_t>(), nullptr);
  gpu::fp8_quantize(dw.as<bf16_t>(), out, in, Fp8Format::e4m3, nullptr, qt_cast.as<uint8_t>(), slot_cast.as<float>(),
                    nullptr);
  EXPECT_EQ(qt.download<uint8_t>(), qt_cast.download<uint8_t>()) << "wᵀ";
  Fp8Linear rowwise(c, n, Fp8Format::e4m3, Fp8Recipe::rowwise);
  expect_error([&] { rowwise.forward(dx.as<bf16_t>(), bytes, nullptr, y_a.as<bf16_t>(), in, out, nullptr, "w"); },
               "arrived as tensorwise FP8 bytes (FSDP's FP8 gather), and this layer scales rowwise");
  expect_error([&] { rowwise.backward(ddy.as<bf16_t>(), dx.as<bf16_t>(), bytes, gx_a.as<bf16_t>(), nullptr, in, out,
                                      false, false, nullptr, "w"); },
               "arrived as tensorwise FP8 bytes");
  const Fp8LinearWeight no_slot(q.as<uint8_t>(), nullptr);
  expect_error([&] { gathered.forward(dx.as<bf16_t>(), no_slot, nullptr, y_a.as<bf16_t>(), in, out, nullptr, "w"); },
               "arrived as FP8 bytes without a scale slot");
}

TEST(Fp8Linear, RefusesShapesTheFp8GemmsCannotTake) {
  SKIP_WITHOUT_GPU();
  ModelConfig c = ModelConfig::named("tiny", 64, 128);
  c.d_model = 64;
  c.d_ff = 168;  // a multiple of 8, not of 16
  expect_error([&] { Fp8Linear bad(c, 64, Fp8Format::e5m2); }, "multiples of 16");
  c.d_ff = 160;
  expect_error([&] { Fp8Linear bad(c, 40, Fp8Format::e5m2); }, "must be a multiple of 16");  // tokens
  EXPECT_NO_THROW(Fp8Linear(c, 48, Fp8Format::e5m2));
}

#endif
