// Element types, and the two 16-bit and two FP8 floating-point formats as plain value types.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace flashlm {

// f8e4m3: OCP FP8 E4M3 (PyTorch's float8_e4m3fn, CUDA's __nv_fp8_e4m3): the inputs of the FP8 attention
// forward (flashlm/attention.h), the one API tensor dtype of FP8; FP8 training's e4m3 copies (f8e4m3_t) stay
// inside its linear layers (flashlm/fp8.h).
enum class DType : uint8_t { f64, f32, f16, bf16, f8e4m3 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);            // "fp64", "fp32", "fp16", "bf16", "fp8_e4m3"
// Accepts the names above, float64/float32/float16/bfloat16, and fp8 / float8_e4m3fn for fp8_e4m3.
DType parse_dtype(std::string_view name);

// IEEE binary16, stored as bits. Same layout as CUDA's __half.
struct fp16_t {
  uint16_t bits = 0;
  fp16_t() = default;
  explicit fp16_t(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    // Round to nearest even, with subnormals, overflow to inf and NaN kept quiet.
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (abs < 0x38800000u) {                                                // below the smallest normal
      if (abs < 0x33000000u) return static_cast<uint16_t>(sign);           // below half the smallest subnormal
      const uint32_t exp = abs >> 23;
      const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
      const uint32_t shift = 126 - exp;                                     // 14 + (112 - exp)
      uint32_t h = mant >> shift;
      const uint32_t rem = mant & ((1u << shift) - 1);
      const uint32_t halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
      return static_cast<uint16_t>(sign | h);
    }
    uint32_t h = ((abs - 0x38000000u) >> 13);
    const uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  static float to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
      if (mant == 0) return std::bit_cast<float>(sign);
      int e = -1;
      do { mant <<= 1; ++e; } while (!(mant & 0x400u));
      return std::bit_cast<float>(sign | static_cast<uint32_t>(112 - e) << 23 | (mant & 0x3ffu) << 13);
    }
    return std::bit_cast<float>(sign | (exp + 112) << 23 | mant << 13);
  }
};

// bfloat16: the upper half of an IEEE binary32. Same layout as CUDA's __nv_bfloat16.
struct bf16_t {
  uint16_t bits = 0;
  bf16_t() = default;
  explicit bf16_t(float f) : bits(from_float(f)) {}
  explicit operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

  static uint16_t from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);                 // nearest even
  }
};

// FP8 E4M3 (OCP "fn" variant), stored as bits: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities, S.1111.111 is NaN, the largest finite is 448, the smallest subnormal 2^-9. from_float
// rounds to nearest even and saturates to ±448 as CUDA's __NV_SATFINITE conversion does (NaN stays NaN),
// so that host and device quantise alike.
struct f8e4m3_t {
  uint8_t bits = 0;
  f8e4m3_t() = default;
  explicit f8e4m3_t(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static uint8_t from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const auto sign = static_cast<uint8_t>((x >> 24) & 0x80u);
    const uint32_t abs = x & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
    if (abs >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448 (and inf): saturate
    if (abs < 0x3c800000u) {                                             // below 2^-6, the smallest normal
      // Subnormals are multiples of 2^-9: round |f| · 2^9 to the nearest even integer (exact in fp32).
      const float scaled = std::bit_cast<float>(abs) * 512.0f;
      auto m = static_cast<uint32_t>(scaled);
      const float rem = scaled - static_cast<float>(m);
      if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
      return static_cast<uint8_t>(sign | m);  // m == 8 is the smallest normal's encoding, as it should be
    }
    uint32_t e = ((abs >> 23) - 127 + 7) << 3 | ((abs >> 20) & 7u);  // exponent and top 3 mantissa bits
    const uint32_t rem = abs & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (e & 1u))) ++e;
    if (e > 0x7eu) e = 0x7eu;  // rounding up past 448 saturates too
    return static_cast<uint8_t>(sign | e);
  }
  static float to_float(uint8_t b) {
    const float sign = (b & 0x80u) ? -1.0f : 1.0f;
    const uint32_t exp = (b >> 3) & 0xfu, mant = b & 7u;
    if (exp == 0xf && mant == 7) return std::bit_cast<float>(0x7fc00000u);
    if (exp == 0) return sign * static_cast<float>(mant) * 0x1p-9f;
    return std::bit_cast<float>((b & 0x80u ? 0x80000000u : 0u) | (exp + 120) << 23 | mant << 20);
  }
};

