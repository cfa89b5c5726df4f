// The CUDA layer kernels (model/cuda/ops.h) against the CPU ones (model/ops_cpu.h), for fp32, bf16 and
// fp16 activations: random inputs rounded to the activation type (so both sides see the same values),
// outputs poisoned with NaN (0xFF bytes) before each run, odd sizes, tolerances set by the storage type.
// The fused LM head against the unfused GPU head and the CPU's fused head; pure-bf16 AdamW against its CPU
// twin bit for bit. Reductions that feed the update (RMSNorm gains, embedding rows, squared norm) must also be
// bit-identical from run to run. Every GPU test skips when no GPU is visible; without CUDA there is only
// a skipped placeholder.
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "model/random_tokens.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "flashlm/device.h"

#ifdef FLASHLM_WITH_CUDA

#include "core/array_ops.h"
#include "core/cuda_runtime.h"
#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "model/cuda/fp8.h"
#include "model/cuda/gemm.h"
#include "model/lm_head.h"
#include "model/ops_cpu.h"
#include "model/cuda/ops.h"
#include "model/fp8.h"
#include "optim/optimizer.h"

using namespace flashlm;

namespace {

// ---------------------------------------------------------------------------------------------------
// Host helpers.

template <class T>
float to_f(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return static_cast<float>(x);
}

template <class T>
T from_f(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

template <class T>
std::vector<float> to_floats(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_f(v[i]);
  return out;
}

template <class T>
std::vector<T> from_floats(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f<T>(v[i]);
  return out;
}

// Normal(mean, stddev) values rounded to T (returned as floats): never zeros, never a constant.
template <class T = float>
std::vector<float> random_values(int64_t n, uint64_t seed, float stddev = 1.0f, float mean = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    do x = to_f(from_f<T>(normal(rng)));
    while (x == 0.0f);
  }
  return v;
}

// n values of T in device memory.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(int64_t n) : n_(n), buf_(Buffer::allocate(bytes(), Device::cuda, "test_ops_cuda")) {}
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(int64_t(host.size())) { upload(host); }

  T* data() const { return static_cast<T*>(buf_.data()); }
  size_t bytes() const { return size_t(n_) * sizeof(T); }
  void upload(const std::vector<T>& host) {
    ASSERT_EQ(int64_t(host.size()), n_);
    cuda_copy(data(), host.data(), bytes());
  }
  // Waits for the default stream, then copies back.
  std::vector<T> download() const {
    gpu::stream_synchronize(nullptr);
    std::vector<T> host(static_cast<size_t>(n_));
    cuda_copy(host.data(), data(), bytes());
    return host;
  }
  void poison() { gpu::memset_async(data(), 0xFF, bytes(), nullptr); }  // NaN in fp32, bf16 and fp16

 private:
  int64_t n_;
  Buffer buf_;
};

template <class T>
DeviceArray<T> device_copy(const std::vector<float>& values) {
  return DeviceArray<T>(from_floats<T>(values));
}

template <class T>
std::vector<float> download_floats(const DeviceArray<T>& a) {
  return to_floats(a.download());
}

// |got - ref| <= rtol·|ref| + atol·max|ref| + floor for every element (NaN fails).
struct Tol {
  double rtol, atol, floor = 0;
};

// Outputs stored in T: its rounding (half an ulp, relative) with a 4x margin; fp16 also flushes below
// its smallest subnormal. fp32 outputs differ from the CPU's by fp32 rounding (and exp/log ulps) only.
template <class T>
Tol storage_tol() {
  if constexpr (std::is_same_v<T, float>) return {2e-5, 2e-6};
  else if constexpr (std::is_same_v<T, bf16_t>) return {1.0 / 128, 1e-5};
  else return {1.0 / 512, 1e-5, std::ldexp(1.0, -24)};
}

::testing::AssertionResult close_to(const std::vector<float>& got, const std::vector<float>& ref, Tol tol) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  double scale = 0;
  for (float r : ref) scale = std::max(scale, std::fabs(double(r)));
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - double(ref[i]));
    const double allowed = tol.rtol * std::fabs(double(ref[i])) + tol.atol * scale + tol.floor;
    if (!(err <= allowed)) {
      ++bad;
      const double excess = std::isnan(err) ? INFINITY : err / allowed;
      if (worst < 0 || excess > worst_excess) {
        worst = int64_t(i);
        worst_excess = excess;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  const size_t w = size_t(worst);
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " values off; worst [" << worst << "]: got "
                                       << got[w] << ", want " << ref[w] << " (allowed "
                                       << tol.rtol * std::fabs(double(ref[w])) + tol.atol * scale + tol.floor
                                       << ", max |ref| " << scale << ")";
}

template <class T>
::testing::AssertionResult bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "size " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << "first difference at [" << i << "]: " << double(to_f(a[i])) << " vs "
                                           << double(to_f(b[i]));
    }
  }
  return ::testing::AssertionSuccess();
}

std::string dims(std::initializer_list<std::pair<const char*, int64_t>> d) {
  std::string s;
  for (auto [name, v] : d) s += std::string(s.empty() ? "" : ", ") + name + " = " + std::to_string(v);
  return s;
}

template <class T>
class OpsCuda : public ::testing::Test {};

struct TypeName {
  template <class T>
  static std::string GetName(int) {
    if constexpr (std::is_same_v<T, float>) return "f32";
    else if constexpr (std::is_same_v<T, bf16_t>) return "bf16";
    else return "f16";
  }
};

using ActivationTypes = ::testing::Types<float, bf16_t, fp16_t>;
TYPED_TEST_SUITE(OpsCuda, ActivationTypes, TypeName);

const int64_t kRows[] = {1, 7, 1000};
// 36: a width that is not a multiple of 8, so the kernels' element-by-element paths (which the 16-byte
// packed paths fall back to) run too; the others take the packed paths.
const int64_t kWidths[] = {32, 36, 48, 1600};

// ---------------------------------------------------------------------------------------------------
// RMSNorm.

TYPED_TEST(OpsCuda, RmsNormForwardMatchesCpu) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const float eps = 1e-5f;
  for (int64_t n : kRows) {
    for (int64_t d : kWidths) {
      SCOPED_TRACE(dims({{"n", n}, {"d", d}}));
      const std::vector<float> x = random_values<T>(n * d, 100 + n + d, 1.5f);
      const std::vector<float> gain = random_values(d, 200 + d, 0.2f, 1.0f);
      std::vector<float> y_ref(static_cast<size_t>(n * d)), rstd_ref(static_cast<size_t>(n));
      cpu::rmsnorm_forward(x.data(), gain.data(), y_ref.data(), rstd_ref.data(), n, d, eps);

      DeviceArray<T> dx = device_copy<T>(x), dy(n * d);
      DeviceArray<float> dgain(gain), drstd(n);
      dy.poison();
      drstd.poison();
      gpu::rmsnorm_forward<T>(dx.data(), dgain.data(), dy.data(), drstd.data(), n, d, eps, nullptr);
      EXPECT_TRUE(close_to(download_floats(dy), y_ref, storage_tol<T>())) << "y";
      EXPECT_TRUE(close_to(drstd.download(), rstd_ref, {1e-5, 0})) << "rstd";
    }
  }
}

TYPED_TEST(OpsCuda, RmsNormBackwardMatchesCpuAndIsReproducible) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int64_t n : kRows) {
    for (int64_t d : kWidths) shapes.push_back({n, d});
  }
  shapes.push_back({70001, 48});  // past 64 Ki rows the gain chunks grow beyond 64 rows
  for (auto [n, d] : shapes) {
    {
      SCOPED_TRACE(dims({{"n", n}, {"d", d}}));
      const std::vector<float> x = random_values<T>(n * d, 300 + n + d, 1.5f);
      const std::vector<float> dy = random_values<T>(n * d, 400 + n + d);
      const std::vector<float> gain = random_values(d, 500 + d, 0.2f, 1.0f);
      const std::vector<float> dx0 = random_values<T>(n * d, 600 + n + d);  // dx accumulates
      const std::vector<float> dgain0 = random_values(d, 700 + d);           // and so does dgain
      std::vector<float> y(static_cast<size_t>(n * d)), rstd(static_cast<size_t>(n));
      cpu::rmsnorm_forward(x.data(), gain.data(), y.data(), rstd.data(), n, d, 1e-5f);
      std::vector<float> dx_ref = dx0, dgain_ref = dgain0;
      cpu::rmsnorm_backward(dy.data(), x.data(), gain.data(), rstd.data(), dx_ref.data(), dgain_ref.data(), n, d);

      DeviceArray<T> d_x = device_copy<T>(x), d_dy = device_copy<T>(dy);
      DeviceArray<float> d_gain(gain), d_rstd(rstd);
      std::vector<T> first_dx;
      std::vector<float> first_dgain;
      for (int run = 0; run < 2; ++run) {
        DeviceArray<T> d_dx = device_copy<T>(dx0);
        DeviceArray<float> d_dgain(dgain0);
        gpu::rmsnorm_backward<T>(d_dy.data(), d_x.data(), d_gain.data(), d_rstd.data(), d_dx.data(), d_dgain.data(), n,
                                 d, nullptr);
        const std::vector<T> got_dx = d_dx.download();
        const std::vector<float> got_dgain = d_dgain.download();
        if (run == 0) {
          EXPECT_TRUE(close_to(to_floats(got_dx), dx_ref, storage_tol<T>())) << "dx";
          EXPECT_TRUE(close_to(got_dgain, dgain_ref, {1e-5, 1e-5})) << "dgain";
          first_dx = got_dx;
          first_dgain = got_dgain;
        } else {
          EXPECT_TRUE(bitwise_equal(got_dx, first_dx)) << "dx differs between two runs";
          EXPECT_TRUE(bitwise_equal(got_dgain, first_dgain)) << "dgain differs between two runs";
        }
      }
    }
  }
}

