// FP8 training's arithmetic on the CPU (model/fp8.h, flashlm/dtype.h's f8e4m3_t / f8e5m2_t): the e4m3 and
// e5m2 rounding against known values and against an exhaustive nearest-value search, the tensorwise scale
// rule, the quantisation, and the emulated FP8 linear layer against exact fp64 products; the precision's
// parsing and its refusal on the CPU. The GPU kernels are tested against these in test_fp8_cuda.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "flashlm/model.h"
#include "model/activations.h"
#include "model/fp8.h"
#include "optim/optimizer.h"

using namespace flashlm;

namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::e4m3, Fp8Format::e5m2};

bool is_nan_code(uint8_t b, Fp8Format f) { return std::isnan(fp8_decode(b, f)); }

// The finite codes of a format, non-negative ones only (the sign bit is symmetric).
std::vector<uint8_t> finite_codes(Fp8Format f) {
  std::vector<uint8_t> out;
  for (int b = 0; b < 128; ++b) {
    if (std::isfinite(fp8_decode(uint8_t(b), f))) out.push_back(uint8_t(b));
  }
  return out;
}

// The nearest code to |v| by exhaustive search, ties to the even code, beyond the largest finite value the
// largest finite value (saturation); the sign copied.
uint8_t nearest_by_search(float v, Fp8Format f) {
  const double a = std::fabs(double(v));
  uint8_t best = 0;
  double best_err = INFINITY;
  for (uint8_t b : finite_codes(f)) {
    const double err = std::fabs(double(fp8_decode(b, f)) - a);
    if (err < best_err || (err == best_err && (b & 1u) == 0)) best = b, best_err = err;
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 0x80u : 0u));
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

TEST(Fp8, E4m3KnownValues) {
  const auto e = [](float v) { return fp8_encode(v, Fp8Format::e4m3); };
  EXPECT_EQ(fp8_max_value(Fp8Format::e4m3), 448.0f);
  EXPECT_EQ(e(448.0f), 0x7e);
  EXPECT_EQ(fp8_decode(0x7e, Fp8Format::e4m3), 448.0f);
  EXPECT_EQ(e(-448.0f), 0xfe);
  EXPECT_EQ(e(464.0f), 0x7e);  // the tie above 448 would round to the NaN encoding: saturates
  EXPECT_EQ(e(1e6f), 0x7e);
  EXPECT_EQ(e(INFINITY), 0x7e);
  EXPECT_EQ(e(-INFINITY), 0xfe);
  EXPECT_TRUE(is_nan_code(e(NAN), Fp8Format::e4m3));
  // The grid in [1, 2) has spacing 1/8; ties to even: 1 + 1/16 -> 1, 1 + 3/16 -> 1.25.
  EXPECT_EQ(fp8_decode(e(1.0625f), Fp8Format::e4m3), 1.0f);
  EXPECT_EQ(fp8_decode(e(1.1875f), Fp8Format::e4m3), 1.25f);
  EXPECT_EQ(fp8_decode(e(1.07f), Fp8Format::e4m3), 1.125f);
  EXPECT_EQ(fp8_decode(e(240.0f), Fp8Format::e4m3), 240.0f);  // spacing 16 in [128, 256)
  EXPECT_EQ(fp8_decode(e(248.0f), Fp8Format::e4m3), 256.0f);  // tie between 240 (odd) and 256 (even)
  // Subnormals: multiples of 2^-9 below 2^-6.
  EXPECT_EQ(e(0x1p-9f), 0x01);
  EXPECT_EQ(e(0x1p-10f), 0x00);       // tie between 0 and 2^-9: to even (0)
  EXPECT_EQ(e(3 * 0x1p-10f), 0x02);   // tie between 2^-9 (odd) and 2^-8 (even)
  EXPECT_EQ(e(0x1p-6f), 0x08);        // the smallest normal
  EXPECT_EQ(e(7.5f * 0x1p-9f), 0x08);  // rounds up from the largest subnormal into it
  EXPECT_EQ(e(-0.0f), 0x80);
}

TEST(Fp8, E5m2KnownValues) {
  const auto e = [](float v) { return fp8_encode(v, Fp8Format::e5m2); };
  EXPECT_EQ(fp8_max_value(Fp8Format::e5m2), 57344.0f);
  EXPECT_EQ(e(57344.0f), 0x7b);
  EXPECT_EQ(fp8_decode(0x7b, Fp8Format::e5m2), 57344.0f);
  EXPECT_EQ(e(61440.0f), 0x7b);  // the tie above the largest finite value: saturates, not inf
  EXPECT_EQ(e(1e9f), 0x7b);
  EXPECT_EQ(e(INFINITY), 0x7b);
  EXPECT_EQ(e(-INFINITY), 0xfb);
  EXPECT_TRUE(is_nan_code(e(NAN), Fp8Format::e5m2));
  EXPECT_EQ(fp8_decode(0x7c, Fp8Format::e5m2), INFINITY);
  // Spacing 1/4 in [1, 2): 1 + 1/8 -> 1 (even), 1 + 3/8 -> 1.5 (even).
  EXPECT_EQ(fp8_decode(e(1.125f), Fp8Format::e5m2), 1.0f);
  EXPECT_EQ(fp8_decode(e(1.375f), Fp8Format::e5m2), 1.5f);
  EXPECT_EQ(fp8_decode(e(1.2f), Fp8Format::e5m2), 1.25f);
  // Subnormals: multiples of 2^-16 below 2^-14.
  EXPECT_EQ(e(0x1p-16f), 0x01);
  EXPECT_EQ(e(0x1p-17f), 0x00);
  EXPECT_EQ(e(3 * 0x1p-17f), 0x02);
  EXPECT_EQ(e(0x1p-14f), 0x04);
  // e5m2 is the top byte of binary16 where binary16 rounds exactly onto it.
  for (float v : {1.0f, 1.5f, 0.25f, 3.0f, 24576.0f, 0x1p-15f}) EXPECT_EQ(e(v), fp16_t(v).bits >> 8) << v;
}