// FP8 E5M2 (OCP; PyTorch's float8_e5m2, CUDA's __nv_fp8_e5m2), stored as bits: 1 sign, 5 exponent (bias
// 15), 2 mantissa bits, the top byte of an IEEE binary16; infinities and NaNs as in IEEE, the largest finite
// is 57344, the smallest subnormal 2^-16. from_float rounds to nearest even and saturates to ±57344 as
// CUDA's __NV_SATFINITE conversion does (infinities too; NaN stays NaN). No DType: only the FP8 training
// GEMMs' gradients hold it (src/model/fp8.h).
struct f8e5m2_t {
  uint8_t bits = 0;
  f8e5m2_t() = default;
  explicit f8e5m2_t(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static uint8_t from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const auto sign = static_cast<uint8_t>((x >> 24) & 0x80u);
    const uint32_t abs = x & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
    if (abs >= 0x47600000u) {
      // >= 57344 (and inf): saturate. Values in [57344, 61440) round to 57344 anyway, and the tie at
      // 61440 would round to the even encoding past it (infinity): saturation covers both.
      return static_cast<uint8_t>(sign | 0x7bu);
    }
    if (abs < 0x38800000u) {  // below 2^-14, the smallest normal
      // Subnormals are multiples of 2^-16: round |f| · 2^16 to the nearest even integer (exact in fp32).
      const float scaled = std::bit_cast<float>(abs) * 65536.0f;
      auto m = static_cast<uint32_t>(scaled);
      const float rem = scaled - static_cast<float>(m);
      if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
      return static_cast<uint8_t>(sign | m);  // m == 4 is the smallest normal's encoding
    }
    uint32_t e = ((abs >> 23) - 127 + 15) << 2 | ((abs >> 21) & 3u);  // exponent and top 2 mantissa bits
    const uint32_t rem = abs & 0x1fffffu;
    if (rem > 0x100000u || (rem == 0x100000u && (e & 1u))) ++e;
    if (e > 0x7bu) e = 0x7bu;
    return static_cast<uint8_t>(sign | e);
  }
  static float to_float(uint8_t b) {
    const uint32_t sign = (b & 0x80u) ? 0x80000000u : 0u;
    const uint32_t exp = (b >> 2) & 0x1fu, mant = b & 3u;
    if (exp == 0x1f) return std::bit_cast<float>(sign | (mant ? 0x7fc00000u : 0x7f800000u));
    if (exp == 0) return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(static_cast<float>(mant) * 0x1p-16f));
    return std::bit_cast<float>(sign | (exp + 112) << 23 | mant << 21);
  }
};

// Conversion used by every CPU kernel: load any element type as the accumulation type and back.
template <class To, class From>
inline To convert(From x) {
  if constexpr (std::is_same_v<From, fp16_t> || std::is_same_v<From, bf16_t> || std::is_same_v<From, f8e4m3_t>) {
    return static_cast<To>(static_cast<float>(x));
  } else if constexpr (std::is_same_v<To, fp16_t> || std::is_same_v<To, bf16_t> || std::is_same_v<To, f8e4m3_t>) {
    return To(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<fp16_t>() { return DType::f16; }
template <> constexpr DType dtype_of<bf16_t>() { return DType::bf16; }
template <> constexpr DType dtype_of<f8e4m3_t>() { return DType::f8e4m3; }

// Calls fn(T{}) with the C++ type of `t`: the one switch from a runtime dtype to a template.
template <class Fn>
decltype(auto) dispatch_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::f64: return fn(double{});
    case DType::f32: return fn(float{});
    case DType::f16: return fn(fp16_t{});
    case DType::bf16: return fn(bf16_t{});
    case DType::f8e4m3: return fn(f8e4m3_t{});
  }
  return fn(float{});
}

}  // namespace flashlm
