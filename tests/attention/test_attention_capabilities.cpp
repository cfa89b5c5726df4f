// The CUDA capability table (attention/capabilities.h): which kernel runs which dtype, head dim and
// pass, and the errors for the rest. Pure host logic: runs without a GPU. test_attention_cuda.cpp checks
// that the library behaves as the table says on a GPU.
#include <algorithm>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/attention_testing.h"
#include "attention/capabilities.h"

using namespace flashlm;
using flashlm::testing::HopperAlibiSinkRoute;

namespace {

AttentionProblem problem(DType dtype, int64_t head_dim) {
  AttentionProblem p;
  p.batch = 1;
  p.seq_q = p.seq_k = 64;
  p.heads_q = p.heads_k = 2;
  p.head_dim = head_dim;
  p.dtype = dtype;
  p.device = Device::cuda;
  return p;
}

// The plan, or the error message as nullopt plus `message`.
std::optional<CudaAttentionPlan> plan_of(DType dtype, int64_t head_dim, AttentionPass pass, std::string* message,
                                         AttentionImpl impl = AttentionImpl::flash) {
  try {
    const char* fn = pass == AttentionPass::forward ? "attention_forward" : "attention_backward";
    return plan_cuda_attention(fn, problem(dtype, head_dim), impl, pass);
  } catch (const Error& e) {
    *message = e.what();
    return std::nullopt;
  }
}

// Expects the plan for (dtype, head_dim, pass, impl) to run `family` at `kernel_head_dim`.
void expect_plan(DType dtype, int64_t head_dim, AttentionPass pass, AttentionImpl impl, CudaKernelFamily family,
                 int64_t kernel_head_dim) {
  std::string message;
  const auto plan = plan_of(dtype, head_dim, pass, &message, impl);
  const std::string what = std::string(dtype_name(dtype)) + " d" + std::to_string(head_dim) +
                           (pass == AttentionPass::forward ? " forward" : " backward");
  ASSERT_TRUE(plan) << what << ": " << message;
  EXPECT_EQ(plan->family, family) << what;
  EXPECT_EQ(plan->kernel_head_dim, kernel_head_dim) << what;
  EXPECT_EQ(plan->padded, kernel_head_dim != head_dim) << what;
}

TEST(AttentionCapabilities, CompiledHeadDimsRunTheirOwnKernel) {
  for (int d : {16, 32, 64, 128, 256}) {
    for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
      for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
        expect_plan(dt, d, pass, AttentionImpl::flash,
                    dt == DType::f32 ? CudaKernelFamily::f32 : CudaKernelFamily::mma_sync, d);
      }
    }
  }
}

TEST(AttentionCapabilities, OtherHeadDimsPadToTheNextKernelOfThePass) {
  struct Want {
    DType dtype;
    int64_t head_dim;
    AttentionPass pass;
    int64_t kernel;
  };
  const Want wants[] = {
      {DType::bf16, 8, AttentionPass::forward, 16},    {DType::bf16, 80, AttentionPass::forward, 128},
      {DType::f16, 96, AttentionPass::backward, 128},  {DType::f16, 200, AttentionPass::forward, 256},
      {DType::f32, 4, AttentionPass::backward, 16},    {DType::f32, 80, AttentionPass::backward, 128},
      {DType::f32, 160, AttentionPass::backward, 256}, {DType::bf16, 40, AttentionPass::backward, 64},
      {DType::f16, 136, AttentionPass::backward, 256}, {DType::bf16, 200, AttentionPass::backward, 256},
  };
  for (const Want& w : wants) {
    expect_plan(w.dtype, w.head_dim, w.pass, AttentionImpl::flash,
                w.dtype == DType::f32 ? CudaKernelFamily::f32 : CudaKernelFamily::mma_sync, w.kernel);
  }
}