TEST(Fp8, EveryFiniteCodeRoundTrips) {
  for (Fp8Format f : kFormats) {
    for (int b = 0; b < 256; ++b) {
      const float v = fp8_decode(uint8_t(b), f);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(fp8_encode(v, f), b) << fp8_format_name(f) << " code " << b;
    }
  }
}

// Random values over the whole range (subnormals, ties and saturation included) against the exhaustive
// nearest-value search.
TEST(Fp8, RoundingIsNearestEvenWithSaturation) {
  std::mt19937 rng(7);
  for (Fp8Format f : kFormats) {
    std::uniform_real_distribution<float> exponent(f == Fp8Format::e4m3 ? -12.0f : -19.0f,
                                                   f == Fp8Format::e4m3 ? 10.0f : 17.0f);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    for (int i = 0; i < 20000; ++i) {
      float v = unit(rng) * std::exp2(exponent(rng));
      if (i % 4 == 0) {  // an exact midpoint between two neighbouring codes
        const std::vector<uint8_t> codes = finite_codes(f);
        const size_t at = size_t(rng() % (codes.size() - 1));
        v = float((double(fp8_decode(codes[at], f)) + double(fp8_decode(codes[at + 1], f))) / 2);
        if (i % 8 == 0) v = -v;
      }
      ASSERT_EQ(fp8_encode(v, f), nearest_by_search(v, f)) << fp8_format_name(f) << " v = " << v;
    }
  }
}

TEST(Fp8, ScaleRule) {
  EXPECT_EQ(fp8_scale(2.0f, Fp8Format::e4m3), 224.0f);
  EXPECT_EQ(fp8_scale(2.0f, Fp8Format::e5m2), 28672.0f);
  EXPECT_EQ(fp8_scale(0.0f, Fp8Format::e4m3), 448.0f / kFp8AmaxFloor);  // finite for an all-zero tensor
  EXPECT_TRUE(std::isfinite(fp8_scale(0.0f, Fp8Format::e5m2)));
  EXPECT_TRUE(std::isnan(fp8_scale(NAN, Fp8Format::e4m3)));
  EXPECT_EQ(fp8_scale(INFINITY, Fp8Format::e4m3), 0.0f);
  EXPECT_EQ(fp8_dequant_scale(224.0f), 1.0f / 224.0f);
}

TEST(Fp8, QuantisationUsesTheWholeRangeAndKeepsNaN) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> x(999);
  for (float& v : x) v = normal(rng);
  x[517] = -0.5f;  // the amax, negative
  for (Fp8Format f : kFormats) {
    std::vector<uint8_t> q(x.size());
    const float dequant = fp8_quantize_cpu(x.data(), int64_t(x.size()), f, q.data());
    EXPECT_EQ(fp8_amax_cpu(x.data(), int64_t(x.size())), 0.5f);
    EXPECT_EQ(fp8_decode(q[517], f), -fp8_max_value(f)) << fp8_format_name(f);
    EXPECT_EQ(dequant, 1.0f / fp8_scale(0.5f, f));
    const double half_ulp = f == Fp8Format::e4m3 ? 0x1p-4 : 0x1p-3;
    for (size_t i = 0; i < x.size(); ++i) {
      const double back = double(fp8_decode(q[i], f)) * dequant;
      // Relative half an ulp for normals, absolute half the smallest subnormal below them.
      const double tiny = (f == Fp8Format::e4m3 ? 0x1p-10 : 0x1p-17) * dequant;
      EXPECT_LE(std::fabs(back - x[i]), half_ulp * std::fabs(x[i]) * 1.0001 + tiny) << i;
    }
  }
  std::vector<float> zeros(64, 0.0f);
  std::vector<uint8_t> q(64, 0xab);
  fp8_quantize_cpu(zeros.data(), 64, Fp8Format::e4m3, q.data());
  for (uint8_t b : q) EXPECT_EQ(b, 0);
  x[3] = NAN;
  std::vector<uint8_t> qn(x.size());
  EXPECT_TRUE(std::isnan(fp8_quantize_cpu(x.data(), int64_t(x.size()), Fp8Format::e4m3, qn.data())));
  for (uint8_t b : qn) EXPECT_TRUE(is_nan_code(b, Fp8Format::e4m3));  // a NaN poisons the tensor's product
}