// The gain gradient's bits are those of rmsnorm.cu's stated order, modelled here on the host: per column,
// chunks of max(64, ceil(n / 1024)) rows, each row's term (dy·x rounded, then fused with rstd into the
// sum) in row order; then chunk lane t of 8 sums chunks t, t + 8, ... in order, and the 8 lane sums are
// added in order onto the old gain gradient. Ragged row counts (a chunk's last rows past the kernel's
// batches of 16 loads, a last chunk shorter than the others) and more than 64 Ki rows.
TYPED_TEST(OpsCuda, RmsNormGainGradientSumsInTheStatedOrder) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (auto [n, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 32}, {17, 36}, {127, 48}, {1000, 1600}, {70001, 48}}) {
    SCOPED_TRACE(dims({{"n", n}, {"d", d}}));
    const std::vector<float> x = random_values<T>(n * d, 800 + n + d, 1.5f);
    const std::vector<float> dy = random_values<T>(n * d, 900 + n + d);
    const std::vector<float> gain = random_values(d, 1000 + d, 0.2f, 1.0f);
    const std::vector<float> dgain0 = random_values(d, 1100 + d);
    std::vector<float> y(static_cast<size_t>(n * d)), rstd(static_cast<size_t>(n));
    cpu::rmsnorm_forward(x.data(), gain.data(), y.data(), rstd.data(), n, d, 1e-5f);

    const int64_t chunk_rows = std::max<int64_t>(64, (n + 1023) / 1024), chunks = (n + chunk_rows - 1) / chunk_rows;
    std::vector<float> want = dgain0;
    for (int64_t j = 0; j < d; ++j) {
      float lane[8] = {};
      for (int64_t c = 0; c < chunks; ++c) {
        float acc = 0.0f;
        for (int64_t r = c * chunk_rows; r < std::min(n, (c + 1) * chunk_rows); ++r) {
          const float product = dy[size_t(r * d + j)] * x[size_t(r * d + j)];
          acc = std::fma(product, rstd[size_t(r)], acc);
        }
        lane[c % 8] += acc;
      }
      float total = lane[0];
      for (int t = 1; t < 8; ++t) total += lane[t];
      want[size_t(j)] += total;
    }

    DeviceArray<T> d_x = device_copy<T>(x), d_dy = device_copy<T>(dy), d_dx = device_copy<T>(dy);
    DeviceArray<float> d_gain(gain), d_rstd(rstd), d_dgain(dgain0);
    gpu::rmsnorm_backward<T>(d_dy.data(), d_x.data(), d_gain.data(), d_rstd.data(), d_dx.data(), d_dgain.data(), n, d,
                             nullptr);
    EXPECT_TRUE(bitwise_equal(d_dgain.download(), want)) << "dgain";
  }
}

// ---------------------------------------------------------------------------------------------------
// RoPE.

TYPED_TEST(OpsCuda, RopeForwardAndBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  struct Shape {
    int64_t batch, seq, heads, head_dim;
  };
  const Shape shapes[] = {{1, 1, 1, 32}, {2, 7, 3, 48}, {1, 1000, 2, 32}, {3, 17, 5, 128}, {2, 5, 1, 2}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(dims({{"batch", s.batch}, {"seq", s.seq}, {"heads", s.heads}, {"head_dim", s.head_dim}}));
    const int64_t context = s.seq + 3, half = s.head_dim / 2, numel = s.batch * s.seq * s.heads * s.head_dim;
    std::vector<float> cos(size_t(context * half)), sin(size_t(context * half));
    cpu::rope_tables(cos.data(), sin.data(), context, s.head_dim, 10000.0);
    DeviceArray<float> dcos(cos), dsin(sin);

    const std::vector<float> x = random_values<T>(numel, 800 + numel);
    std::vector<float> x_ref = x;
    cpu::rope_forward(x_ref.data(), cos.data(), sin.data(), s.batch, s.seq, s.heads, s.head_dim);
    DeviceArray<T> dx = device_copy<T>(x);
    gpu::rope_forward<T>(dx.data(), dcos.data(), dsin.data(), s.batch, s.seq, s.heads, s.head_dim, nullptr);
    EXPECT_TRUE(close_to(download_floats(dx), x_ref, storage_tol<T>())) << "forward";

    const std::vector<float> g = random_values<T>(numel, 900 + numel);
    std::vector<float> g_ref = g;
    cpu::rope_backward(g_ref.data(), cos.data(), sin.data(), s.batch, s.seq, s.heads, s.head_dim);
    DeviceArray<T> dg = device_copy<T>(g);
    gpu::rope_backward<T>(dg.data(), dcos.data(), dsin.data(), s.batch, s.seq, s.heads, s.head_dim, nullptr);
    EXPECT_TRUE(close_to(download_floats(dg), g_ref, storage_tol<T>())) << "backward";
  }
}

// With a token stride: q and k of a [tokens, 3 · heads · head_dim] q|k|v array rotated in one call as
// 2·heads heads per token (as the CUDA model does); each equals the contiguous rotation of its part, and v
// is left as it was, bit for bit. The packed path (head_dim 48, stride a multiple of 8) and the pairwise one.
TYPED_TEST(OpsCuda, RopeWithATokenStrideRotatesQAndKInPlace) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  struct Shape {
    int64_t batch, seq, heads, head_dim;
  };
  for (const Shape& s : {Shape{2, 7, 3, 48}, Shape{1, 5, 2, 2}}) {
    SCOPED_TRACE(dims({{"batch", s.batch}, {"seq", s.seq}, {"heads", s.heads}, {"head_dim", s.head_dim}}));
    const int64_t context = s.seq, half = s.head_dim / 2, d = s.heads * s.head_dim, tokens = s.batch * s.seq;
    std::vector<float> cos(size_t(context * half)), sin(size_t(context * half));
    cpu::rope_tables(cos.data(), sin.data(), context, s.head_dim, 10000.0);
    DeviceArray<float> dcos(cos), dsin(sin);
    for (int direction = 0; direction < 2; ++direction) {
      const std::vector<float> qkv = random_values<T>(tokens * 3 * d, 1300 + direction);
      DeviceArray<T> dqkv = device_copy<T>(qkv);
      if (direction == 0) {
        gpu::rope_forward<T>(dqkv.data(), dcos.data(), dsin.data(), s.batch, s.seq, 2 * s.heads, s.head_dim, nullptr,
                             3 * d);
      } else {
        gpu::rope_backward<T>(dqkv.data(), dcos.data(), dsin.data(), s.batch, s.seq, 2 * s.heads, s.head_dim, nullptr,
                              3 * d);
      }
      const std::vector<float> got = download_floats(dqkv);
      for (int part = 0; part < 3; ++part) {
        std::vector<float> in(size_t(tokens * d)), out(size_t(tokens * d));
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t j = 0; j < d; ++j) {
            in[size_t(t * d + j)] = qkv[size_t(t * 3 * d + part * d + j)];
            out[size_t(t * d + j)] = got[size_t(t * 3 * d + part * d + j)];
          }
        }
        std::vector<float> ref = in;
        if (part < 2 && direction == 0) {
          cpu::rope_forward(ref.data(), cos.data(), sin.data(), s.batch, s.seq, s.heads, s.head_dim);
        } else if (part < 2) {
          cpu::rope_backward(ref.data(), cos.data(), sin.data(), s.batch, s.seq, s.heads, s.head_dim);
        }
        if (part < 2) {
          EXPECT_TRUE(close_to(out, ref, storage_tol<T>())) << "part " << part << ", direction " << direction;
        } else {
          EXPECT_EQ(out, in) << "v was changed, direction " << direction;
        }
      }
    }
  }
}

// FP8 training's dqkv amax: the RoPE backward over q and k of a [tokens, 3 · heads · head_dim] q|k|v gradient,
// reading v too (amax_heads = 3 · heads), gives the amax of the whole tensor as stored: the largest magnitude's
// bits over every element (magnitude_bits_max), fp8_amax's bits where it is instantiated (fp32, bf16), and the
// same rotated values as the call without an amax. The largest value, then a NaN, placed in v (which the kernel
// only reads), and in q; the packed path and the pairwise one.
uint32_t magnitude_bits_max(const std::vector<float>& v) {
  uint32_t best = 0;
  for (float x : v) best = std::max(best, std::bit_cast<uint32_t>(x) & 0x7fffffffu);
  return best;
}

TYPED_TEST(OpsCuda, RopeBackwardWritesTheAmaxOfTheWholeQkvGradient) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  struct Shape {
    int64_t batch, seq, heads, head_dim;
  };
  for (const Shape& s : {Shape{2, 7, 3, 48}, Shape{1, 5, 2, 2}, Shape{2, 64, 4, 16}}) {
    const int64_t half = s.head_dim / 2, d = s.heads * s.head_dim, tokens = s.batch * s.seq;
    std::vector<float> cos(size_t(s.seq * half)), sin(size_t(s.seq * half));
    cpu::rope_tables(cos.data(), sin.data(), s.seq, s.head_dim, 10000.0);
    DeviceArray<float> dcos(cos), dsin(sin), amax(1), reduced(1);
    const int64_t v_at = (tokens / 2) * 3 * d + 2 * d + d / 2, q_at = (tokens - 1) * 3 * d + 1;
    for (const char* extreme : {"none", "large in v", "NaN in v", "large in q", "NaN in q"}) {
      SCOPED_TRACE(dims({{"batch", s.batch}, {"seq", s.seq}, {"heads", s.heads}, {"head_dim", s.head_dim}}) + ", " +
                   extreme);
      std::vector<float> qkv = random_values<T>(tokens * 3 * d, 1400 + d);
      const std::string what = extreme;
      const float value = what.find("NaN") != std::string::npos ? std::numeric_limits<float>::quiet_NaN() : 1000.0f;
      if (what != "none") qkv[size_t(what.find(" v") != std::string::npos ? v_at : q_at)] = value;
      DeviceArray<T> with = device_copy<T>(qkv), without = device_copy<T>(qkv);
      amax.poison();
      gpu::rope_backward<T>(with.data(), dcos.data(), dsin.data(), s.batch, s.seq, 2 * s.heads, s.head_dim, nullptr,
                            3 * d, amax.data(), 3 * s.heads);
      gpu::rope_backward<T>(without.data(), dcos.data(), dsin.data(), s.batch, s.seq, 2 * s.heads, s.head_dim, nullptr,
                            3 * d);
      EXPECT_TRUE(bitwise_equal(with.download(), without.download())) << "the rotation changed";
      const uint32_t got = std::bit_cast<uint32_t>(amax.download()[0]);
      const std::vector<float> stored = download_floats(with);
      if (what.find("NaN") != std::string::npos) {
        EXPECT_TRUE(std::isnan(std::bit_cast<float>(got))) << "a NaN in the tensor gives a NaN amax";
      }
      if (!std::is_same_v<T, fp16_t> || what.find("NaN") == std::string::npos) {  // fp16 NaN payloads may widen apart
        EXPECT_EQ(got, magnitude_bits_max(stored));
      }
      if constexpr (!std::is_same_v<T, fp16_t>) {
        reduced.poison();
        gpu::fp8_amax<T>(with.data(), tokens * 3 * d, reduced.data(), nullptr);
        EXPECT_EQ(got, std::bit_cast<uint32_t>(reduced.download()[0])) << "fp8_amax of the same tensor";
      }
    }
  }
  DeviceArray<T> x(8);
  DeviceArray<float> table(8), amax(1);
  // The heads the amax covers must fit the token stride, and include the rotated ones.
  EXPECT_THROW(gpu::rope_backward<T>(x.data(), table.data(), table.data(), 1, 1, 1, 2, nullptr, 4, amax.data(), 3),
               Error);
  EXPECT_THROW(gpu::rope_backward<T>(x.data(), table.data(), table.data(), 1, 1, 2, 2, nullptr, 4, amax.data(), 1),
               Error);
}

