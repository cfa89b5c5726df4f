#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "flashlm/dtype.h"
#include "flashlm/error.h"

using namespace flashlm;

// GCC's _Float16 (soft-float conversions in libgcc) is the oracle for our fp16 bit manipulation.
TEST(DType, Fp16ToFloatMatchesCompilerForEveryBitPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float ours = fp16_t::to_float(h);
    const float theirs = static_cast<float>(std::bit_cast<_Float16>(h));
    if (std::isnan(theirs)) {
      EXPECT_TRUE(std::isnan(ours)) << bits;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(theirs)) << "bits " << bits;
    }
  }
}

TEST(DType, FloatToFp16RoundsLikeCompiler) {
  // Every float whose bits step by 4099 (covers normals, subnormals, ties region, overflow, inf, nan).
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += 4099) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(bits));
    const uint16_t theirs = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    const uint16_t ours = fp16_t::from_float(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_t::to_float(ours)));
    } else {
      ASSERT_EQ(ours, theirs) << "float bits " << bits << " value " << f;
    }
  }
  // Exact ties round to even.
  EXPECT_EQ(fp16_t::from_float(1.0f + 0x1.0p-11f), fp16_t::from_float(1.0f));
  EXPECT_EQ(fp16_t::from_float(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(fp16_t::from_float(65519.0f), 0x7bff);  // largest finite
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16_t::from_float(1.0f), 0x3f80);
  EXPECT_EQ(bf16_t::from_float(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(bf16_t::from_float(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(bf16_t::from_float(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16_t(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(bf16_t(-std::numeric_limits<float>::infinity())),
            -std::numeric_limits<float>::infinity());
  EXPECT_EQ(static_cast<float>(bf16_t(3.0f)), 3.0f);
}

TEST(DType, NamesRoundTripAndBadNamesThrow) {
  for (DType t : {DType::f64, DType::f32, DType::f16, DType::bf16}) EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  try {
    parse_dtype("int8");
    FAIL() << "expected flashlm::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dtype 'int8'"), std::string::npos) << e.what();
  }
}