// The emulated FP8 linear layer against the exact products of the unquantised inputs: the error is the
// quantisation's (half an ulp of each operand: 2^-4 for e4m3, 2^-3 for e5m2, relative), bounded per element
// by (u_a + u_b + u_a·u_b)·Σ|a||b|; a wrong transpose or scale gives errors of the size of the result.
TEST(Fp8, EmulatedLinearLayerIsTheQuantisedProduct) {
  const int64_t n = 48, in = 40, out = 24;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(n * in)), w(size_t(out * in)), dy(size_t(n * out));
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = 0.05f * normal(rng);
  for (float& v : dy) v = 1e-3f * normal(rng);
  const auto bound = [](double ua, double ub, double s) { return (ua + ub + ua * ub) * s * 1.001 + 1e-12; };
  constexpr double u4 = 0x1p-4, u5 = 0x1p-3;

  std::vector<double> y(size_t(n * out));
  fp8_linear_forward_cpu(x.data(), w.data(), y.data(), n, in, out);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < out; ++j) {
      double ref = 0, s = 0;
      for (int64_t k = 0; k < in; ++k) {
        ref += double(x[i * in + k]) * w[j * in + k];
        s += std::fabs(double(x[i * in + k]) * w[j * in + k]);
      }
      const double err = std::fabs(y[i * out + j] - ref);
      EXPECT_LE(err, bound(u4, u4, s)) << i << ", " << j;
      worst = std::max(worst, err / s);
    }
  }
  EXPECT_GT(worst, 1e-4) << "no quantisation error at all: the inputs were not quantised";

  for (Fp8Format g : kFormats) {
    const double ug = g == Fp8Format::e4m3 ? u4 : u5;
    std::vector<double> dx(size_t(n * in)), dw(size_t(out * in));
    fp8_linear_backward_cpu(dy.data(), x.data(), w.data(), dx.data(), dw.data(), n, in, out, g);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < in; ++k) {
        double ref = 0, s = 0;
        for (int64_t j = 0; j < out; ++j) {
          ref += double(dy[i * out + j]) * w[j * in + k];
          s += std::fabs(double(dy[i * out + j]) * w[j * in + k]);
        }
        EXPECT_LE(std::fabs(dx[i * in + k] - ref), bound(ug, u4, s)) << fp8_format_name(g) << " dx " << i << ", " << k;
      }
    }
    for (int64_t j = 0; j < out; ++j) {
      for (int64_t k = 0; k < in; ++k) {
        double ref = 0, s = 0;
        for (int64_t i = 0; i < n; ++i) {
          ref += double(dy[i * out + j]) * x[i * in + k];
          s += std::fabs(double(dy[i * out + j]) * x[i * in + k]);
        }
        EXPECT_LE(std::fabs(dw[j * in + k] - ref), bound(ug, u4, s)) << fp8_format_name(g) << " dw " << j << ", " << k;
      }
    }
    // Only one of dx, dw: the other is not computed, the computed one the same.
    std::vector<double> dx_only(size_t(n * in));
    fp8_linear_backward_cpu(dy.data(), x.data(), w.data(), dx_only.data(), nullptr, n, in, out, g);
    EXPECT_EQ(dx_only, dx);
  }
}

TEST(Fp8, PrecisionParsesAndTheCpuEmulatesIt) {
  DType dtype = DType::f32;
  bool pure = true, fp8 = false;
  parse_precision("fp8", dtype, pure, fp8);
  EXPECT_EQ(dtype, DType::bf16);
  EXPECT_FALSE(pure);
  EXPECT_TRUE(fp8);
  parse_precision("bf16", dtype, pure, fp8);
  EXPECT_FALSE(fp8);
  expect_error([&] { parse_precision("fp8", dtype, pure); }, "this command takes");  // commands without FP8
  expect_error([&] { parse_precision("fp64", dtype, pure, fp8); }, "bf16-pure, fp8 or bf16-pure-fp8");
  EXPECT_EQ(precision_name(DType::bf16, false, true), "fp8");
  parse_precision("bf16-pure-fp8", dtype, pure, fp8);
  EXPECT_EQ(dtype, DType::bf16);
  EXPECT_TRUE(pure);
  EXPECT_TRUE(fp8);
  EXPECT_EQ(precision_name(DType::bf16, true, true), "bf16-pure-fp8");
  expect_error([&] { parse_precision("bf16-pure-fp8", dtype, pure); }, "'bf16-pure-fp8': this command takes");
  EXPECT_EQ(parse_fp8_format("e4m3"), Fp8Format::e4m3);
  EXPECT_EQ(parse_fp8_format("e5m2"), Fp8Format::e5m2);
  expect_error([] { parse_fp8_format("e3m4"); }, "expected e4m3 or e5m2");

  ModelConfig c = ModelConfig::named("tiny", 64, 128);
  ModelOptions o;
  o.fp8 = true;
  EXPECT_NO_THROW(make_model(c, 1, 16, Device::cpu, DType::f32, o));  // emulated over fp32
  expect_error([&] { plan_model_memory(c, 1, 16, Device::cpu, DType::bf16, o); }, "emulated over fp32");
  {
    const MemoryPlan emulated = plan_model_memory(c, 2, 64, Device::cpu, DType::f32, o);
    o.fp8 = false;
    const MemoryPlan plain = plan_model_memory(c, 2, 64, Device::cpu, DType::f32, o);
    o.fp8 = true;
    EXPECT_EQ(emulated.total_bytes() - plain.total_bytes(), 4 * fp8_emulation_elements(c, 2 * 64));
  }
  expect_error([&] { plan_model_memory(c, 1, 16, Device::cuda, DType::f32, o); }, "not with fp32");  // bf16's
  o.bf16_pure = true;  // bf16-pure-fp8: planned on CUDA with its FP8 copies; the CPU emulates over fp32 only
  expect_error([&] { plan_model_memory(c, 1, 16, Device::cpu, DType::bf16, o); }, "bf16-pure is a CUDA precision");
  {
    const MemoryPlan pure_fp8 = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
    o.fp8 = false;
    const MemoryPlan pure = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
    o.fp8 = true;
    EXPECT_GT(pure_fp8.total_bytes(), pure.total_bytes());
  }
  o.bf16_pure = false;
  const MemoryPlan with = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
  o.fp8 = false;
  const MemoryPlan without = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
  EXPECT_GT(with.total_bytes(), without.total_bytes());  // the FP8 copies are counted
}