// ---------------------------------------------------------------------------------------------------
// SwiGLU.

TYPED_TEST(OpsCuda, SwiGluForwardAndBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    const std::vector<float> u = random_values<T>(n, 1000 + n, 3.0f);
    const std::vector<float> g = random_values<T>(n, 1100 + n);
    const std::vector<float> ds = random_values<T>(n, 1200 + n);
    std::vector<float> s_ref(static_cast<size_t>(n)), du_ref(static_cast<size_t>(n)), dg_ref(static_cast<size_t>(n));
    cpu::swiglu_forward(u.data(), g.data(), s_ref.data(), n);
    cpu::swiglu_backward(ds.data(), u.data(), g.data(), du_ref.data(), dg_ref.data(), n);

    DeviceArray<T> d_u = device_copy<T>(u), d_g = device_copy<T>(g), d_ds = device_copy<T>(ds);
    DeviceArray<T> d_s(n), d_du(n), d_dg(n);
    d_s.poison();
    d_du.poison();
    d_dg.poison();
    gpu::swiglu_forward<T>(d_u.data(), d_g.data(), d_s.data(), n, nullptr);
    gpu::swiglu_backward<T>(d_ds.data(), d_u.data(), d_g.data(), d_du.data(), d_dg.data(), n, nullptr);
    EXPECT_TRUE(close_to(download_floats(d_s), s_ref, storage_tol<T>())) << "s";
    EXPECT_TRUE(close_to(download_floats(d_du), du_ref, storage_tol<T>())) << "du";
    EXPECT_TRUE(close_to(download_floats(d_dg), dg_ref, storage_tol<T>())) << "dg";
  }
}

// FP8 training's fused amax: RMSNorm's y and dx and SwiGLU's s, du, dg carry the amax of the values they stored, bit
// for bit the largest |value| of the downloaded tensor; the amax output is cleared first (it starts poisoned).
float host_amax(const std::vector<float>& v) {
  float best = 0.0f;
  for (float x : v) best = std::max(best, std::fabs(x));
  return best;
}

TYPED_TEST(OpsCuda, ProducersWriteTheAmaxOfWhatTheyStore) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  DeviceArray<float> amax(3);
  const auto amax_bits = [&](int i) { return std::bit_cast<uint32_t>(amax.download()[size_t(i)]); };
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    const std::vector<float> u = random_values<T>(n, 3000 + n, 3.0f), g = random_values<T>(n, 3100 + n),
                             ds = random_values<T>(n, 3200 + n);
    DeviceArray<T> d_u = device_copy<T>(u), d_g = device_copy<T>(g), d_ds = device_copy<T>(ds), d_s(n), d_du(n),
                   d_dg(n);
    amax.poison();
    gpu::swiglu_forward<T>(d_u.data(), d_g.data(), d_s.data(), n, nullptr, amax.data());
    EXPECT_EQ(amax_bits(0), std::bit_cast<uint32_t>(host_amax(download_floats(d_s)))) << "s";
    amax.poison();
    gpu::swiglu_backward<T>(d_ds.data(), d_u.data(), d_g.data(), d_du.data(), d_dg.data(), n, nullptr,
                            amax.data() + 1, amax.data() + 2);
    EXPECT_EQ(amax_bits(1), std::bit_cast<uint32_t>(host_amax(download_floats(d_du)))) << "du";
    EXPECT_EQ(amax_bits(2), std::bit_cast<uint32_t>(host_amax(download_floats(d_dg)))) << "dg";
  }
  for (int64_t n : kRows) {
    for (int64_t d : kWidths) {
      SCOPED_TRACE(dims({{"n", n}, {"d", d}}));
      const std::vector<float> x = random_values<T>(n * d, 3300 + n + d, 1.5f);
      const std::vector<float> gain = random_values(d, 3400 + d, 0.2f, 1.0f);
      DeviceArray<T> dx = device_copy<T>(x), dy(n * d);
      DeviceArray<float> dgain(gain), drstd(n);
      amax.poison();
      gpu::rmsnorm_forward<T>(dx.data(), dgain.data(), dy.data(), drstd.data(), n, d, 1e-5f, nullptr, amax.data());
      EXPECT_EQ(amax_bits(0), std::bit_cast<uint32_t>(host_amax(download_floats(dy)))) << "y";
      // The backward adds into a residual gradient that holds values already; its amax is of the sums stored.
      DeviceArray<T> dgrad = device_copy<T>(random_values<T>(n * d, 3500 + n + d, 2.0f)),
                     dres = device_copy<T>(random_values<T>(n * d, 3600 + n + d, 0.5f));
      DeviceArray<float> dgain_grad(std::vector<float>(size_t(d), 0.0f));
      amax.poison();
      gpu::rmsnorm_backward<T>(dgrad.data(), dx.data(), dgain.data(), drstd.data(), dres.data(), dgain_grad.data(), n,
                               d, nullptr, amax.data() + 1);
      EXPECT_EQ(amax_bits(1), std::bit_cast<uint32_t>(host_amax(download_floats(dres)))) << "dx";
    }
  }
  EXPECT_THROW(gpu::swiglu_backward<T>(nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr, amax.data(), nullptr),
               Error);
}

// ---------------------------------------------------------------------------------------------------
// Cross-entropy.

TYPED_TEST(OpsCuda, CrossEntropyMatchesCpu) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  struct Shape {
    int64_t n, vocab;
  };
  std::vector<Shape> shapes;
  for (int64_t n : kRows) {
    for (int64_t vocab : {int64_t{10}, int64_t{10000}}) shapes.push_back({n, vocab});
  }
  shapes.push_back({3, 100000});
  for (const Shape& s : shapes) {
    const int64_t n = s.n, vocab = s.vocab;
    SCOPED_TRACE(dims({{"n", n}, {"vocab", vocab}}));
    const std::vector<float> logits = random_values<T>(n * vocab, 1300 + n + vocab, 2.0f);
    const std::vector<int32_t> targets = random_tokens(n, vocab, 1400 + n);

    // Forward: the loss of each row (the CPU kernel's mean over one row) and the mean.
    std::vector<float> loss_ref(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) {
      loss_ref[size_t(r)] = float(cpu::cross_entropy_forward(logits.data() + r * vocab, &targets[size_t(r)], 1, vocab));
    }
    const double mean_ref = cpu::cross_entropy_forward(logits.data(), targets.data(), n, vocab);
    DeviceArray<T> d_logits = device_copy<T>(logits);
    DeviceArray<int32_t> d_targets(targets);
    DeviceArray<float> d_loss(n);
    d_loss.poison();
    gpu::cross_entropy_forward<T>(d_logits.data(), d_targets.data(), d_loss.data(), n, vocab, nullptr);
    const std::vector<float> loss = d_loss.download();
    EXPECT_TRUE(close_to(loss, loss_ref, {1e-5, 1e-5})) << "row_loss";
    double mean = 0;
    for (float l : loss) mean += l;
    EXPECT_NEAR(mean / double(n), mean_ref, 1e-5 * std::max(1.0, std::fabs(mean_ref)));

    // Backward with a scale that is not 1/n (fp16: times a loss scale of 1024, as training would use).
    const float scale = (std::is_same_v<T, fp16_t> ? 1024.0f : 0.5f) / float(n);
    std::vector<float> grad_ref = logits;
    cpu::cross_entropy_backward(grad_ref.data(), targets.data(), n, vocab);  // (softmax - onehot) / n
    for (float& g : grad_ref) g = float(double(g) * double(n) * double(scale));
    gpu::cross_entropy_backward<T>(d_logits.data(), d_targets.data(), n, vocab, scale, nullptr);
    Tol tol = storage_tol<T>();
    if constexpr (std::is_same_v<T, float>) tol = {2e-5, 1e-5};  // exp(z - lse) with lse rounded to fp32
    EXPECT_TRUE(close_to(download_floats(d_logits), grad_ref, tol)) << "dlogits";
  }
}

TYPED_TEST(OpsCuda, CrossEntropyRowsWithInvalidTargetsAreNaN) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const int64_t n = 4, vocab = 10;
  const std::vector<float> logits = random_values<T>(n * vocab, 1500);
  const std::vector<int32_t> targets = {3, -1, 10, 9};
  DeviceArray<T> d_logits = device_copy<T>(logits);
  DeviceArray<int32_t> d_targets(targets);
  DeviceArray<float> d_loss(n);
  d_loss.poison();
  gpu::cross_entropy_forward<T>(d_logits.data(), d_targets.data(), d_loss.data(), n, vocab, nullptr);
  const std::vector<float> loss = d_loss.download();
  EXPECT_FALSE(std::isnan(loss[0]));
  EXPECT_TRUE(std::isnan(loss[1]));
  EXPECT_TRUE(std::isnan(loss[2]));
  EXPECT_FALSE(std::isnan(loss[3]));
  gpu::cross_entropy_backward<T>(d_logits.data(), d_targets.data(), n, vocab, 1.0f, nullptr);
  const std::vector<float> grad = download_floats(d_logits);
  for (int64_t j = 0; j < vocab; ++j) {
    EXPECT_FALSE(std::isnan(grad[size_t(j)]));
    EXPECT_TRUE(std::isnan(grad[size_t(vocab + j)]));
    EXPECT_TRUE(std::isnan(grad[size_t(2 * vocab + j)]));
    EXPECT_FALSE(std::isnan(grad[size_t(3 * vocab + j)]));
  }
}

