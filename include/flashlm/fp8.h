// The FP8 formats of FP8 training (--precision fp8, src/model/fp8.h): which encoding an FP8 GEMM operand
// holds, and E5M2 as a plain value type beside flashlm/dtype.h's f8e4m3_t. No tensor of the API has these
// dtypes: the FP8 copies live inside the FP8 linear layers.
#pragma once
#include <bit>
#include <cstdint>
#include <string_view>

#include "flashlm/dtype.h"

namespace flashlm {

// FP8 E5M2 (OCP; PyTorch's float8_e5m2, CUDA's __nv_fp8_e5m2), stored as bits: 1 sign, 5 exponent (bias
// 15), 2 mantissa bits, the top byte of an IEEE binary16; infinities and NaNs as in IEEE, the largest finite
// is 57344, the smallest subnormal 2^-16. from_float rounds to nearest even and saturates to ±57344 as
// CUDA's __NV_SATFINITE conversion does (infinities too; NaN stays NaN). Only the FP8 training GEMMs'
// gradients use it (src/model/fp8.h).
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

// Which FP8 encoding an FP8 GEMM operand holds: e4m3 (more precision, range ±448) or e5m2 (more range,
// ±57344): the FP8 training GEMMs' weights and activations are e4m3, their output gradients either.
enum class Fp8Format : uint8_t { e4m3, e5m2 };
std::string_view fp8_format_name(Fp8Format f);   // "e4m3", "e5m2"
Fp8Format parse_fp8_format(std::string_view name);  // as fp8_format_name writes them

}  // namespace flashlm