// ---------------------------------------------------------------------------------------------------
// The CPU model's emulated FP8 training (ModelOptions::fp8 on the CPU): the linear layers' operands rounded
// through FP8 before the fp32 GEMMs.

TEST(Fp8, RoundTripIsTheQuantisedValueAndAmaxMaxKeepsNaN) {
  const std::vector<float> x = {0.0f, 1.0f, -3.5f, 100.0f, 1e-6f, -448.0f};
  std::vector<float> out(x.size());
  const float amax = fp8_amax_cpu(x.data(), int64_t(x.size()));
  fp8_round_trip_cpu(x.data(), int64_t(x.size()), amax, Fp8Format::e4m3, out.data());
  std::vector<uint8_t> q(x.size());
  const float dequant = fp8_quantize_cpu(x.data(), int64_t(x.size()), Fp8Format::e4m3, q.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(out[i], fp8_decode(q[i], Fp8Format::e4m3) * dequant) << i;
  EXPECT_EQ(out[5], -448.0f);  // the amax maps to the format's largest value and back exactly
  EXPECT_NE(out[4], x[4]);    // a small value loses bits
  fp8_round_trip_cpu(x.data(), int64_t(x.size()), amax, Fp8Format::e4m3, std::vector<float>(x).data());  // in place ok
  EXPECT_EQ(fp8_amax_max(2.0f, -3.0f), -3.0f);
  EXPECT_TRUE(std::isnan(fp8_amax_max(std::numeric_limits<float>::quiet_NaN(), 5.0f)));
  EXPECT_TRUE(std::isnan(fp8_amax_max(5.0f, std::numeric_limits<float>::quiet_NaN())));
}

namespace {

struct Fp8Run {
  std::vector<double> losses;
  std::vector<float> first_gradients;
};

// The tiny model trained `steps` steps on a learnable successor rule, in fp32 or emulated fp8.
Fp8Run train_tiny(bool fp8, Fp8Format gradients, const char* recompute, int steps,
                  Fp8Recipe recipe = Fp8Recipe::tensorwise) {
  const ModelConfig c = ModelConfig::named("tiny", 32, 64);
  ModelOptions o;
  o.fp8 = fp8;
  o.fp8_gradients = gradients;
  o.fp8_recipe = recipe;
  o.recompute = RecomputePlan::parse(recompute);
  CpuModel model(c, 4, 32, o);
  model.init_parameters(1);
  std::vector<int32_t> tokens(4 * 32), targets(4 * 32);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 7) % 64);
    targets[i] = int32_t((i * 7 + 7) % 64);
  }
  AdamWConfig opt;
  Fp8Run run;
  for (int step = 0; step < steps; ++step) {
    model.zero_grad();
    run.losses.push_back(model.forward(tokens.data(), targets.data()));
    model.backward();
    if (step == 0) run.first_gradients.assign(model.gradients(), model.gradients() + model.parameter_count());
    model.clip_gradients(1.0);
    model.adamw_step(opt, 3e-3);
  }
  return run;
}

// The first step's gradients of an FP8 run stay near fp32's: within 10% of the largest, every parameter, and
// not equal (the rounding ran).
void expect_first_gradients_near(const Fp8Run& run, const Fp8Run& fp32) {
  double worst = 0, largest = 0;
  for (size_t i = 0; i < fp32.first_gradients.size(); ++i) {
    worst = std::max(worst, double(std::fabs(run.first_gradients[i] - fp32.first_gradients[i])));
    largest = std::max(largest, double(std::fabs(fp32.first_gradients[i])));
  }
  EXPECT_GT(worst, 0.0);
  EXPECT_LT(worst, 0.1 * largest);
}

}  // namespace

// Emulated FP8 follows fp32 closely, is not fp32 (the operands are rounded), learns as fp32 does, and is
// deterministic; e4m3 and e5m2 output gradients give different gradients.
TEST(CpuModelFp8, EmulatedTrainingTracksFp32AndIsReproducible) {
  const Fp8Run fp32 = train_tiny(false, Fp8Format::e5m2, "none", 30);
  const Fp8Run e5m2 = train_tiny(true, Fp8Format::e5m2, "none", 30);
  const Fp8Run again = train_tiny(true, Fp8Format::e5m2, "none", 2);
  const Fp8Run e4m3 = train_tiny(true, Fp8Format::e4m3, "none", 1);
  EXPECT_NE(e5m2.losses[0], fp32.losses[0]);
  EXPECT_NEAR(e5m2.losses[0], fp32.losses[0], 0.02 * fp32.losses[0]);
  EXPECT_LT(e5m2.losses.back(), 0.5 * e5m2.losses[0]);  // it learns
  EXPECT_NEAR(e5m2.losses.back(), fp32.losses.back(), 0.15 * fp32.losses.back());
  EXPECT_EQ(std::vector<double>(e5m2.losses.begin(), e5m2.losses.begin() + 2), again.losses);
  EXPECT_EQ(e5m2.first_gradients, again.first_gradients);
  EXPECT_NE(e5m2.first_gradients, e4m3.first_gradients);
  EXPECT_EQ(e5m2.losses[0], e4m3.losses[0]);  // the forward has no gradients to round
  expect_first_gradients_near(e5m2, fp32);
}