// Every pass of the 16-bit family goes up to 256 (the mma.sync backward since head dim 256 got its
// kernel); above that, or with rows of a size the kernels cannot move, both passes are refused.
TEST(AttentionCapabilities, SixteenBitBackwardGoesTo256AndNoFurther) {
  for (int64_t d : {136, 160, 256}) {
    for (DType dt : {DType::f16, DType::bf16}) {
      expect_plan(dt, d, AttentionPass::backward, AttentionImpl::flash, CudaKernelFamily::mma_sync, 256);
    }
  }
  for (int64_t d : {264, 512}) {
    for (DType dt : {DType::f16, DType::bf16}) {
      std::string message;
      EXPECT_FALSE(plan_of(dt, d, AttentionPass::backward, &message));
      EXPECT_NE(message.find("attention_backward: q: head_dim " + std::to_string(d) + " is not supported on cuda"),
                std::string::npos)
          << message;
    }
  }
}

TEST(AttentionCapabilities, NaiveTakesEveryAlignedHeadDimUnpadded) {
  for (int64_t d : {8, 24, 80, 200, 256}) {
    for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
      expect_plan(DType::bf16, d, pass, AttentionImpl::naive, CudaKernelFamily::naive, d);
    }
  }
}

TEST(AttentionCapabilities, UnalignedOrTooLargeHeadDimsAndOtherDtypesAreErrors) {
  struct Bad {
    DType dtype;
    int64_t head_dim;
    const char* fragment;
  };
  const Bad bads[] = {
      {DType::bf16, 36, "head_dim 36 is not supported on cuda (at most 256, and rows of a multiple of 16 bytes: a "
                        "multiple of 8 for bf16)"},
      {DType::f32, 6, "head_dim 6 is not supported on cuda"},
      {DType::f16, 264, "head_dim 264 is not supported on cuda"},
      {DType::f64, 64, "q: dtype fp64 is not supported on cuda (fp16, bf16, fp32 or fp8_e4m3)"},
  };
  for (const Bad& b : bads) {
    for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::naive}) {
      std::string message;
      EXPECT_FALSE(plan_of(b.dtype, b.head_dim, AttentionPass::forward, &message, impl));
      EXPECT_NE(message.find(b.fragment), std::string::npos) << message;
    }
  }
}

// The Hopper kernels' predicates need the views, so plans name mma.sync, their fallback, in both passes, and
// flash_kernel_family (tested on the GPU) turns that into the Hopper family; the Hopper row lists a backward
// for head dims 64, 128 and 256 (256 on the wide-head kernel), each of which the mma.sync backward (its
// fallback) also compiles.
TEST(AttentionCapabilities, HopperIsTheMmaSyncFamilysFirstChoice) {
  for (int d : kHopperForwardHeadDims) {
    expect_plan(DType::bf16, d, AttentionPass::forward, AttentionImpl::flash, CudaKernelFamily::mma_sync, d);
  }
  for (int d : kHopperBackwardHeadDims) {
    expect_plan(DType::f16, d, AttentionPass::backward, AttentionImpl::flash, CudaKernelFamily::mma_sync, d);
    EXPECT_NE(std::find(kMmaSyncBackwardHeadDims.begin(), kMmaSyncBackwardHeadDims.end(), d),
              kMmaSyncBackwardHeadDims.end()) << d;
  }
  const CudaKernelCapability& hopper = cuda_kernel_capability(CudaKernelFamily::hopper);
  EXPECT_TRUE(std::ranges::equal(hopper.backward_head_dims, std::array{64, 128, 256}));
  EXPECT_TRUE(std::ranges::equal(hopper.forward_head_dims, std::array{64, 128, 256}));
}

// fp8_e4m3 has its own family: a forward at head dims 64 and 128; a backward at the 16-bit backward's head dims
// (it runs those kernels on bf16 copies), each exact, none padded; no naive path.
TEST(AttentionCapabilities, Fp8HasAForwardAt64And128AndABackwardAtTheBf16BackwardsHeadDims) {
  for (int d : kFp8ForwardHeadDims) {
    expect_plan(DType::f8e4m3, d, AttentionPass::forward, AttentionImpl::flash, CudaKernelFamily::fp8, d);
  }
  for (int d : {16, 32, 64, 128, 256}) {
    expect_plan(DType::f8e4m3, d, AttentionPass::backward, AttentionImpl::flash, CudaKernelFamily::fp8, d);
  }
  std::string message;
  EXPECT_FALSE(plan_of(DType::f8e4m3, 32, AttentionPass::forward, &message, AttentionImpl::flash));
  EXPECT_NE(message.find("head_dim 32 has no cuda forward kernel for fp8_e4m3"), std::string::npos) << message;
  // No padding: a head dim between two kernels is refused, naming the ones there are.
  EXPECT_FALSE(plan_of(DType::f8e4m3, 48, AttentionPass::backward, &message, AttentionImpl::flash));
  EXPECT_NE(message.find("head_dim 48 has no cuda backward kernel for fp8_e4m3 (the fp8 backward kernels are "
                         "compiled for head dims 16, 32, 64, 128, 256)"),
            std::string::npos)
      << message;
  for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
    EXPECT_FALSE(plan_of(DType::f8e4m3, 64, pass, &message, AttentionImpl::naive));
    EXPECT_NE(message.find("the naive attention kernels do not take dtype fp8_e4m3"), std::string::npos) << message;
  }
}