// ---------------------------------------------------------------------------------------------------
// The fused LM head + cross-entropy (model/lm_head.h).

// The unfused head on the GPU, as the models ran it: all n rows of logits at once.
template <class T>
void unfused_head_cuda(const DeviceArray<T>& h, const DeviceArray<T>& w, const DeviceArray<int32_t>& targets, int64_t n,
                       int64_t d, int64_t vocab, float grad_scale, DeviceArray<float>& row_loss, DeviceArray<T>& dh,
                       DeviceArray<float>& dw) {
  const DType dt = dtype_of<T>();
  DeviceArray<T> logits(n * vocab);
  linear_forward_cuda(h.data(), w.data(), logits.data(), n, d, vocab, dt, nullptr);
  gpu::cross_entropy_forward<T>(logits.data(), targets.data(), row_loss.data(), n, vocab, nullptr);
  gpu::cross_entropy_backward<T>(logits.data(), targets.data(), n, vocab, grad_scale, nullptr);
  linear_backward_cuda(logits.data(), h.data(), w.data(), dh.data(), dw.data(), n, d, vocab, dt, false, nullptr);
}

TYPED_TEST(OpsCuda, LmHeadFusedMatchesUnfusedAndCpu) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  struct Case {
    int64_t n, d, vocab, chunk;
  };
  // Chunks of one row, chunks that do and do not divide n, one chunk of every row, and the CS336 leaderboard
  // vocabulary (151936).
  std::vector<Case> cases = {{1, 64, 1000, 1}, {37, 64, 1000, 16}, {300, 32, 5008, 128}, {129, 128, 10000, 129},
                             {37, 64, 151936, 16}};
  if constexpr (std::is_same_v<T, float>) cases.push_back({17, 36, 1001, 5});  // fp32 GEMMs take any sizes
  for (const Case& c : cases) {
    const int64_t n = c.n, d = c.d, vocab = c.vocab, chunk = c.chunk;
    SCOPED_TRACE(dims({{"n", n}, {"d", d}, {"vocab", vocab}, {"chunk", chunk}}));
    const uint64_t seed = uint64_t(n * 7919 + d * 31 + vocab + chunk);
    const std::vector<float> h = random_values<T>(n * d, seed, 1.0f), w = random_values<T>(vocab * d, seed + 1, 0.1f);
    const std::vector<int32_t> targets = random_tokens(n, vocab, seed + 2);
    const std::vector<float> dw0 = random_values(vocab * d, seed + 3, 1e-3f);  // the head's gradient accumulates
    const float grad_scale = (std::is_same_v<T, fp16_t> ? 1024.0f : 1.0f) / float(n);

    // The CPU's fused head in fp32 on the same (rounded) values.
    std::vector<float> dh_ref(size_t(n * d)), dw_ref = dw0, ws(size_t(std::min(chunk, n) * vocab));
    const double loss_ref = cpu::lm_head_loss_forward_backward(h.data(), w.data(), targets.data(), n, d, vocab, chunk,
                                                               grad_scale, dh_ref.data(), dw_ref.data(), ws.data());

    DeviceArray<T> d_h = device_copy<T>(h), d_w = device_copy<T>(w);
    DeviceArray<int32_t> d_targets(targets);
    DeviceArray<T> d_dh(n * d), d_ws(std::min(chunk, n) * vocab), u_dh(n * d);
    DeviceArray<float> d_loss(n), d_dw(dw0), u_loss(n), u_dw(dw0);
    d_loss.poison();
    d_dh.poison();
    d_ws.poison();
    gpu::lm_head_loss_forward_backward<T>(d_h.data(), d_w.data(), d_targets.data(), n, d, vocab, chunk, grad_scale,
                                          d_loss.data(), d_dh.data(), d_dw.data(), d_ws.data(), nullptr);
    const std::vector<float> loss = d_loss.download(), dh = download_floats(d_dh), dw = d_dw.download();
    u_loss.poison();
    u_dh.poison();
    unfused_head_cuda<T>(d_h, d_w, d_targets, n, d, vocab, grad_scale, u_loss, u_dh, u_dw);

    // Against the unfused GPU head: the same kernels on fewer rows at a time.
    // (cuBLASLt may pick another algorithm for fewer rows: fp32 rounding, or a 16-bit logit one ulp apart.)
    const Tol same_path = std::is_same_v<T, float> ? Tol{1e-5, 1e-5} : Tol{1.0 / 64, 2e-3};
    EXPECT_TRUE(close_to(loss, u_loss.download(), same_path)) << "row_loss vs unfused";
    EXPECT_TRUE(close_to(dh, download_floats(u_dh), same_path)) << "dh vs unfused";
    EXPECT_TRUE(close_to(dw, u_dw.download(), same_path)) << "dw vs unfused";

    // Against the CPU in fp32: the GPU rounds logits and their gradient to T.
    double mean = 0;
    for (float l : loss) mean += l;
    mean /= double(n);
    const double loss_tol = std::is_same_v<T, float> ? 1e-5 : std::is_same_v<T, bf16_t> ? 2e-2 : 4e-3;
    EXPECT_NEAR(mean, loss_ref, loss_tol * std::max(1.0, loss_ref));
    const Tol vs_cpu = std::is_same_v<T, float>    ? Tol{1e-4, 1e-5}
                       : std::is_same_v<T, bf16_t> ? Tol{0, 2e-2}
                                                   : Tol{0, 5e-3};
    EXPECT_TRUE(close_to(dh, dh_ref, vs_cpu)) << "dh vs CPU";
    EXPECT_TRUE(close_to(dw, dw_ref, vs_cpu)) << "dw vs CPU";

    // The loss alone (the forward): the forward kernel's row losses, which the backward kernel reproduces
    // bit for bit from the same logits.
    DeviceArray<float> f_loss(n);
    f_loss.poison();
    gpu::lm_head_loss_forward_backward<T>(d_h.data(), d_w.data(), d_targets.data(), n, d, vocab, chunk, grad_scale,
                                          f_loss.data(), static_cast<T*>(nullptr), nullptr, d_ws.data(), nullptr);
    EXPECT_TRUE(bitwise_equal(f_loss.download(), loss)) << "forward-only loss";
  }
}

TEST(OpsCudaF32, CrossEntropyBackwardWritesTheForwardLoss) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 9, vocab = 3001;
  const std::vector<float> logits = random_values(n * vocab, 3100, 3.0f);
  std::vector<int32_t> targets = random_tokens(n, vocab, 3101);
  targets[4] = int32_t(vocab);  // invalid: NaN on both paths
  DeviceArray<float> d_logits(logits), d_loss(n), b_loss(n);
  DeviceArray<int32_t> d_targets(targets);
  d_loss.poison();
  b_loss.poison();
  gpu::cross_entropy_forward<float>(d_logits.data(), d_targets.data(), d_loss.data(), n, vocab, nullptr);
  gpu::cross_entropy_backward<float>(d_logits.data(), d_targets.data(), n, vocab, 1.0f / float(n), nullptr,
                                     b_loss.data());
  const std::vector<float> want = d_loss.download(), got = b_loss.download();
  EXPECT_TRUE(std::isnan(got[4]));
  EXPECT_TRUE(bitwise_equal(got, want));
}

// ---------------------------------------------------------------------------------------------------
// Embedding.

TYPED_TEST(OpsCuda, EmbeddingMatchesCpuBitwiseAndIsReproducible) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  struct Case {
    int64_t n, d, vocab;
    bool one_token;  // every row the same token: one run of n rows
  };
  std::vector<Case> cases;
  for (int64_t n : kRows) {
    for (int64_t d : kWidths) {
      for (int64_t vocab : {int64_t{10}, int64_t{10000}}) cases.push_back({n, d, vocab, false});
    }
  }
  cases.push_back({1000, 48, 10000, true});
  for (const Case& c : cases) {
    SCOPED_TRACE(dims({{"n", c.n}, {"d", c.d}, {"vocab", c.vocab}, {"one_token", c.one_token}}));
    const std::vector<float> table = random_values(c.vocab * c.d, 1600 + c.vocab + c.d);
    std::vector<int32_t> tokens = random_tokens(c.n, c.vocab, 1700 + c.n + c.d);
    if (c.one_token) std::fill(tokens.begin(), tokens.end(), int32_t(c.vocab / 3));
    DeviceArray<float> d_table(table);
    DeviceArray<int32_t> d_tokens(tokens);

    // Forward: table rows rounded to T, exactly.
    std::vector<float> x_ref(size_t(c.n * c.d));
    cpu::embedding_forward(table.data(), tokens.data(), x_ref.data(), c.n, c.d);
    DeviceArray<T> d_x(c.n * c.d);
    d_x.poison();
    gpu::embedding_forward<T>(d_table.data(), d_tokens.data(), d_x.data(), c.n, c.d, c.vocab, nullptr);
    EXPECT_TRUE(bitwise_equal(d_x.download(), from_floats<T>(x_ref))) << "forward";

    // Backward: the same additions in the same order as the CPU loop, so the same bits; twice.
    const std::vector<float> dx = random_values<T>(c.n * c.d, 1800 + c.n + c.d);
    std::vector<float> dtable_ref = table;  // accumulates into a non-zero table
    cpu::embedding_backward(dx.data(), tokens.data(), dtable_ref.data(), c.n, c.d);
    DeviceArray<T> d_dx = device_copy<T>(dx);
    for (int run = 0; run < 2; ++run) {
      d_table.upload(table);
      gpu::embedding_backward<T>(d_dx.data(), d_tokens.data(), d_table.data(), c.n, c.d, c.vocab, nullptr);
      EXPECT_TRUE(bitwise_equal(d_table.download(), dtable_ref)) << "backward, run " << run;
    }
  }
}

