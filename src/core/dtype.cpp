#include "flashlm/dtype.h"

#include "core/check.h"

namespace flashlm {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: return 8;
    case DType::f32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f8e4m3: return 1;
  }
  fail("dtype_size: unknown dtype {}", static_cast<int>(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f64: return "fp64";
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::f8e4m3: return "fp8_e4m3";
  }
  return "unknown";
}

DType parse_dtype(std::string_view name) {
  if (name == "fp64" || name == "float64" || name == "f64") return DType::f64;
  if (name == "fp32" || name == "float32" || name == "f32") return DType::f32;
  if (name == "fp16" || name == "float16" || name == "f16" || name == "half") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "fp8_e4m3" || name == "fp8" || name == "float8_e4m3fn" || name == "e4m3") return DType::f8e4m3;
  fail_argument("unknown dtype '{}': expected one of fp64, fp32, fp16, bf16, fp8_e4m3", name);
}

}  // namespace flashlm