TEST(AttentionCapabilities, WithHeadDimPairInstantiatesExactlyTheListedPairs) {
  std::vector<std::pair<int, int>> seen;
  for (auto [qk, v] : {std::pair<int64_t, int64_t>{192, 128}, {128, 192}, {192, 192}, {128, 128}, {192, 64}}) {
    const bool found = with_head_dim_pair<kHopperForwardHeadDimPairs>(
        qk, v, [&](auto dim, auto dim_v) { seen.emplace_back(dim.value, dim_v.value); });
    EXPECT_EQ(found, qk == 192 && v == 128) << qk << ", " << v;
    const bool found_backward = with_head_dim_pair<kHopperBackwardHeadDimPairs>(
        qk, v, [&](auto dim, auto dim_v) { seen.emplace_back(dim.value, dim_v.value); });
    EXPECT_EQ(found_backward, qk == 192 && v == 128) << qk << ", " << v;
  }
  EXPECT_EQ(seen, (std::vector<std::pair<int, int>>{{192, 128}, {192, 128}}));
}

TEST(AttentionCapabilities, WithHeadDimInstantiatesExactlyTheListedDims) {
  std::vector<int> seen;
  for (int64_t d : {8, 16, 24, 32, 64, 100, 128, 256}) {
    const bool found = with_head_dim<kMmaSyncBackwardHeadDims>(d, [&](auto dim) { seen.push_back(dim.value); });
    EXPECT_EQ(found, d == 16 || d == 32 || d == 64 || d == 128 || d == 256) << d;
  }
  EXPECT_EQ(seen, (std::vector<int>{16, 32, 64, 128, 256}));
}

// The 16-bit flash kernels (mma.sync, and through it Hopper) have the sliding window and soft-capping; every
// other family the plan can choose refuses them by the option's name (never a silent full mask), in both
// passes; a causal mask alone (window_right = 0 from causal) is not a window.
TEST(AttentionCapabilities, TheWindowAndSoftcapPlanOnMmaSyncAndOtherFamiliesRefuseThemByName) {
  struct Planned {
    DType dtype;
    AttentionImpl impl;
    const char* family;
    bool has_variants;
  };
  for (const Planned& f : {Planned{DType::bf16, AttentionImpl::flash, "mma.sync", true},
                           Planned{DType::f16, AttentionImpl::flash, "mma.sync", true},
                           Planned{DType::f32, AttentionImpl::flash, "fp32", false},
                           Planned{DType::f16, AttentionImpl::naive, "naive", false},
                           Planned{DType::f8e4m3, AttentionImpl::flash, "fp8", false}}) {
    for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
      SCOPED_TRACE(std::string(f.family) + (pass == AttentionPass::forward ? " forward" : " backward"));
      for (auto [left, right, causal] : {std::tuple{int64_t{4}, int64_t{-1}, false}, {-1, 3, false}, {8, 0, true}}) {
        AttentionProblem p = problem(f.dtype, 64);
        p.window_left = left;
        p.window_right = right;
        p.causal = causal;
        if (f.has_variants) {
          EXPECT_EQ(plan_cuda_attention("attention_forward", p, f.impl, pass).family, CudaKernelFamily::mma_sync);
          continue;
        }
        try {
          plan_cuda_attention("attention_forward", p, f.impl, pass);
          ADD_FAILURE() << "window (" << left << ", " << right << ") was planned";
        } catch (const Error& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("window_size_left/window_size_right"), std::string::npos) << m;
          EXPECT_NE(m.find(std::string("the ") + f.family + " attention kernels"), std::string::npos) << m;
        }
      }
      AttentionProblem p = problem(f.dtype, 64);
      p.softcap = 30;
      if (f.has_variants) {
        EXPECT_EQ(plan_cuda_attention("attention_forward", p, f.impl, pass).family, CudaKernelFamily::mma_sync);
      } else {
        try {
          plan_cuda_attention("attention_forward", p, f.impl, pass);
          ADD_FAILURE() << "softcap was planned";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("softcap"), std::string::npos) << e.what();
        }
      }
      p = problem(f.dtype, 64);
      p.causal = true;
      p.window_right = 0;
      EXPECT_NO_THROW(plan_cuda_attention("attention_forward", p, f.impl, pass));
    }
  }
  // flash_kernel_family may move an mma.sync plan to the Hopper kernels after these checks.
  const CudaKernelCapability& mma = cuda_kernel_capability(CudaKernelFamily::mma_sync);
  const CudaKernelCapability& hopper = cuda_kernel_capability(CudaKernelFamily::hopper);
  EXPECT_TRUE(mma.sliding_window || !hopper.sliding_window);
  EXPECT_TRUE(mma.softcap || !hopper.softcap);
}