TYPED_TEST(OpsCuda, EmbeddingSkipsInvalidTokens) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const int64_t n = 5, d = 33, vocab = 7;
  const std::vector<int32_t> tokens = {2, -1, 7, 2, 6};
  const std::vector<float> table = random_values(vocab * d, 1900);
  DeviceArray<float> d_table(table);
  DeviceArray<int32_t> d_tokens(tokens);
  DeviceArray<T> d_x(n * d);
  d_x.poison();
  gpu::embedding_forward<T>(d_table.data(), d_tokens.data(), d_x.data(), n, d, vocab, nullptr);
  const std::vector<float> x = download_floats(d_x);
  for (int64_t j = 0; j < d; ++j) {
    EXPECT_EQ(x[size_t(j)], to_f(from_f<T>(table[size_t(2 * d + j)])));
    EXPECT_TRUE(std::isnan(x[size_t(d + j)]));
    EXPECT_TRUE(std::isnan(x[size_t(2 * d + j)]));
    EXPECT_EQ(x[size_t(4 * d + j)], to_f(from_f<T>(table[size_t(6 * d + j)])));
  }

  const std::vector<float> dx = random_values<T>(n * d, 2000);
  DeviceArray<T> d_dx = device_copy<T>(dx);
  gpu::embedding_backward<T>(d_dx.data(), d_tokens.data(), d_table.data(), n, d, vocab, nullptr);
  std::vector<float> want = table;
  for (int64_t j = 0; j < d; ++j) {
    want[size_t(2 * d + j)] = (table[size_t(2 * d + j)] + dx[size_t(j)]) + dx[size_t(3 * d + j)];
    want[size_t(6 * d + j)] = table[size_t(6 * d + j)] + dx[size_t(4 * d + j)];
  }
  EXPECT_TRUE(bitwise_equal(d_table.download(), want));
}

// ---------------------------------------------------------------------------------------------------
// AdamW.

// CpuModel::adamw_step's arithmetic on plain arrays.
void adamw_cpu(std::vector<float>& w, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v,
               double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const double t = double(step);
  const float alpha = float(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  const float b1 = float(beta1), b2 = float(beta2), e = float(eps), decay = float(lr * weight_decay);
  for (size_t i = 0; i < w.size(); ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    w[i] -= alpha * m[i] / (std::sqrt(v[i]) + e);
    w[i] -= decay * w[i];
  }
}

TYPED_TEST(OpsCuda, AdamWMatchesCpuFormula) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    std::vector<float> w = random_values(n, 2100 + n, 0.05f), m = random_values(n, 2200 + n, 1e-3f),
                       v = random_values(n, 2300 + n, 1e-3f);
    for (float& x : v) x = x * x;  // second moments are non-negative
    DeviceArray<float> d_w(w), d_m(m), d_v(v), d_g(n);
    DeviceArray<T> d_copy(n);
    for (int64_t step = 1; step <= 3; ++step) {
      const std::vector<float> g = random_values(n, 2400 + n + step, 1e-2f);
      d_g.upload(g);
      d_copy.poison();
      adamw_cpu(w, g, m, v, lr, beta1, beta2, eps, wd, step);
      gpu::adamw_step<T>(d_w.data(), d_g.data(), d_m.data(), d_v.data(), n, lr, beta1, beta2, eps, wd, step,
                         d_copy.data(), nullptr);
      const std::vector<float> got_w = d_w.download();
      EXPECT_TRUE(close_to(got_w, w, {1e-6, 1e-7})) << "w, step " << step;
      EXPECT_TRUE(close_to(d_m.download(), m, {1e-6, 1e-7})) << "m, step " << step;
      EXPECT_TRUE(close_to(d_v.download(), v, {1e-6, 1e-7})) << "v, step " << step;
      EXPECT_TRUE(bitwise_equal(d_copy.download(), from_floats<T>(got_w))) << "copy, step " << step;
    }
  }
}

TEST(OpsCudaF32, AdamWWithoutCopy) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 777;
  std::vector<float> w = random_values(n, 2500, 0.05f), g = random_values(n, 2501, 1e-2f), m(size_t(n), 0.0f),
                     v(size_t(n), 0.0f);
  DeviceArray<float> d_w(w), d_g(g), d_m(m), d_v(v);
  adamw_cpu(w, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
  gpu::adamw_step<float>(d_w.data(), d_g.data(), d_m.data(), d_v.data(), n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1, nullptr,
                         nullptr);
  EXPECT_TRUE(close_to(d_w.download(), w, {1e-6, 1e-7}));
  EXPECT_TRUE(close_to(d_m.download(), m, {1e-6, 1e-7}));
  EXPECT_TRUE(close_to(d_v.download(), v, {1e-6, 1e-7}));
}

// Pure bf16 against its CPU twin, bit for bit (both do the header's fp32 operations on the widened values,
// each rounded once), on aligned arrays (the packed path) and on arrays one element off (element by element).
TEST(OpsCudaBf16, AdamWBf16MatchesCpuBitwise) {
  SKIP_WITHOUT_GPU();
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE(dims({{"n", n}, {"offset", offset}}));
      std::vector<bf16_t> w = from_floats<bf16_t>(random_values<bf16_t>(n + offset, 3200 + n, 0.05f));
      std::vector<bf16_t> m = from_floats<bf16_t>(random_values<bf16_t>(n + offset, 3300 + n, 1e-3f));
      std::vector<bf16_t> v = from_floats<bf16_t>(random_values<bf16_t>(n + offset, 3400 + n, 1e-3f));
      for (bf16_t& x : v) x = bf16_t(float(x) * float(x));  // second moments are non-negative
      DeviceArray<bf16_t> d_w(w), d_m(m), d_v(v), d_g(n + offset);
      for (int64_t step = 1; step <= 3; ++step) {
        const std::vector<bf16_t> g = from_floats<bf16_t>(random_values<bf16_t>(n + offset, 3500 + n + step, 1e-2f));
        const float grad_scale = step == 2 ? 0.37f : 1.0f;
        d_g.upload(g);
        cpu::adamw_step_bf16(w.data() + offset, g.data() + offset, m.data() + offset, v.data() + offset, n, lr, beta1,
                             beta2, eps, wd, step, grad_scale);
        gpu::adamw_step_bf16(d_w.data() + offset, d_g.data() + offset, d_m.data() + offset, d_v.data() + offset, n, lr,
                             beta1, beta2, eps, wd, step, nullptr, grad_scale);
        EXPECT_TRUE(bitwise_equal(d_w.download(), w)) << "w, step " << step;
        EXPECT_TRUE(bitwise_equal(d_m.download(), m)) << "m, step " << step;
        EXPECT_TRUE(bitwise_equal(d_v.download(), v)) << "v, step " << step;
      }
    }
  }
}

// fp32 masters with bf16 moments against the CPU twin, bit for bit, for each copy type, both roundings
// (the stochastic one counting from a first index that is not 0), with a clipping factor on one step, on
// aligned arrays (the packed path) and on arrays one element off (element by element).
TYPED_TEST(OpsCuda, AdamWBf16MomentsMatchesCpuBitwise) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  for (const bool stochastic : {false, true}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
      for (int64_t offset : {int64_t{0}, int64_t{1}}) {
        SCOPED_TRACE(dims({{"stochastic", stochastic}, {"n", n}, {"offset", offset}}));
        const MomentRounding rounding{stochastic, 4242};
        const int64_t first = stochastic ? 1000003 : 0;
        std::vector<float> w = random_values(n + offset, 3600 + n, 0.05f);
        std::vector<bf16_t> m = from_floats<bf16_t>(random_values<bf16_t>(n + offset, 3700 + n, 1e-3f));
        std::vector<bf16_t> v = from_floats<bf16_t>(random_values<bf16_t>(n + offset, 3800 + n, 1e-3f));
        for (bf16_t& x : v) x = bf16_t(float(x) * float(x));  // second moments are non-negative
        DeviceArray<float> d_w(w), d_g(n + offset);
        DeviceArray<bf16_t> d_m(m), d_v(v);
        DeviceArray<T> d_copy(n + offset);
        for (int64_t step = 1; step <= 3; ++step) {
          std::vector<float> g = random_values(n + offset, 3900 + n + step, 1e-2f);
          const float grad_scale = step == 2 ? 0.37f : 1.0f;
          d_g.upload(g);
          d_copy.poison();
          for (float& x : g) x *= grad_scale;  // the CPU twin takes clipped gradients
          cpu::adamw_step_bf16_moments(w.data() + offset, g.data() + offset, m.data() + offset, v.data() + offset, n,
                                       lr, beta1, beta2, eps, wd, step, rounding, first);
          gpu::adamw_step_bf16_moments<T>(d_w.data() + offset, d_g.data() + offset, d_m.data() + offset,
                                          d_v.data() + offset, n, lr, beta1, beta2, eps, wd, step, rounding, first,
                                          d_copy.data() + offset, nullptr, grad_scale);
          const std::vector<float> got_w = d_w.download();
          EXPECT_TRUE(bitwise_equal(got_w, w)) << "w, step " << step;
          EXPECT_TRUE(bitwise_equal(d_m.download(), m)) << "m, step " << step;
          EXPECT_TRUE(bitwise_equal(d_v.download(), v)) << "v, step " << step;
          const std::vector<T> copy = d_copy.download(), want = from_floats<T>(got_w);
          EXPECT_TRUE(bitwise_equal(std::vector<T>(copy.begin() + offset, copy.end()),
                                    std::vector<T>(want.begin() + offset, want.end())))
              << "copy, step " << step;
        }
      }
    }
  }
}