// Recomputation rounds the recomputed blocks' operands as the forward did: the same bits.
TEST(CpuModelFp8, RecomputationGivesTheSameBits) {
  const Fp8Run none = train_tiny(true, Fp8Format::e5m2, "none", 3);
  for (const char* recompute : {"blocks:1", "selective"}) {
    const Fp8Run other = train_tiny(true, Fp8Format::e5m2, recompute, 3);
    EXPECT_EQ(other.losses, none.losses) << recompute;
    EXPECT_EQ(other.first_gradients, none.first_gradients) << recompute;
  }
}

// ---------------------------------------------------------------------------------------------------
// The rowwise recipe (Fp8Recipe::rowwise): every row (and, transposed, every column) quantised as a tensor of
// its own.

namespace {

std::vector<float> column(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t c) {
  std::vector<float> out(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) out[size_t(r)] = x[size_t(r * cols + c)];
  return out;
}

// One row per case: ordinary values, a large and a tiny row, a NaN, an infinity, zeros, one value alone.
std::vector<float> awkward_rows(int64_t cols) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float row_scale[] = {1.0f, 3e4f, 1e-5f, 1.0f, 1.0f, 0.0f, 0.0f};
  std::vector<float> x;
  for (float m : row_scale) {
    for (int64_t c = 0; c < cols; ++c) x.push_back(m * normal(rng));
  }
  x[size_t(3 * cols + 2)] = kNaN;
  x[size_t(4 * cols + 1)] = -kInf;
  x[size_t(6 * cols + cols - 1)] = -0.25f;
  return x;
}

}  // namespace

// The per-row and per-column amaxes, bytes, dequantisation scales and round trips are those of each row
// (column) quantised alone by the tensorwise functions: NaN rows NaN, an infinity NaN where it was and zero
// elsewhere in its row, a zero row zero with a finite scale.
TEST(Fp8Rowwise, RowsAndColumnsAreQuantisedEachAlone) {
  const int64_t cols = 9;
  const std::vector<float> x = awkward_rows(cols);
  const int64_t rows = int64_t(x.size()) / cols;
  for (Fp8Format f : kFormats) {
    std::vector<float> row_amax(static_cast<size_t>(rows)), col_amax(static_cast<size_t>(cols)), row_dequant(static_cast<size_t>(rows)),
        col_dequant(static_cast<size_t>(cols)), rows_rt(x.size()), cols_rt(x.size());
    std::vector<uint8_t> q(x.size()), qt(x.size());
    fp8_amax_rows_cols_cpu(x.data(), rows, cols, row_amax.data(), col_amax.data());
    fp8_cast_rowwise_cpu(x.data(), rows, cols, row_amax.data(), col_amax.data(), f, q.data(), qt.data(),
                         row_dequant.data(), col_dequant.data());
    fp8_round_trip_rows_cpu(x.data(), rows, cols, row_amax.data(), f, rows_rt.data());
    fp8_round_trip_cols_cpu(x.data(), rows, cols, col_amax.data(), f, cols_rt.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x.data() + r * cols;
      EXPECT_EQ(std::bit_cast<uint32_t>(row_amax[size_t(r)]), std::bit_cast<uint32_t>(fp8_amax_cpu(xr, cols))) << r;
      std::vector<uint8_t> alone(static_cast<size_t>(cols));
      const float dequant = fp8_quantize_cpu(xr, cols, f, alone.data());
      EXPECT_EQ(std::bit_cast<uint32_t>(row_dequant[size_t(r)]), std::bit_cast<uint32_t>(dequant)) << r;
      EXPECT_EQ(std::vector<uint8_t>(q.begin() + r * cols, q.begin() + (r + 1) * cols), alone) << r;
      std::vector<float> rt(static_cast<size_t>(cols));
      fp8_round_trip_cpu(xr, cols, fp8_amax_cpu(xr, cols), f, rt.data());
      for (int64_t c = 0; c < cols; ++c) {
        EXPECT_EQ(std::bit_cast<uint32_t>(rows_rt[size_t(r * cols + c)]), std::bit_cast<uint32_t>(rt[size_t(c)]));
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      const std::vector<float> xc = column(x, rows, cols, c);
      EXPECT_EQ(std::bit_cast<uint32_t>(col_amax[size_t(c)]), std::bit_cast<uint32_t>(fp8_amax_cpu(xc.data(), rows)))
          << c;
      std::vector<uint8_t> alone(static_cast<size_t>(rows));
      const float dequant = fp8_quantize_cpu(xc.data(), rows, f, alone.data());
      EXPECT_EQ(std::bit_cast<uint32_t>(col_dequant[size_t(c)]), std::bit_cast<uint32_t>(dequant)) << c;
      EXPECT_EQ(std::vector<uint8_t>(qt.begin() + c * rows, qt.begin() + (c + 1) * rows), alone) << c;
      std::vector<float> rt(static_cast<size_t>(rows));
      fp8_round_trip_cpu(xc.data(), rows, fp8_amax_cpu(xc.data(), rows), f, rt.data());
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_EQ(std::bit_cast<uint32_t>(cols_rt[size_t(r * cols + c)]), std::bit_cast<uint32_t>(rt[size_t(r)]));
      }
    }
    // The special rows, spelled out.
    EXPECT_TRUE(std::isnan(row_amax[3]));
    for (int64_t c = 0; c < cols; ++c) EXPECT_TRUE(is_nan_code(q[size_t(3 * cols + c)], f)) << "NaN row " << c;
    EXPECT_TRUE(std::isinf(row_amax[4]));
    EXPECT_EQ(row_dequant[4], std::numeric_limits<float>::infinity());  // scale 0
    EXPECT_TRUE(is_nan_code(q[size_t(4 * cols + 1)], f));  // inf · 0
    EXPECT_EQ(fp8_decode(q[size_t(4 * cols)], f), 0.0f);
    EXPECT_EQ(row_amax[5], 0.0f);
    EXPECT_TRUE(std::isfinite(row_dequant[5]));
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(fp8_decode(q[size_t(5 * cols + c)], f), 0.0f) << "zero row " << c;
    EXPECT_EQ(rows_rt[size_t(6 * cols + cols - 1)], -0.25f);  // a row's amax maps to fp8_max and back exactly
    // The large and the tiny row keep their precision (tensorwise would flush the tiny one to zero).
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_NEAR(rows_rt[size_t(2 * cols + c)], x[size_t(2 * cols + c)], 0.13 * std::fabs(x[size_t(2 * cols + c)]) + 1e-9);
    }
  }
}