// ALiBi and attention sinks plan on the mma.sync kernels (fp16 and bf16, both passes); the fp32, naive and fp8
// families refuse each by the option's name. The values are never read: a CUDA problem's slopes and sinks live
// in device memory. (A head dim of v's own: HeadDimPairs... below.)
TEST(AttentionCapabilities, AlibiAndSinksPlanOnMmaSyncAndEveryFamilyRefusesWhatItLacksByName) {
  struct Planned {
    DType dtype;
    AttentionImpl impl;
    const char* family;
    bool has_alibi_and_sinks;
  };
  const float device_values[4] = {};  // stands for device memory: plan_cuda_attention must not need it
  for (const Planned& f : {Planned{DType::bf16, AttentionImpl::flash, "mma.sync", true},
                           Planned{DType::f16, AttentionImpl::flash, "mma.sync", true},
                           Planned{DType::f32, AttentionImpl::flash, "fp32", false},
                           Planned{DType::f16, AttentionImpl::naive, "naive", false},
                           Planned{DType::f8e4m3, AttentionImpl::flash, "fp8", false}}) {
    for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
      SCOPED_TRACE(std::string(f.family) + (pass == AttentionPass::forward ? " forward" : " backward"));
      auto expect_refused = [&](const AttentionProblem& p, const char* option) {
        try {
          plan_cuda_attention("attention_forward", p, f.impl, pass);
          ADD_FAILURE() << option << " was planned";
        } catch (const Error& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find(std::string(option) + ":"), std::string::npos) << m;
          EXPECT_NE(m.find(std::string("the ") + f.family + " attention kernels"), std::string::npos) << m;
        }
      };
      auto expect_planned_or_refused = [&](const AttentionProblem& p, const char* option) {
        if (!f.has_alibi_and_sinks) return expect_refused(p, option);
        try {
          const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", p, f.impl, pass);
          EXPECT_EQ(plan.family, CudaKernelFamily::mma_sync) << option;
          EXPECT_EQ(plan.kernel_head_dim, 64) << option;
        } catch (const Error& e) {
          ADD_FAILURE() << option << " was refused: " << e.what();
        }
      };
      AttentionProblem p = problem(f.dtype, 64);
      p.alibi = true;
      p.alibi_slopes = device_values;
      expect_planned_or_refused(p, "alibi_slopes");
      p = problem(f.dtype, 64);
      p.sink = true;
      p.learnable_sink = device_values;
      expect_planned_or_refused(p, "learnable_sink");
      p = problem(f.dtype, 64);
      p.head_dim_v = 64;  // equal to head_dim: not a variant
      EXPECT_NO_THROW(plan_cuda_attention("attention_forward", p, f.impl, pass));
    }
  }
}