// FP8 training's weight amaxes from the AdamW step (StoredAmaxes): every variant that stores bf16 weights (fp32
// masters with fp32 or bf16 moments and a bf16 copy, fixed and live scalars, both moment roundings; pure bf16),
// with ranges that start and end off the packs, lie side by side, cross a chunk of the amax step and run to the
// end, writes for each range the bits fp8_amax computes over the stored values afterwards, and leaves every array
// with the bits of the step without amaxes. A NaN gradient inside a range makes its amax NaN; one in a gap touches
// no amax. Aligned arrays (packed) and arrays one element off.
TEST(OpsCudaBf16, AdamWWritesTheAmaxesOfTheWeightsItStores) {
  SKIP_WITHOUT_GPU();
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  const AdamWScalars scalars = adamw_scalars(lr, beta1, beta2, eps, wd, 2, 0.5f);
  DeviceArray<AdamWScalars> live(std::vector<AdamWScalars>{scalars});
  enum class Variant { masters, masters_live, moments, moments_stochastic, moments_live, pure, pure_live };
  for (Variant variant : {Variant::masters, Variant::masters_live, Variant::moments, Variant::moments_stochastic,
                          Variant::moments_live, Variant::pure, Variant::pure_live}) {
    for (int64_t n : {int64_t{1000}, int64_t{200003}}) {
      for (int64_t offset : {int64_t{0}, int64_t{1}}) {
        SCOPED_TRACE(dims({{"variant", int64_t(variant)}, {"n", n}, {"offset", offset}}));
        std::vector<AmaxRange> ranges =
            n == 1000 ? std::vector<AmaxRange>{{0, 1}, {5, 8}, {13, 7}, {100, 800}}
                      : std::vector<AmaxRange>{{3, 1000}, {1003, 68997}, {131067, 14}, {150001, 50002}};
        const size_t nan_range = n == 1000 ? 1 : 0;  // the range holding element 7
        DeviceArray<float> amaxes(int64_t(ranges.size())), reduced(1);
        for (size_t i = 0; i < ranges.size(); ++i) ranges[i].amax = amaxes.data() + i;
        DeviceArray<AmaxRange> table(ranges);
        const StoredAmaxes stored{table.data(), int(ranges.size())};
        std::vector<float> g = random_values(n + offset, 4100 + n, 1e-2f);
        g[size_t(offset + 7)] = std::numeric_limits<float>::quiet_NaN();  // in range nan_range
        g[size_t(offset + (n == 1000 ? 950 : 100000))] = std::numeric_limits<float>::quiet_NaN();  // in a gap
        const std::vector<float> w = random_values(n + offset, 4200 + n, 0.05f),
                                 m = random_values(n + offset, 4300 + n, 1e-3f);
        std::vector<float> v = random_values(n + offset, 4400 + n, 1e-3f);
        for (float& x : v) x *= x;
        // One run: the arrays after the step, as bytes, and (with) the amaxes.
        const auto run = [&](bool with) {
          const StoredAmaxes amax = with ? stored : StoredAmaxes{};
          const bool pure = variant == Variant::pure || variant == Variant::pure_live;
          DeviceArray<float> d_w(w), d_g(g), d_m(m), d_v(v);
          DeviceArray<bf16_t> b_w = device_copy<bf16_t>(w), b_g = device_copy<bf16_t>(g), b_m = device_copy<bf16_t>(m),
                              b_v = device_copy<bf16_t>(v), copy(n + offset);
          copy.poison();
          amaxes.poison();
          if (with) gpu::memset_async(amaxes.data(), 0, amaxes.bytes(), nullptr);  // the caller clears them
          const int64_t o = offset;
          switch (variant) {
            case Variant::masters:
              gpu::adamw_step<bf16_t>(d_w.data() + o, d_g.data() + o, d_m.data() + o, d_v.data() + o, n, lr, beta1,
                                      beta2, eps, wd, 2, copy.data() + o, nullptr, 0.5f, amax);
              break;
            case Variant::masters_live:
              gpu::adamw_step_live<bf16_t>(d_w.data() + o, d_g.data() + o, d_m.data() + o, d_v.data() + o, n,
                                           live.data(), copy.data() + o, nullptr, amax);
              break;
            case Variant::moments:
            case Variant::moments_stochastic:
              gpu::adamw_step_bf16_moments<bf16_t>(d_w.data() + o, d_g.data() + o, b_m.data() + o, b_v.data() + o, n,
                                                   lr, beta1, beta2, eps, wd, 2,
                                                   {variant == Variant::moments_stochastic, 77}, 12345,
                                                   copy.data() + o, nullptr, 0.5f, amax);
              break;
            case Variant::moments_live:
              gpu::adamw_step_bf16_moments_live<bf16_t>(d_w.data() + o, d_g.data() + o, b_m.data() + o,
                                                        b_v.data() + o, n, live.data(), false, 0, copy.data() + o,
                                                        nullptr, amax);
              break;
            case Variant::pure:
              gpu::adamw_step_bf16(b_w.data() + o, b_g.data() + o, b_m.data() + o, b_v.data() + o, n, lr, beta1, beta2,
                                   eps, wd, 2, nullptr, 0.5f, amax);
              break;
            case Variant::pure_live:
              gpu::adamw_step_bf16_live(b_w.data() + o, b_g.data() + o, b_m.data() + o, b_v.data() + o, n,
                                        live.data(), nullptr, amax);
              break;
          }
          struct Result {
            std::vector<float> w, m, v;
            std::vector<bf16_t> stored, bm, bv;
            std::vector<float> amax;
          };
          Result r{d_w.download(), d_m.download(), d_v.download(), pure ? b_w.download() : copy.download(),
                   b_m.download(), b_v.download(), amaxes.download()};
          // The weights as stored, checked against fp8_amax over each range, on the device.
          if (with) {
            const bf16_t* values = pure ? b_w.data() + o : copy.data() + o;
            for (size_t i = 0; i < ranges.size(); ++i) {
              reduced.poison();
              gpu::fp8_amax<bf16_t>(values + ranges[i].begin, ranges[i].count, reduced.data(), nullptr);
              EXPECT_EQ(std::bit_cast<uint32_t>(r.amax[i]), std::bit_cast<uint32_t>(reduced.download()[0]))
                  << "range " << i;
            }
          }
          return r;
        };
        const auto with = run(true), without = run(false);
        EXPECT_TRUE(bitwise_equal(with.w, without.w)) << "w";
        EXPECT_TRUE(bitwise_equal(with.m, without.m)) << "m";
        EXPECT_TRUE(bitwise_equal(with.v, without.v)) << "v";
        EXPECT_TRUE(bitwise_equal(with.stored, without.stored)) << "the stored bf16 weights";
        EXPECT_TRUE(bitwise_equal(with.bm, without.bm)) << "bf16 m";
        EXPECT_TRUE(bitwise_equal(with.bv, without.bv)) << "bf16 v";
        for (size_t i = 0; i < ranges.size(); ++i) {
          EXPECT_EQ(std::isnan(with.amax[i]), i == nan_range) << "range " << i << " (NaN only where its gradient was)";
        }
      }
    }
  }
  // Amaxes are of a bf16 copy as stored: none, or another type's, is an Error; so is a table without entries.
  DeviceArray<float> w(16);
  DeviceArray<AmaxRange> table(std::vector<AmaxRange>{{0, 16, w.data()}});
  const StoredAmaxes stored{table.data(), 1};
  DeviceArray<fp16_t> half(16);
  EXPECT_THROW(gpu::adamw_step<float>(w.data(), w.data(), w.data(), w.data(), 16, lr, beta1, beta2, eps, wd, 1, nullptr,
                                      nullptr, 1.0f, stored),
               Error);
  EXPECT_THROW(gpu::adamw_step<fp16_t>(w.data(), w.data(), w.data(), w.data(), 16, lr, beta1, beta2, eps, wd, 1,
                                       half.data(), nullptr, 1.0f, stored),
               Error);
  DeviceArray<bf16_t> b(16);
  EXPECT_THROW(gpu::adamw_step_bf16(b.data(), b.data(), b.data(), b.data(), 16, lr, beta1, beta2, eps, wd, 1, nullptr,
                                    1.0f, StoredAmaxes{nullptr, 2}),
               Error);
}

