// The FP8 formats of FP8 training (--precision fp8, src/model/fp8.h): which encoding an FP8 GEMM operand
// holds. The bit types are flashlm/dtype.h's f8e4m3_t and f8e5m2_t. No tensor of the API holds FP8 training's
// copies: they live inside the FP8 linear layers.
#pragma once
#include <cstdint>
#include <string_view>

#include "flashlm/dtype.h"

namespace flashlm {

// Which FP8 encoding an FP8 GEMM operand holds: e4m3 (more precision, range ±448) or e5m2 (more range,
// ±57344): the FP8 training GEMMs' weights and activations are e4m3, their output gradients either.
enum class Fp8Format : uint8_t { e4m3, e5m2 };
std::string_view fp8_format_name(Fp8Format f);   // "e4m3", "e5m2"
Fp8Format parse_fp8_format(std::string_view name);  // as fp8_format_name writes them

// How FP8 training scales its GEMM operands (ModelOptions::fp8_recipe; the arithmetic in src/model/fp8.h):
// tensorwise, one scale per tensor (torchao's "tensorwise"); rowwise, one scale per row of an operand along
// the dimension its product does not sum over (torchao's "rowwise"), so one outlier token or channel no
// longer coarsens the whole tensor's quantisation, at the price of two differently scaled copies per tensor.
enum class Fp8Recipe : uint8_t { tensorwise, rowwise };
std::string_view fp8_recipe_name(Fp8Recipe r);      // "tensorwise", "rowwise"
Fp8Recipe parse_fp8_recipe(std::string_view name);  // as fp8_recipe_name writes them; an Error naming the option

}  // namespace flashlm