// Per-head FP8 descales (AttentionOptions::*_descale_heads): the fp8 row has them (its forward reads them per tile,
// its backward dequantises per head), so an fp8 problem with any of the three is planned on it in both passes (the
// values live in device memory and are never read here). The other rows take no descales: a problem that asked one
// of them for per-head descales (validation lets none through: they need fp8 inputs) is refused by the options'
// names.
TEST(AttentionCapabilities, PerHeadDescalesArePlannedOnTheFp8RowAlone) {
  for (CudaKernelFamily f : {CudaKernelFamily::mma_sync, CudaKernelFamily::hopper, CudaKernelFamily::f32,
                             CudaKernelFamily::fp8, CudaKernelFamily::naive}) {
    EXPECT_EQ(cuda_kernel_capability(f).per_head_descales, f == CudaKernelFamily::fp8) << cuda_kernel_family_name(f);
  }
  const float device_values[4] = {};
  for (int which = 0; which < 3; ++which) {
    for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
      AttentionProblem p = problem(DType::f8e4m3, 64);
      AttentionProblem::HeadDescales* d[] = {&p.q_descale_heads, &p.k_descale_heads, &p.v_descale_heads};
      *d[which] = {device_values, 2, 1};
      try {
        const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", p, AttentionImpl::flash, pass);
        EXPECT_EQ(plan.family, CudaKernelFamily::fp8) << which;
        EXPECT_EQ(plan.kernel_head_dim, 64) << which;
        EXPECT_FALSE(plan.padded) << which;
      } catch (const Error& e) {
        ADD_FAILURE() << "per-head descale " << which << " was refused: " << e.what();
      }
      AttentionProblem wrong = problem(DType::bf16, 64);
      AttentionProblem::HeadDescales* w[] = {&wrong.q_descale_heads, &wrong.k_descale_heads, &wrong.v_descale_heads};
      *w[which] = {device_values, 2, 1};
      try {
        plan_cuda_attention("attention_forward", wrong, AttentionImpl::flash, pass);
        ADD_FAILURE() << "per-head descale " << which << " was planned on mma.sync";
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("q_descale_heads/k_descale_heads/v_descale_heads"), std::string::npos) << m;
        EXPECT_NE(m.find("the mma.sync attention kernels take per-tensor descales only"), std::string::npos) << m;
        EXPECT_NE(m.find("in the fp8 kernels"), std::string::npos) << m;
      }
    }
  }
}

// The rows: mma.sync claims ALiBi and sinks; with the Hopper route off (hopper_alibi_sink_route,
// FLASHLM_HOPPER_ALIBI_SINK=0), Hopper, fp32, fp8 and naive claim neither (so flash_kernel_family keeps an ALiBi or sink problem on
// mma.sync, never Hopper). The Hopper row claims no variant the mma.sync row lacks (plan_cuda_attention checks
// the mma.sync row for both). Only the Hopper kernels have head dim pairs of their own, (192, 128), forward and
// backward. The flash families that pad (mma.sync and fp32) pad a head_dim_v of its own too; the others do neither.
TEST(AttentionCapabilities, OnlyTheMmaSyncRowClaimsAlibiAndSinks) {
  const HopperAlibiSinkRoute route(false);
  const CudaKernelCapability& mma = cuda_kernel_capability(CudaKernelFamily::mma_sync);
  EXPECT_TRUE(mma.alibi);
  EXPECT_TRUE(mma.learnable_sink);
  for (CudaKernelFamily f : {CudaKernelFamily::hopper, CudaKernelFamily::f32, CudaKernelFamily::fp8,
                             CudaKernelFamily::naive}) {
    EXPECT_FALSE(cuda_kernel_capability(f).alibi) << cuda_kernel_family_name(f);
    EXPECT_FALSE(cuda_kernel_capability(f).learnable_sink) << cuda_kernel_family_name(f);
  }
  const CudaKernelCapability& hopper = cuda_kernel_capability(CudaKernelFamily::hopper);
  EXPECT_TRUE(mma.alibi || !hopper.alibi);
  EXPECT_TRUE(mma.learnable_sink || !hopper.learnable_sink);
  for (CudaKernelFamily f : {CudaKernelFamily::mma_sync, CudaKernelFamily::hopper, CudaKernelFamily::f32,
                             CudaKernelFamily::fp8, CudaKernelFamily::naive}) {
    const CudaKernelCapability& c = cuda_kernel_capability(f);
    if (f != CudaKernelFamily::hopper) {
      EXPECT_TRUE(c.forward_head_dim_pairs.empty()) << cuda_kernel_family_name(f);
      EXPECT_TRUE(c.backward_head_dim_pairs.empty()) << cuda_kernel_family_name(f);
    }
  }
  for (CudaKernelFamily f : {CudaKernelFamily::mma_sync, CudaKernelFamily::f32}) {
    EXPECT_TRUE(cuda_kernel_capability(f).pads_head_dim) << cuda_kernel_family_name(f);
    EXPECT_TRUE(cuda_kernel_capability(f).pads_head_dim_v) << cuda_kernel_family_name(f);
  }
  for (CudaKernelFamily f : {CudaKernelFamily::hopper, CudaKernelFamily::fp8, CudaKernelFamily::naive}) {
    EXPECT_FALSE(cuda_kernel_capability(f).pads_head_dim) << cuda_kernel_family_name(f);
    EXPECT_FALSE(cuda_kernel_capability(f).pads_head_dim_v) << cuda_kernel_family_name(f);
  }
  ASSERT_EQ(hopper.forward_head_dim_pairs.size(), 1u);
  EXPECT_EQ(hopper.forward_head_dim_pairs[0].qk, 192);
  EXPECT_EQ(hopper.forward_head_dim_pairs[0].v, 128);
  ASSERT_EQ(hopper.backward_head_dim_pairs.size(), 1u);
  EXPECT_EQ(hopper.backward_head_dim_pairs[0].qk, 192);
  EXPECT_EQ(hopper.backward_head_dim_pairs[0].v, 128);
}