// FP8 training's weight copies written by the AdamW step (Fp8WeightCopies): for fp32 masters with fp32 or bf16
// moments (both roundings), fixed and live scalars, fp32 and bf16 gradients, weights that span several strips and
// partial tiles, lie side by side or apart, with the other elements in chunks around them: every array gets the
// bits of the plain step; each weight's slot the bound of the amax it held (fp8_weight_bound), that bound's
// dequantisation scale and the amax of the stored bf16 copy; q the encoded new masters at the bound's scale, qt its
// transpose; and no stored weight exceeds its bound (the moments come from a history of steps, as the bound needs).
// With the weights' bf16 copies off (Fp8WeightCopies::weights_bf16), their part of the bf16 copy keeps what it
// held (poison here) and everything else is as above, the amaxes those of the bf16 values not written.
TEST(OpsCudaBf16, AdamWWritesTheFp8CopiesOfTheWeightsItStores) {
  SKIP_WITHOUT_GPU();
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  const int64_t step = 3;
  const AdamWScalars scalars = adamw_scalars(lr, beta1, beta2, eps, wd, step, 0.5f);
  DeviceArray<AdamWScalars> live(std::vector<AdamWScalars>{scalars});
  struct Weight {
    int64_t begin, rows, cols;
  };
  const std::vector<Weight> weights = {{40, 520, 200}, {40 + 520 * 200, 192, 64}, {40 + 520 * 200 + 192 * 64 + 16, 8, 8}};
  const int64_t n = weights.back().begin + 64 + 1003;
  std::vector<ElementChunk> rest;
  int64_t at = 0;
  for (const Weight& x : weights) {
    for (int64_t a = at; a < x.begin; a += 7000) rest.push_back({a, std::min<int64_t>(7000, x.begin - a)});
    at = x.begin + x.rows * x.cols;
  }
  for (int64_t a = at; a < n; a += 7000) rest.push_back({a, std::min<int64_t>(7000, n - a)});
  DeviceArray<ElementChunk> d_rest(rest);
  enum class Variant { masters, masters_live, moments, moments_stochastic, moments_live };
  for (int variant_grads = 0; variant_grads < 20; ++variant_grads) {
    const auto variant = Variant(variant_grads % 5);
    const bool bf16_grads = variant_grads % 10 >= 5;  // ModelOptions::grad_dtype bf16: the same step on bf16 gradients
    const bool weights_bf16 = variant_grads < 10;
    SCOPED_TRACE(dims({{"variant", int64_t(variant)}, {"bf16 gradients", int64_t(bf16_grads)},
                       {"weights' bf16 copies", int64_t(weights_bf16)}}));
    // The state after step - 1 steps from zero moments (the bound holds for moments with a history, which
    // random ones need not be), on the CPU.
    std::vector<float> w = random_values(n, 5100, 0.05f), m(size_t(n), 0.0f), v(size_t(n), 0.0f);
    for (int64_t s = 1; s < step; ++s) {
      const std::vector<float> gs = random_values(n, 5300 + s, 1e-2f);
      cpu::adamw_step(w.data(), gs.data(), m.data(), v.data(), n, lr, beta1, beta2, eps, wd, s);
    }
    const std::vector<float> g = random_values(n, 5200, 1e-2f);
    // Each slot's amax before the step: its weight's bf16 copy's.
    std::vector<float> slots(weights.size() * kFp8ScaleSlotFloats, 0.0f);
    for (size_t r = 0; r < weights.size(); ++r) {
      float amax = 0.0f;
      for (int64_t i = 0; i < weights[r].rows * weights[r].cols; ++i) {
        amax = std::max(amax, std::fabs(float(bf16_t(w[size_t(weights[r].begin + i)]))));
      }
      slots[r * kFp8ScaleSlotFloats + kFp8AmaxIndex] = amax;
    }
    DeviceArray<float> d_slots(slots);
    std::vector<DeviceArray<uint8_t>> q, qt;
    std::vector<Fp8WeightCopy> table;
    int64_t blocks = 0;
    for (size_t r = 0; r < weights.size(); ++r) {
      q.emplace_back(weights[r].rows * weights[r].cols);
      qt.emplace_back(weights[r].rows * weights[r].cols);
      q.back().poison();
      qt.back().poison();
      table.push_back({weights[r].begin, weights[r].rows, weights[r].cols, q.back().data(), qt.back().data(),
                       d_slots.data() + r * kFp8ScaleSlotFloats, blocks});
      blocks += fp8_copy_blocks(weights[r].rows, weights[r].cols);
    }
    DeviceArray<Fp8WeightCopy> d_table(table);
    StoredAmaxes copies;
    copies.copies = {d_table.data(), int(table.size()), blocks, d_rest.data(), int(rest.size()), weights_bf16};
    const auto run = [&](const StoredAmaxes& amax) {
      DeviceArray<float> d_w(w), d_g(g), d_m(m), d_v(v);
      DeviceArray<bf16_t> b_m = device_copy<bf16_t>(m), b_v = device_copy<bf16_t>(v), b_g = device_copy<bf16_t>(g),
                          copy(n);
      copy.poison();
      const auto step_with = [&](const auto* grad) {
        using G = std::remove_cv_t<std::remove_pointer_t<decltype(grad)>>;
        switch (variant) {
          case Variant::masters:
            gpu::adamw_step<bf16_t, G>(d_w.data(), grad, d_m.data(), d_v.data(), n, lr, beta1, beta2, eps, wd, step,
                                       copy.data(), nullptr, 0.5f, amax);
            break;
          case Variant::masters_live:
            gpu::adamw_step_live<bf16_t, G>(d_w.data(), grad, d_m.data(), d_v.data(), n, live.data(), copy.data(),
                                            nullptr, amax);
            break;
          case Variant::moments:
          case Variant::moments_stochastic:
            gpu::adamw_step_bf16_moments<bf16_t, G>(d_w.data(), grad, b_m.data(), b_v.data(), n, lr, beta1, beta2,
                                                    eps, wd, step, {variant == Variant::moments_stochastic, 77}, 0,
                                                    copy.data(), nullptr, 0.5f, amax);
            break;
          case Variant::moments_live:
            gpu::adamw_step_bf16_moments_live<bf16_t, G>(d_w.data(), grad, b_m.data(), b_v.data(), n, live.data(),
                                                         false, 0, copy.data(), nullptr, amax);
            break;
        }
      };
      if (bf16_grads) {
        step_with(static_cast<const bf16_t*>(b_g.data()));
      } else {
        step_with(static_cast<const float*>(d_g.data()));
      }
      struct Result {
        std::vector<float> w, m, v;
        std::vector<bf16_t> copy, bm, bv;
      };
      return Result{d_w.download(), d_m.download(), d_v.download(), copy.download(), b_m.download(), b_v.download()};
    };
    const auto with = run(copies), without = run(StoredAmaxes{});
    EXPECT_TRUE(bitwise_equal(with.w, without.w)) << "w";
    EXPECT_TRUE(bitwise_equal(with.m, without.m)) << "m";
    EXPECT_TRUE(bitwise_equal(with.v, without.v)) << "v";
    if (weights_bf16) {
      EXPECT_TRUE(bitwise_equal(with.copy, without.copy)) << "the stored bf16 weights";
    } else {  // the weights' part still poison, the rest the plain step's
      std::vector<bf16_t> want = without.copy;
      for (const Weight& x : weights) {
        std::fill_n(want.begin() + x.begin, x.rows * x.cols, std::bit_cast<bf16_t>(uint16_t{0xFFFF}));
      }
      EXPECT_TRUE(bitwise_equal(with.copy, want)) << "the stored bf16 copy: written outside the weights only";
    }
    EXPECT_TRUE(bitwise_equal(with.bm, without.bm)) << "bf16 m";
    EXPECT_TRUE(bitwise_equal(with.bv, without.bv)) << "bf16 v";
    const std::vector<float> got_slots = d_slots.download();
    for (size_t r = 0; r < weights.size(); ++r) {
      SCOPED_TRACE(dims({{"weight", int64_t(r)}}));
      const Weight& x = weights[r];
      const float* slot = got_slots.data() + r * kFp8ScaleSlotFloats;
      const float bound = fp8_weight_bound(slots[r * kFp8ScaleSlotFloats + kFp8AmaxIndex], scalars);
      EXPECT_EQ(std::bit_cast<uint32_t>(slot[kFp8BoundIndex]), std::bit_cast<uint32_t>(bound));
      const float scale = fp8_scale(bound, Fp8Format::e4m3);
      EXPECT_EQ(std::bit_cast<uint32_t>(slot[kFp8DequantIndex]), std::bit_cast<uint32_t>(fp8_dequant_scale(scale)));
      float amax = 0.0f, largest = 0.0f;
      const std::vector<uint8_t> got_q = q[r].download(), got_qt = qt[r].download();
      int64_t bad_q = 0, bad_qt = 0;
      for (int64_t i = 0; i < x.rows; ++i) {
        for (int64_t j = 0; j < x.cols; ++j) {
          const auto e = size_t(x.begin + i * x.cols + j);
          amax = std::max(amax, std::fabs(float(without.copy[e])));  // the plain step's bf16 copy
          largest = std::max(largest, std::fabs(with.w[e]));
          const uint8_t want = fp8_encode(with.w[e] * scale, Fp8Format::e4m3);
          bad_q += got_q[size_t(i * x.cols + j)] != want;
          bad_qt += got_qt[size_t(j * x.rows + i)] != want;
        }
      }
      EXPECT_EQ(bad_q, 0) << "q bytes not encode(w · scale)";
      EXPECT_EQ(bad_qt, 0) << "qt bytes not q's transpose";
      EXPECT_EQ(std::bit_cast<uint32_t>(slot[kFp8AmaxIndex]), std::bit_cast<uint32_t>(amax)) << "the bf16 copy's amax";
      EXPECT_LE(largest, bound);
    }
  }
  // Copies are of fp32 masters with a bf16 copy: pure bf16, or no copy, is an Error.
  DeviceArray<bf16_t> b(16);
  StoredAmaxes bad;
  bad.copies.count = 1;
  EXPECT_THROW(gpu::adamw_step_bf16(b.data(), b.data(), b.data(), b.data(), 16, lr, beta1, beta2, eps, wd, 1, nullptr,
                                    1.0f, bad),
               Error);
  DeviceArray<float> f(16);
  EXPECT_THROW(gpu::adamw_step<float>(f.data(), f.data(), f.data(), f.data(), 16, lr, beta1, beta2, eps, wd, 1, nullptr,
                                      nullptr, 1.0f, bad),
               Error);
}