// The emulated rowwise layer is the product of the per-row quantised operands, each product's operands
// scaled along the dimension it does not sum over, and it is close to the exact product (the tensorwise
// test's bound).
TEST(Fp8Rowwise, EmulatedLinearLayerIsTheRowScaledProduct) {
  const int64_t n = 32, in = 24, out = 16;
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(n * in)), w(size_t(out * in)), dy(size_t(n * out));
  for (float& v : x) v = normal(rng);
  for (int64_t i = 0; i < n; ++i) x[size_t(i * in)] *= 1e3f;  // a per-token outlier channel
  for (float& v : w) v = 0.05f * normal(rng);
  for (float& v : dy) v = 1e-3f * normal(rng);
  // Each row of a [rows, cols] matrix quantised alone (the tensorwise function), decoded times its scale.
  const auto per_row = [](const std::vector<float>& a, int64_t rows, int64_t cols, Fp8Format f) {
    std::vector<double> out(a.size());
    std::vector<uint8_t> q(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      const float dequant = fp8_quantize_cpu(a.data() + r * cols, cols, f, q.data());
      for (int64_t c = 0; c < cols; ++c) out[size_t(r * cols + c)] = double(fp8_decode(q[size_t(c)], f)) * dequant;
    }
    return out;
  };
  const auto transpose = [](const std::vector<float>& a, int64_t rows, int64_t cols) {
    std::vector<float> t(a.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
    }
    return t;
  };
  // p [rows, k] · q [cols, k]ᵀ of dequantised values.
  const auto product = [](const std::vector<double>& p, const std::vector<double>& q, int64_t rows, int64_t cols,
                          int64_t k) {
    std::vector<double> d(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < k; ++i) acc += p[size_t(r * k + i)] * q[size_t(c * k + i)];
        d[size_t(r * cols + c)] = acc;
      }
    }
    return d;
  };
  const auto expect_close = [](const std::vector<double>& got, const std::vector<double>& want, const char* what) {
    double largest = 0;
    for (double v : want) largest = std::max(largest, std::fabs(v));
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12 * largest) << what << " " << i;
  };

  std::vector<double> y(size_t(n * out));
  fp8_linear_forward_cpu(x.data(), w.data(), y.data(), n, in, out, Fp8Recipe::rowwise);
  expect_close(y, product(per_row(x, n, in, Fp8Format::e4m3), per_row(w, out, in, Fp8Format::e4m3), n, out, in), "y");
  std::vector<double> y_tensorwise(size_t(n * out));
  fp8_linear_forward_cpu(x.data(), w.data(), y_tensorwise.data(), n, in, out);
  double rowwise_error = 0, tensorwise_error = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < out; ++j) {
      double ref = 0;
      for (int64_t k = 0; k < in; ++k) ref += double(x[size_t(i * in + k)]) * w[size_t(j * in + k)];
      rowwise_error += std::fabs(y[size_t(i * out + j)] - ref);
      tensorwise_error += std::fabs(y_tensorwise[size_t(i * out + j)] - ref);
    }
  }
  EXPECT_LE(rowwise_error, tensorwise_error);  // no coarser than one scale for the whole tensor

  for (Fp8Format g : kFormats) {
    std::vector<double> dx(size_t(n * in)), dw(size_t(out * in));
    fp8_linear_backward_cpu(dy.data(), x.data(), w.data(), dx.data(), dw.data(), n, in, out, g, Fp8Recipe::rowwise);
    // dx: dy per token, w per input column (the rows of wᵀ).
    expect_close(dx, product(per_row(dy, n, out, g), per_row(transpose(w, out, in), in, out, Fp8Format::e4m3), n, in, out),
                 "dx");
    // dw: dy per output channel, x per input column.
    expect_close(dw,
                 product(per_row(transpose(dy, n, out), out, n, g), per_row(transpose(x, n, in), in, n, Fp8Format::e4m3),
                         out, in, n),
                 "dw");
    std::vector<double> dw_only(size_t(out * in));
    fp8_linear_backward_cpu(dy.data(), x.data(), w.data(), nullptr, dw_only.data(), n, in, out, g, Fp8Recipe::rowwise);
    EXPECT_EQ(dw_only, dw);
  }
}