// With the Hopper route on, the Hopper row claims ALiBi and sinks and nothing else changes: its head dims,
// dtypes and other variants are the default row's, and no other row moves; off again, it claims neither.
TEST(AttentionCapabilities, TheHopperRouteSwitchesOnlyTheHopperRowsAlibiAndSinks) {
  const auto same_pair = [](const HeadDimPair& a, const HeadDimPair& b) { return a.qk == b.qk && a.v == b.v; };
  const CudaKernelCapability off = [] {
    const HopperAlibiSinkRoute route(false);
    return cuda_kernel_capability(CudaKernelFamily::hopper);
  }();
  {
    const HopperAlibiSinkRoute route(true);
    EXPECT_TRUE(hopper_alibi_sink_route());
    const CudaKernelCapability& on = cuda_kernel_capability(CudaKernelFamily::hopper);
    EXPECT_TRUE(on.alibi);
    EXPECT_TRUE(on.learnable_sink);
    EXPECT_EQ(on.family, CudaKernelFamily::hopper);
    EXPECT_TRUE(std::ranges::equal(on.dtypes, off.dtypes));
    EXPECT_TRUE(std::ranges::equal(on.forward_head_dims, off.forward_head_dims));
    EXPECT_TRUE(std::ranges::equal(on.backward_head_dims, off.backward_head_dims));
    EXPECT_EQ(on.pads_head_dim, off.pads_head_dim);
    EXPECT_EQ(on.pads_head_dim_v, off.pads_head_dim_v);
    EXPECT_EQ(on.any_head_dim, off.any_head_dim);
    EXPECT_EQ(on.sliding_window, off.sliding_window);
    EXPECT_EQ(on.softcap, off.softcap);
    EXPECT_TRUE(std::ranges::equal(on.forward_head_dim_pairs, off.forward_head_dim_pairs, same_pair));
    EXPECT_TRUE(std::ranges::equal(on.backward_head_dim_pairs, off.backward_head_dim_pairs, same_pair));
    for (CudaKernelFamily f : {CudaKernelFamily::f32, CudaKernelFamily::fp8, CudaKernelFamily::naive}) {
      EXPECT_FALSE(cuda_kernel_capability(f).alibi) << cuda_kernel_family_name(f);
      EXPECT_FALSE(cuda_kernel_capability(f).learnable_sink) << cuda_kernel_family_name(f);
    }
    const CudaKernelCapability& mma = cuda_kernel_capability(CudaKernelFamily::mma_sync);
    EXPECT_TRUE(mma.alibi && mma.learnable_sink);  // the Hopper row still claims nothing mma.sync lacks
  }
  const HopperAlibiSinkRoute route(false);
  EXPECT_FALSE(hopper_alibi_sink_route());
  EXPECT_FALSE(cuda_kernel_capability(CudaKernelFamily::hopper).alibi);
  EXPECT_FALSE(cuda_kernel_capability(CudaKernelFamily::hopper).learnable_sink);
}