// bf16 gradients beside fp32 masters (ModelOptions::grad_dtype, the experiment): every fp32-master variant (fp32
// and bf16 moments, both roundings, fixed and live scalars, a clipping factor, with and without the FP8 amaxes)
// reading bf16 gradients gives the bits of the same step on those gradients widened to fp32 — the widening is
// exact, so the step is the fp32 step, and one kernel serves both. Packed (aligned) and element by element (one
// off), with a tail.
TEST(OpsCudaBf16, AdamWWithBf16GradientsIsTheStepOnTheWidenedGradients) {
  SKIP_WITHOUT_GPU();
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  AdamWScalars scalars = adamw_scalars(lr, beta1, beta2, eps, wd, 2, 0.5f);
  scalars.rounding_key = moment_rounding_key(77, 2);
  DeviceArray<AdamWScalars> live(std::vector<AdamWScalars>{scalars});
  enum class Variant { masters, masters_live, moments, moments_stochastic, moments_live };
  for (Variant variant :
       {Variant::masters, Variant::masters_live, Variant::moments, Variant::moments_stochastic, Variant::moments_live}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      for (bool with_amax : {false, true}) {
        const int64_t n = 1003;
        SCOPED_TRACE(dims({{"variant", int64_t(variant)}, {"offset", offset}, {"amax", int64_t(with_amax)}}));
        DeviceArray<float> amaxes(1);
        const std::vector<AmaxRange> ranges{{5, 900, amaxes.data()}};
        DeviceArray<AmaxRange> table(ranges);
        const StoredAmaxes amax = with_amax ? StoredAmaxes{table.data(), 1} : StoredAmaxes{};
        // bf16 values (random_values<bf16_t>), so that the widened copy holds exactly what the bf16 array does.
        const std::vector<float> g = random_values<bf16_t>(n + offset, 5100, 1e-2f),
                                 w = random_values(n + offset, 5200, 0.05f), m = random_values(n + offset, 5300, 1e-3f);
        std::vector<float> v = random_values(n + offset, 5400, 1e-3f);
        for (float& x : v) x *= x;
        struct Result {
          std::vector<float> w, m, v;
          std::vector<bf16_t> copy, bm, bv;
          std::vector<float> amax;
        };
        const auto run = [&](auto gradient_type) {
          using G = decltype(gradient_type);
          DeviceArray<float> d_w(w), d_m(m), d_v(v);
          DeviceArray<G> d_g = device_copy<G>(g);
          DeviceArray<bf16_t> b_m = device_copy<bf16_t>(m), b_v = device_copy<bf16_t>(v), copy(n + offset);
          copy.poison();
          gpu::memset_async(amaxes.data(), 0, amaxes.bytes(), nullptr);
          const int64_t o = offset;
          const G* gp = d_g.data() + o;
          switch (variant) {
            case Variant::masters:
              gpu::adamw_step<bf16_t>(d_w.data() + o, gp, d_m.data() + o, d_v.data() + o, n, lr, beta1, beta2, eps, wd,
                                      2, copy.data() + o, nullptr, 0.5f, amax);
              break;
            case Variant::masters_live:
              gpu::adamw_step_live<bf16_t>(d_w.data() + o, gp, d_m.data() + o, d_v.data() + o, n, live.data(),
                                           copy.data() + o, nullptr, amax);
              break;
            case Variant::moments:
            case Variant::moments_stochastic:
              gpu::adamw_step_bf16_moments<bf16_t>(d_w.data() + o, gp, b_m.data() + o, b_v.data() + o, n, lr, beta1,
                                                   beta2, eps, wd, 2, {variant == Variant::moments_stochastic, 77},
                                                   12345, copy.data() + o, nullptr, 0.5f, amax);
              break;
            case Variant::moments_live:
              gpu::adamw_step_bf16_moments_live<bf16_t>(d_w.data() + o, gp, b_m.data() + o, b_v.data() + o, n,
                                                        live.data(), true, 12345, copy.data() + o, nullptr, amax);
              break;
          }
          return Result{d_w.download(), d_m.download(), d_v.download(), copy.download(),
                        b_m.download(), b_v.download(), amaxes.download()};
        };
        const Result b = run(bf16_t{}), f = run(float{});
        EXPECT_TRUE(bitwise_equal(b.w, f.w)) << "w";
        EXPECT_TRUE(bitwise_equal(b.m, f.m)) << "m";
        EXPECT_TRUE(bitwise_equal(b.v, f.v)) << "v";
        EXPECT_TRUE(bitwise_equal(b.copy, f.copy)) << "the bf16 copy";
        EXPECT_TRUE(bitwise_equal(b.bm, f.bm)) << "bf16 m";
        EXPECT_TRUE(bitwise_equal(b.bv, f.bv)) << "bf16 v";
        if (with_amax) {
          EXPECT_EQ(std::bit_cast<uint32_t>(b.amax[0]), std::bit_cast<uint32_t>(f.amax[0])) << "amax";
        }
        EXPECT_FALSE(bitwise_equal(f.w, w)) << "the step changed no weight";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Reductions and utilities.

// gpu::squared_norm of x is within 1e-12 of `want` (an fp64 sum in index order) and the same bits twice.
template <class T>
void expect_squared_norm(const std::vector<T>& x, double want) {
  DeviceArray<T> d_x(x);
  DeviceArray<double> d_out(1);
  std::vector<double> first;
  for (int run = 0; run < 2; ++run) {
    d_out.poison();
    gpu::squared_norm(d_x.data(), int64_t(x.size()), d_out.data(), nullptr);
    const std::vector<double> got = d_out.download();
    EXPECT_NEAR(got[0], want, 1e-12 * want);
    if (run == 0) first = got;
    else EXPECT_TRUE(bitwise_equal(got, first)) << "two runs differ";
  }
}

TEST(OpsCudaF32, SquaredNormIsExactEnoughAndReproducible) {
  SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{8192}, int64_t{(1 << 20) + 3}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    const std::vector<float> x = random_values(n, 2600 + n);
    double want = 0;
    for (float v : x) want += double(v) * double(v);
    expect_squared_norm(x, want);
  }
  DeviceArray<double> d_out(1);
  d_out.poison();
  gpu::squared_norm<float>(nullptr, 0, d_out.data(), nullptr);
  EXPECT_EQ(d_out.download()[0], 0.0);
}

TEST(OpsCudaBf16, SquaredNormOfBf16GradientsMatchesCpuAndIsReproducible) {
  SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t{1}, int64_t{8193}, int64_t{(1 << 20) + 3}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    const std::vector<bf16_t> x = from_floats<bf16_t>(random_values<bf16_t>(n, 3600 + n));
    expect_squared_norm(x, cpu::sum_squares(x.data(), n));
  }
}

TYPED_TEST(OpsCuda, CountNonfinite) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    std::vector<float> x = random_values<T>(n, 2700 + n);
    DeviceArray<T> d_x = device_copy<T>(x);
    DeviceArray<int> d_count(1);
    d_count.poison();
    gpu::count_nonfinite<T>(d_x.data(), n, d_count.data(), nullptr);
    EXPECT_EQ(d_count.download()[0], 0);

    x[0] = std::numeric_limits<float>::quiet_NaN();
    x[size_t(n / 2)] = std::numeric_limits<float>::infinity();
    x[size_t(n - 1)] = -std::numeric_limits<float>::infinity();
    int want = 0;
    for (float v : x) want += std::isfinite(to_f(from_f<T>(v))) ? 0 : 1;
    d_x.upload(from_floats<T>(x));
    d_count.poison();
    gpu::count_nonfinite<T>(d_x.data(), n, d_count.data(), nullptr);
    EXPECT_EQ(d_count.download()[0], want);
  }
}

TYPED_TEST(OpsCuda, CastsAndResidualAdd) {
  SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    SCOPED_TRACE(dims({{"n", n}}));
    const std::vector<float> src = random_values(n, 2800 + n, 3.0f);  // not representable in T: rounding
    DeviceArray<float> d_src(src), d_back(n);
    DeviceArray<T> d_dst(n);
    d_dst.poison();
    d_back.poison();
    gpu::cast_from_f32<T>(d_src.data(), d_dst.data(), n, nullptr);
    gpu::cast_to_f32<T>(d_dst.data(), d_back.data(), n, nullptr);
    const std::vector<T> rounded = from_floats<T>(src);
    EXPECT_TRUE(bitwise_equal(d_dst.download(), rounded)) << "cast_from_f32 (round to nearest even)";
    EXPECT_TRUE(bitwise_equal(d_back.download(), to_floats(rounded))) << "cast_to_f32";

    const std::vector<float> y = random_values<T>(n, 2900 + n), x = random_values<T>(n, 3000 + n);
    DeviceArray<T> d_y = device_copy<T>(y), d_x = device_copy<T>(x);
    gpu::add_inplace<T>(d_y.data(), d_x.data(), n, nullptr);
    std::vector<float> sum(static_cast<size_t>(n));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = y[i] + x[i];
    EXPECT_TRUE(bitwise_equal(d_y.download(), from_floats<T>(sum))) << "add_inplace";
  }
}

TEST(OpsCudaF32, ScaleInplace) {
  SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    std::vector<float> x = random_values(n, 3100 + n);
    DeviceArray<float> d_x(x);
    gpu::scale_inplace(d_x.data(), n, 0.37f, nullptr);
    for (float& v : x) v *= 0.37f;
    EXPECT_TRUE(bitwise_equal(d_x.download(), x)) << "n = " << n;
  }
}

// Argument checks run on the host before anything touches the GPU, so they need none.
TEST(OpsCudaErrors, BadSizesAreErrors) {
  float* f = nullptr;
  int32_t* i = nullptr;
  EXPECT_THROW(gpu::rmsnorm_forward<float>(f, f, f, f, -1, 32, 1e-5f, nullptr), Error);
  EXPECT_THROW(gpu::rmsnorm_forward<float>(f, f, f, f, 4, 0, 1e-5f, nullptr), Error);
  EXPECT_THROW(gpu::rmsnorm_backward<bf16_t>(nullptr, nullptr, f, f, nullptr, f, 4, 0, nullptr), Error);
  EXPECT_THROW(gpu::rope_forward<float>(f, f, f, 1, 1, 1, 31, nullptr), Error);
  EXPECT_THROW(gpu::rope_backward<fp16_t>(nullptr, f, f, 1, 1, 1, 0, nullptr), Error);
  EXPECT_THROW(gpu::swiglu_forward<float>(f, f, f, -2, nullptr), Error);
  EXPECT_THROW(gpu::cross_entropy_forward<float>(f, i, f, 3, 0, nullptr), Error);
  EXPECT_THROW(gpu::cross_entropy_backward<float>(f, i, 3, 0, 1.0f, nullptr), Error);
  EXPECT_THROW(gpu::embedding_forward<float>(f, i, f, 3, 0, 10, nullptr), Error);
  EXPECT_THROW(gpu::embedding_backward<float>(f, i, f, 3, 8, 0, nullptr), Error);
  EXPECT_THROW(gpu::adamw_step<float>(f, f, f, f, 10, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0, nullptr, nullptr), Error);
  EXPECT_THROW(gpu::squared_norm(f, -1, nullptr, nullptr), Error);
  bf16_t* b = nullptr;
  EXPECT_THROW(gpu::squared_norm(b, -1, nullptr, nullptr), Error);
  EXPECT_THROW(gpu::adamw_step_bf16(b, b, b, b, 10, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0, nullptr), Error);
  EXPECT_THROW(gpu::adamw_step_bf16(b, b, b, b, 10, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, nullptr), Error);  // null arrays
  EXPECT_THROW(gpu::adamw_step_bf16_moments<float>(nullptr, static_cast<const float*>(nullptr), b, b, 10, 1e-3, 0.9,
                                                   0.95, 1e-8, 0.1, 1, {}, 0, nullptr, nullptr),
               Error);  // null arrays
  EXPECT_THROW(gpu::adamw_step_bf16_moments<float>(nullptr, static_cast<const float*>(nullptr), b, b, 10, 1e-3, 0.9,
                                                   0.95, 1e-8, 0.1, 0, {}, 0, nullptr, nullptr),
               Error);  // step 0
  EXPECT_THROW(gpu::lm_head_loss_forward_backward<bf16_t>(b, b, i, 4, 8, 16, 0, 1.0f, f, b, f, b, nullptr), Error);
  EXPECT_THROW(gpu::lm_head_loss_forward_backward<bf16_t>(b, b, i, 4, 8, 16, 2, 1.0f, nullptr, nullptr, nullptr, b,
                                                          nullptr),
               Error);  // neither a loss nor gradients asked for
  // Empty inputs queue nothing.
  EXPECT_NO_THROW(gpu::swiglu_forward<float>(f, f, f, 0, nullptr));
  EXPECT_NO_THROW(gpu::rmsnorm_forward<float>(f, f, f, f, 0, 32, 1e-5f, nullptr));
}

}  // namespace

#else  // !FLASHLM_WITH_CUDA

TEST(OpsCuda, NeedsCuda) { GTEST_SKIP() << "flashlm was built without CUDA"; }

#endif