TEST(Fp8Rowwise, RecipeParsesAndIsPlanned) {
  EXPECT_EQ(parse_fp8_recipe("tensorwise"), Fp8Recipe::tensorwise);
  EXPECT_EQ(parse_fp8_recipe("rowwise"), Fp8Recipe::rowwise);
  EXPECT_EQ(fp8_recipe_name(Fp8Recipe::rowwise), "rowwise");
  EXPECT_EQ(fp8_recipe_name(Fp8Recipe::tensorwise), "tensorwise");
  expect_error([] { parse_fp8_recipe("columnwise"); }, "--fp8-recipe");
  expect_error([] { parse_fp8_recipe("Rowwise"); }, "expected tensorwise or rowwise");
  EXPECT_EQ(ModelOptions{}.fp8_recipe, Fp8Recipe::tensorwise);

  const ModelConfig c = ModelConfig::named("tiny", 64, 128);
  ModelOptions o;
  o.fp8 = true;
  const MemoryPlan cpu_tensorwise = plan_model_memory(c, 2, 64, Device::cpu, DType::f32, o);
  const MemoryPlan cuda_tensorwise = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
  o.fp8_recipe = Fp8Recipe::rowwise;
  const MemoryPlan cpu_rowwise = plan_model_memory(c, 2, 64, Device::cpu, DType::f32, o);
  const MemoryPlan cuda_rowwise = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
  EXPECT_EQ(cpu_rowwise.total_bytes() - cpu_tensorwise.total_bytes(),
            4 * (fp8_emulation_elements(c, 128, Fp8Recipe::rowwise) - fp8_emulation_elements(c, 128)));
  const Fp8ScratchLayout tw = fp8_scratch_layout(c, 128), rw = fp8_scratch_layout(c, 128, Fp8Recipe::rowwise);
  // Tensorwise with nothing recomputed (the default) also keeps its inputs' transposed copies; rowwise does not.
  const Fp8ScratchLayout tw_kept = fp8_scratch_layout(c, 128, Fp8Recipe::tensorwise, /*keep_inputs*/ true);
  EXPECT_EQ(cuda_rowwise.total_bytes() - cuda_tensorwise.total_bytes(),
            (rw.bytes - tw.bytes) + (rw.cache_bytes - tw_kept.cache_bytes));
  // The scale vectors: three operand sets in the scratch, one per weight in the cache, each vector 16-byte
  // aligned and long enough for the operand's rows and columns.
  EXPECT_EQ(rw.bytes - tw.bytes, 3 * rw.vector_set.bytes());
  EXPECT_EQ(rw.cache_bytes - tw.cache_bytes, rw.cache_slots * rw.cache_vector_set.bytes());
  EXPECT_GE(rw.vector_set.capacity, std::max<int64_t>(128, std::max(3 * c.d_model, c.d_ff)));
  EXPECT_EQ(rw.vector_set.vector_bytes() % int64_t(kFp8ScaleAlignment), 0);
  EXPECT_EQ(rw.vectors % int64_t(kFp8ScaleAlignment), 0);
  EXPECT_EQ(rw.cache_vectors % int64_t(kFp8ScaleAlignment), 0);
  // Tensorwise's layout is what it was: no vectors.
  EXPECT_EQ(tw.vectors, tw.bytes);
  EXPECT_EQ(tw.cache_vectors, tw.cache_bytes);
}

// Tensorwise FP8 with nothing recomputed keeps the transposed FP8 copies of every block's four linear inputs
// for the backward (a byte per element of h1, the attention output, h2 and s), after everything else in the
// weight cache; the memory plan counts them, and recomputation or rowwise scaling keeps none.
TEST(Fp8Layout, KeptInputsArePlannedAfterTheWeightCache) {
  const ModelConfig c = ModelConfig::named("tiny", 64, 128);
  const int64_t tokens = 128;
  const Fp8ScratchLayout plain = fp8_scratch_layout(c, tokens), kept = fp8_scratch_layout(c, tokens, Fp8Recipe::tensorwise, true);
  EXPECT_EQ(plain.cache_inputs, plain.cache_bytes);
  EXPECT_EQ(kept.cache_inputs, plain.cache_bytes);
  EXPECT_EQ(kept.bytes, plain.bytes);
  const int64_t per_block = fp8_kept_input_bytes(c, tokens);
  EXPECT_GE(per_block, tokens * (3 * c.d_model + c.d_ff));
  EXPECT_EQ(kept.cache_bytes - kept.cache_inputs, c.layers * per_block);
  EXPECT_EQ(kept.cache_inputs % 256, 0);
  expect_error([&] { fp8_scratch_layout(c, tokens, Fp8Recipe::rowwise, true); }, "tensorwise only");

  EXPECT_TRUE(fp8_keeps_inputs(Fp8Recipe::tensorwise, RecomputePlan{}));
  EXPECT_FALSE(fp8_keeps_inputs(Fp8Recipe::rowwise, RecomputePlan{}));
  EXPECT_FALSE(fp8_keeps_inputs(Fp8Recipe::tensorwise, RecomputePlan::parse("selective")));
  EXPECT_FALSE(fp8_keeps_inputs(Fp8Recipe::tensorwise, RecomputePlan::parse("blocks:2")));

  ModelOptions o;
  o.fp8 = true;
  const MemoryPlan none = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
  o.recompute = RecomputePlan::parse("blocks");
  const MemoryPlan blocks = plan_model_memory(c, 2, 64, Device::cuda, DType::bf16, o);
  const auto item = [](const MemoryPlan& p, std::string_view what) -> int64_t {
    for (const auto& i : p.items) {
      if (i.what.find(what) != std::string::npos) return i.bytes;
    }
    return -1;
  };
  EXPECT_EQ(item(none, "transposed copies of the blocks' linear inputs"), c.layers * per_block);
  EXPECT_EQ(item(blocks, "transposed copies of the blocks' linear inputs"), -1);
  EXPECT_EQ(item(none, "FP8 copies of the block weights"), plain.cache_bytes);
}