// ALiBi ([Hq] or [B, Hq] alike: the plan sees only that there are slopes) and a sink together, with a window
// and soft-capping, at every compiled head dim and a padded one (80 runs the 128 kernel), plan on mma.sync in
// both passes.
TEST(AttentionCapabilities, AlibiAndSinksCombineWithTheOtherVariantsAndPadding) {
  const float device_values[4] = {};  // stands for device memory
  for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (auto [d, kernel] : {std::pair<int64_t, int64_t>{16, 16}, {32, 32}, {64, 64}, {80, 128}, {128, 128},
                               {256, 256}}) {
        AttentionProblem p = problem(dtype, d);
        p.alibi = true;
        p.alibi_slopes = device_values;
        p.sink = true;
        p.learnable_sink = device_values;
        p.window_left = 7;
        p.window_right = 33;
        p.softcap = 30;
        const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", p, AttentionImpl::flash, pass);
        EXPECT_EQ(plan.family, CudaKernelFamily::mma_sync) << "d" << d;
        EXPECT_EQ(plan.kernel_head_dim, kernel) << "d" << d;
        EXPECT_EQ(plan.padded, kernel != d) << "d" << d;
      }
    }
  }
}

// A head dim of v's own plans on the flash families' padded path in both passes: q and k from head_dim, v and o
// from head_dim_v, both to the smallest compiled head dim at least as large as either (mma.sync for fp16/bf16,
// fp32 for fp32), with every variant the family has. (192, 128) pads to 256 in both passes too: the Hopper
// kernels' own pair is flash_kernel_family's choice on the views, not the plan's (the Hopper row lists it for
// both passes). The naive and fp8 kernels refuse a pair by v's name before the variants; a head_dim_v past
// every kernel or with rows of no whole number of 16-byte vectors is refused by its name, as head_dim is.
TEST(AttentionCapabilities, HeadDimPairsPadToTheKernelOfTheLargerHeadDimAndAreRefusedElsewhereByName) {
  const float device_values[4] = {};  // stands for device memory
  auto split = [](DType dtype, int64_t qk, int64_t v) {
    AttentionProblem p = problem(dtype, qk);
    p.head_dim_v = v;
    return p;
  };
  auto expect_refused = [](const AttentionProblem& p, AttentionImpl impl, AttentionPass pass,
                           std::initializer_list<std::string> fragments) {
    try {
      plan_cuda_attention(pass == AttentionPass::forward ? "attention_forward" : "attention_backward", p, impl, pass);
      ADD_FAILURE() << "planned";
    } catch (const Error& e) {
      const std::string m = e.what();
      for (const std::string& f : fragments) EXPECT_NE(m.find(f), std::string::npos) << m;
    }
  };
  struct Want {
    DType dtype;
    int64_t qk, v, kernel;
  };
  const Want wants[] = {
      {DType::bf16, 192, 128, 256}, {DType::f16, 192, 128, 256}, {DType::bf16, 64, 128, 128},
      {DType::f16, 128, 64, 128},   {DType::bf16, 96, 64, 128},  {DType::f16, 16, 32, 32},
      {DType::bf16, 32, 16, 32},    {DType::f16, 256, 128, 256}, {DType::bf16, 128, 256, 256},
      {DType::bf16, 8, 24, 32},     {DType::f16, 80, 48, 128},   {DType::f32, 192, 128, 256},
      {DType::f32, 4, 12, 16},      {DType::f32, 24, 40, 64},
  };
  for (const Want& w : wants) {
    for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
      for (bool route : {false, true}) {
        const HopperAlibiSinkRoute hopper_route(route);
        const std::string what = fmt::format("{} ({}, {}) {}", dtype_name(w.dtype), w.qk, w.v,
                                             pass == AttentionPass::forward ? "forward" : "backward");
        AttentionProblem p = split(w.dtype, w.qk, w.v);
        const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", p, AttentionImpl::flash, pass);
        EXPECT_EQ(plan.family, w.dtype == DType::f32 ? CudaKernelFamily::f32 : CudaKernelFamily::mma_sync) << what;
        EXPECT_EQ(plan.kernel_head_dim, w.kernel) << what;
        EXPECT_TRUE(plan.padded) << what;
        if (w.dtype == DType::f32) continue;
        p.window_left = 100;
        p.softcap = 30;
        p.causal = true;
        p.alibi = true;
        p.alibi_slopes = device_values;
        p.sink = true;
        p.learnable_sink = device_values;
        const CudaAttentionPlan masked = plan_cuda_attention("attention_forward", p, AttentionImpl::flash, pass);
        EXPECT_EQ(masked.family, CudaKernelFamily::mma_sync) << what << " with every variant";
        EXPECT_EQ(masked.kernel_head_dim, w.kernel) << what << " with every variant";
      }
    }
  }
  // The Hopper row lists (192, 128) for both passes, so both may leave the padded path; no other pair.
  const CudaKernelCapability& hopper = cuda_kernel_capability(CudaKernelFamily::hopper);
  EXPECT_TRUE(has_head_dim_pair(hopper, AttentionPass::forward, 192, 128));
  EXPECT_TRUE(has_head_dim_pair(hopper, AttentionPass::backward, 192, 128));
  EXPECT_FALSE(has_head_dim_pair(hopper, AttentionPass::forward, 128, 192));
  EXPECT_FALSE(has_head_dim_pair(hopper, AttentionPass::backward, 128, 192));
  EXPECT_FALSE(has_head_dim_pair(hopper, AttentionPass::backward, 256, 128));
  EXPECT_FALSE(has_head_dim_pair(cuda_kernel_capability(CudaKernelFamily::mma_sync), AttentionPass::forward, 192, 128));

  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    for (AttentionPass pass : {AttentionPass::forward, AttentionPass::backward}) {
      AttentionProblem p = split(dtype, 192, 128);
      p.window_left = 10;  // the pair is refused first, whatever else the naive kernels lack
      expect_refused(p, AttentionImpl::naive, pass,
                     {"v: head_dim_v 128 differs from head_dim 192", "the naive",
                      "kernels need one head dim for q, k and v", "runs on the cpu"});
    }
    expect_refused(split(dtype, 128, 320), AttentionImpl::flash, AttentionPass::forward,
                   {"attention_forward: v: head_dim_v 320 is not supported on cuda", "at most 256"});
    expect_refused(split(dtype, 64, 36), AttentionImpl::flash, AttentionPass::backward,
                   {"attention_backward: v: head_dim_v 36 is not supported on cuda", "rows of a multiple of 16 bytes",
                    fmt::format("a multiple of 8 for {}", dtype_name(dtype))});
    expect_refused(split(dtype, 320, 128), AttentionImpl::flash, AttentionPass::forward,
                   {"q: head_dim 320 is not supported on cuda"});
  }
  expect_refused(split(DType::f32, 64, 6), AttentionImpl::flash, AttentionPass::forward,
                 {"v: head_dim_v 6 is not supported on cuda", "a multiple of 4 for fp32"});
  expect_refused(split(DType::f8e4m3, 192, 128), AttentionImpl::flash, AttentionPass::forward,
                 {"v: head_dim_v 128 differs from head_dim 192", "the fp8 forward kernels need one head dim",
                  "runs on the cpu"});
  expect_refused(split(DType::f8e4m3, 128, 64), AttentionImpl::flash, AttentionPass::backward,
                 {"v: head_dim_v 64 differs from head_dim 128", "the fp8 backward kernels need one head dim",
                  "runs on the cpu"});
  AttentionProblem equal = split(DType::bf16, 192, 192);  // equal to head_dim: not a pair, the usual padded plan
  const CudaAttentionPlan plan = plan_cuda_attention("attention_forward", equal, AttentionImpl::flash, AttentionPass::forward);
  EXPECT_EQ(plan.family, CudaKernelFamily::mma_sync);
  EXPECT_EQ(plan.kernel_head_dim, 256);
  EXPECT_TRUE(plan.padded);
  equal = split(DType::bf16, 128, 128);
  EXPECT_FALSE(plan_cuda_attention("attention_forward", equal, AttentionImpl::flash, AttentionPass::forward).padded);
}

}  // namespace