// Emulated rowwise FP8 trains as tensorwise does (the same bounds against fp32), differs from it, is
// deterministic, and recomputation gives the same bits.
TEST(CpuModelFp8, RowwiseTrainingTracksFp32AndIsReproducible) {
  const Fp8Run fp32 = train_tiny(false, Fp8Format::e5m2, "none", 30);
  const Fp8Run rowwise = train_tiny(true, Fp8Format::e5m2, "none", 30, Fp8Recipe::rowwise);
  const Fp8Run again = train_tiny(true, Fp8Format::e5m2, "none", 2, Fp8Recipe::rowwise);
  const Fp8Run tensorwise = train_tiny(true, Fp8Format::e5m2, "none", 1);
  EXPECT_NE(rowwise.losses[0], fp32.losses[0]);
  EXPECT_NE(rowwise.losses[0], tensorwise.losses[0]);
  EXPECT_NEAR(rowwise.losses[0], fp32.losses[0], 0.02 * fp32.losses[0]);
  EXPECT_LT(rowwise.losses.back(), 0.5 * rowwise.losses[0]);  // it learns
  EXPECT_NEAR(rowwise.losses.back(), fp32.losses.back(), 0.15 * fp32.losses.back());
  EXPECT_EQ(std::vector<double>(rowwise.losses.begin(), rowwise.losses.begin() + 2), again.losses);
  EXPECT_EQ(rowwise.first_gradients, again.first_gradients);
  expect_first_gradients_near(rowwise, fp32);
  for (const char* recompute : {"blocks:1", "selective"}) {
    const Fp8Run other = train_tiny(true, Fp8Format::e5m2, recompute, 2, Fp8Recipe::rowwise);
    EXPECT_EQ(other.losses, again.losses) << recompute;
    EXPECT_EQ(other.first_gradients, again.first_gradients) << recompute;
  }
}

// The weights' amax slots are trusted once, and only for exactly the weights their writer covered: any other
// list, a second pass, or a writer in between (stale) sends the pass back to its own reduction.
TEST(Fp8WeightAmaxes, AreTakenOnceForExactlyTheWeightsSet) {
  const int w[3] = {};
  const std::vector<const void*> all = {&w[0], &w[1], &w[2]}, two = {&w[0], &w[1]},
                                 swapped = {&w[1], &w[0], &w[2]};
  Fp8WeightAmaxes a;
  EXPECT_FALSE(a.current());
  EXPECT_FALSE(a.take(all));  // nothing set: a fresh model reduces

  a.set_current(all);
  EXPECT_TRUE(a.current());
  EXPECT_TRUE(a.take(all));
  EXPECT_FALSE(a.current());
  EXPECT_FALSE(a.take(all));  // taken once: the next pass reduces

  a.set_current(all);
  a.stale();  // a checkpoint load, an init, a pointer handed out
  EXPECT_FALSE(a.take(all));

  for (const std::vector<const void*>& other : {two, swapped, std::vector<const void*>{}}) {
    a.set_current(all);
    EXPECT_FALSE(a.take(other));
    EXPECT_FALSE(a.current());  // refused, and stale after it
  }
  a.set_current({});
  EXPECT_FALSE(a.current());
  EXPECT_FALSE(a.take({}));
}

// The CUDA model's AdamW step writes one amax per scale group: fp8_scale_groups' runs, q‖k‖v as one, ascending
// and disjoint (what StoredAmaxes needs).
TEST(Fp8WeightAmaxes, ScaleGroupsAreAscendingAndDisjoint) {
  const ModelConfig c = ModelConfig::named("tiny", 64, 128);
  const std::vector<ParameterInfo> layout = parameter_layout(c);
  const std::vector<Fp8ScaleGroup> groups = fp8_scale_groups(layout);
  ASSERT_EQ(int64_t(groups.size()), 5 * c.layers);
  for (size_t i = 1; i < groups.size(); ++i) {
    EXPECT_LE(groups[i - 1].offset + groups[i - 1].count, groups[i].offset) << i;
  }
  EXPECT_EQ(groups[0].count, 3 * c.d_model * c.d_model);  // q, k and v: one amax
}
