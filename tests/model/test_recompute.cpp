// Big-model machinery on the CPU: model configs (named, JSON), activation recomputation (gradients
// bit-identical to keeping everything) and the memory plan's arithmetic (what is allocated, what auto picks,
// what is refused).
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "flashlm/error.h"
#include "flashlm/model.h"

using namespace flashlm;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Five blocks, so that blocks:2 and blocks:3 leave a shorter last segment.
ModelConfig five_blocks() {
  ModelConfig c = ModelConfig::named("tiny", 24, 64);
  c.layers = 5;
  return c;
}

struct Step {
  double loss1 = 0, loss2 = 0;
  std::vector<float> grads, params;
  std::vector<std::string> hook_calls;  // parameters_needed's ranges, as "offset+count"
};

// Two full train steps (the second starts from the state the first left), with fresh random tokens.
Step two_steps(const ModelConfig& c, const RecomputePlan& plan) {
  ModelOptions o;
  o.recompute = plan;
  const int64_t batch = 2, seq = 24, n = batch * seq;
  CpuModel model(c, batch, seq, o);
  model.init_parameters(11);
  Step out;
  model.set_parameters_needed_hook(
      [&](int64_t offset, int64_t count) { out.hook_calls.push_back(std::to_string(offset) + "+" + std::to_string(count)); });
  std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u, int32_t((state >> 8) % uint32_t(c.vocab)); };
  AdamWConfig opt;
  for (int step = 0; step < 2; ++step) {
    for (int64_t i = 0; i < n; ++i) tokens[size_t(i)] = next(), targets[size_t(i)] = next();
    model.zero_grad();
    const double loss = model.forward(tokens.data(), targets.data());
    (step == 0 ? out.loss1 : out.loss2) = loss;
    model.backward();
    if (step == 1) out.grads.assign(model.gradients(), model.gradients() + model.parameter_count());
    optimizer_step(model, opt, 1e-3);
  }
  out.params.assign(model.parameters(), model.parameters() + model.parameter_count());
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(RecomputePlan, ParsesAndNamesEveryPlan) {
  for (const char* text : {"none", "blocks:1", "blocks:4", "selective", "auto"}) {
    EXPECT_EQ(RecomputePlan::parse(text).name(), text);
  }
  EXPECT_EQ(RecomputePlan::parse("blocks"), (RecomputePlan{RecomputePlan::Kind::blocks, 1}));
  for (const char* bad : {"", "block", "blocks:", "blocks:0", "blocks:-2", "blocks:3x", "blocks:99999", "Auto"}) {
    EXPECT_THROW(RecomputePlan::parse(bad), InvalidArgument) << bad;  // a usage error at the CLI
  }
}

TEST(ModelConfig, Cs3368bIsTheLeaderboardModel) {
  const ModelConfig c = ModelConfig::named("cs336-8b", 32768);
  EXPECT_EQ(c.vocab, 151936);
  EXPECT_EQ(c.d_model, 4096);
  EXPECT_EQ(c.d_ff, 11008);
  EXPECT_EQ(c.layers, 34);
  EXPECT_EQ(c.heads, 32);
  EXPECT_NEAR(double(c.parameter_count()) / 1e6, 8125.7, 0.05);  // SPEC's table
  EXPECT_EQ(ModelConfig::named("cs336-8b", 1024, 50000).vocab, 50000);
  EXPECT_EQ(ModelConfig::named("small").vocab, 10000);
  ModelConfig long_context = ModelConfig::named("tiny", ModelConfig::kMaxContext);
  EXPECT_NO_THROW(long_context.validate());
  long_context.context = ModelConfig::kMaxContext + 1;
  EXPECT_THROW(long_context.validate(), InvalidArgument);
  EXPECT_THROW(ModelConfig::named("huge"), InvalidArgument);
}

TEST(ModelConfig, FromJsonOverridesABaseAndRejectsWhatItDoesNotKnow) {
  const ModelConfig c = ModelConfig::from_json(R"({"base": "small", "layers": 3, "vocab": 512, "rope_theta": 5e5})");
  EXPECT_EQ(c.d_model, 768);
  EXPECT_EQ(c.layers, 3);
  EXPECT_EQ(c.vocab, 512);
  EXPECT_EQ(c.rope_theta, 5e5);
  const ModelConfig d = ModelConfig::from_json(R"({"d_model": 64, "d_ff": 96, "layers": 1, "heads": 2, "context": 65536})");
  EXPECT_EQ(d.head_dim(), 32);
  EXPECT_EQ(d.context, 65536);
  auto message = [](const char* json) {
    try {
      ModelConfig::from_json(json);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(R"({"dmodel": 64})").find("unknown key \"dmodel\""), std::string::npos);
  EXPECT_NE(message(R"({"layers": "4"})").find("\"layers\" must be an integer"), std::string::npos);
  EXPECT_NE(message(R"({"layers": 2.5})").find("\"layers\" must be an integer"), std::string::npos);
  EXPECT_NE(message(R"({"base": "huge"})").find("unknown model size 'huge'"), std::string::npos);
  EXPECT_NE(message(R"([1, 2])").find("expected a JSON object"), std::string::npos);
  EXPECT_NE(message(R"({"layers": )").find("not valid JSON"), std::string::npos);
  EXPECT_NE(message(R"({"d_model": 4294967296})").find("overflows"), std::string::npos);
  EXPECT_NE(message(R"({"context": 131072})").find("context = 131072"), std::string::npos);

  const auto path = std::filesystem::temp_directory_path() / "flashlm_test_model_config.json";
  std::ofstream(path) << R"({"base": "tiny", "layers": 3})";
  EXPECT_EQ(ModelConfig::from_json_file(path.string()).layers, 3);
  std::filesystem::remove(path);
  EXPECT_THROW(ModelConfig::from_json_file(path.string()), InvalidArgument);  // gone
  std::vector<std::string> keys;
  ModelConfig::from_json(R"({"base": "tiny", "vocab": 1000})", &keys);
  EXPECT_EQ(keys, (std::vector<std::string>{"base", "vocab"}));
}

// A FIFO with no writer is refused at once (std::ifstream blocked on it forever), as every file the project
// reads: a usage error naming the path.
TEST(ModelConfig, FromJsonFileRefusesAFifo) {
  const auto path = std::filesystem::temp_directory_path() / "flashlm_test_model_config.fifo";
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  try {
    ModelConfig::from_json_file(path.string());
    ADD_FAILURE() << "a FIFO was read as a model config";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file (a FIFO)"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

TEST(CpuRecompute, GradientsAndUpdatesAreBitIdenticalToKeepingEverything) {
  const ModelConfig c = five_blocks();
  const Step reference = two_steps(c, RecomputePlan::parse("none"));
  for (const char* plan : {"blocks:1", "blocks:2", "blocks:3", "blocks:5", "blocks:8", "selective"}) {
    const Step s = two_steps(c, RecomputePlan::parse(plan));
    EXPECT_EQ(s.loss1, reference.loss1) << plan;
    EXPECT_EQ(s.loss2, reference.loss2) << plan;
    EXPECT_TRUE(same_bits(s.grads, reference.grads)) << plan;
    EXPECT_TRUE(same_bits(s.params, reference.params)) << plan;
  }
}

TEST(CpuRecompute, TheRecomputedForwardCallsTheParameterHookOfEveryBlockItRecomputes) {
  const ModelConfig c = five_blocks();
  const auto layout = parameter_layout(c);
  auto block_range = [&](int64_t l) {  // the hook's range for block l: its parameters, contiguous
    const std::string p = "layers." + std::to_string(l) + ".";
    int64_t begin = -1, end = 0;
    for (const auto& info : layout) {
      if (info.name.rfind(p, 0) != 0) continue;
      if (begin < 0) begin = info.offset;
      end = info.offset + info.numel();
    }
    return std::to_string(begin) + "+" + std::to_string(end - begin);
  };
  // Per step, the blocks' ranges only (the embedding and the head have their own): the forward's five, then
  // in the backward each block's own, preceded by the recomputation of its segment where the working set
  // does not hold it (the last segment it still holds).
  auto blocks_only = [&](const std::vector<std::string>& calls) {
    std::vector<std::string> out;
    for (const auto& call : calls) {
      for (int64_t l = 0; l < 5; ++l) {
        if (call == block_range(l)) out.push_back(std::to_string(l));
      }
    }
    return out;
  };
  auto expected = [&](std::vector<int64_t> backward) {
    std::vector<std::string> calls;
    for (int step = 0; step < 2; ++step) {
      for (int64_t l = 0; l < 5; ++l) calls.push_back(std::to_string(l));
      for (int64_t l : backward) calls.push_back(std::to_string(l));
    }
    return calls;
  };
  EXPECT_EQ(blocks_only(two_steps(c, RecomputePlan::parse("none")).hook_calls), expected({4, 3, 2, 1, 0}));
  EXPECT_EQ(blocks_only(two_steps(c, RecomputePlan::parse("blocks:1")).hook_calls),
            expected({4, 3, 3, 2, 2, 1, 1, 0, 0}));
  EXPECT_EQ(blocks_only(two_steps(c, RecomputePlan::parse("blocks:2")).hook_calls), expected({4, 2, 3, 3, 2, 0, 1, 1, 0}));
  EXPECT_EQ(blocks_only(two_steps(c, RecomputePlan::parse("selective")).hook_calls),
            expected({4, 3, 3, 2, 2, 1, 1, 0, 0}));
}

TEST(MemoryPlan, MatchesWhatTheCpuModelAllocates) {
  const ModelConfig c = five_blocks();
  for (const char* plan_name : {"none", "blocks:1", "blocks:2", "selective"}) {
    ModelOptions o;
    o.recompute = RecomputePlan::parse(plan_name);
    const MemoryPlan plan = plan_model_memory(c, 2, 24, Device::cpu, DType::f32, o);
    int64_t activations = 0;
    for (const auto& item : plan.items) {
      if (item.what.find("activations") != std::string::npos || item.what.find("logits") != std::string::npos) {
        activations += item.bytes;
      }
    }
    const CpuModel model(c, 2, 24, o);
    EXPECT_EQ(int64_t(model.activation_bytes()), activations) << plan_name;
  }
}

TEST(MemoryPlan, RecomputationShrinksTheActivationsOfTheLeaderboardStep) {
  const ModelConfig c = ModelConfig::named("cs336-8b", 32768);
  ModelOptions o;
  o.bf16_pure = true;
  auto total = [&](const char* plan) {
    o.recompute = RecomputePlan::parse(plan);
    return plan_model_memory(c, 2, 32768, Device::cuda, DType::bf16, o).total_bytes();
  };
  // Parameters, gradients and both moments in bf16: 8 bytes a parameter.
  o.recompute = {};
  const MemoryPlan none = plan_model_memory(c, 2, 32768, Device::cuda, DType::bf16, o);
  EXPECT_EQ(none.items[0].bytes + none.items[1].bytes + none.items[2].bytes, 8 * c.parameter_count());
  EXPECT_GT(double(total("none")), 250 * kGiB);  // all activations of 34 blocks: far beyond one GPU
  EXPECT_LT(total("selective"), total("none"));
  EXPECT_LT(total("blocks:1"), total("selective"));
  EXPECT_LT(double(total("selective")), 135 * kGiB);  // fits an H200 (139 GiB)
  EXPECT_LT(total("blocks:1"), total("blocks:6"));    // a block's working set dwarfs its input
}

TEST(MemoryPlan, AutoPicksTheFastestPlanThatFitsAndRefusalNamesTheShortfall) {
  const ModelConfig c = ModelConfig::named("cs336-8b", 32768);
  ModelOptions o;
  o.bf16_pure = true;
  auto plan = [&](const char* name, int64_t available = -1) {
    o.recompute = RecomputePlan::parse(name);
    return plan_model_memory(c, 2, 32768, Device::cuda, DType::bf16, o, available);
  };
  const int64_t selective = plan("selective").total_bytes(), blocks1 = plan("blocks:1").total_bytes();
  // Room for everything: nothing is recomputed.
  EXPECT_EQ(plan("auto", int64_t(1) << 50).recompute.name(), "none");
  // Room for selective (with the headroom auto keeps) but not for none.
  MemoryPlan chosen = plan("auto", selective + selective / 16 + (int64_t(1) << 30));
  EXPECT_EQ(chosen.recompute.name(), "selective");
  EXPECT_NE(chosen.reason.find("none needs"), std::string::npos) << chosen.reason;
  // Between blocks:1 and selective.
  chosen = plan("auto", blocks1 + blocks1 / 16 + (int64_t(1) << 30));
  ASSERT_LT(blocks1 + blocks1 / 16 + (int64_t(1) << 30), selective);
  EXPECT_EQ(chosen.recompute.name(), "blocks:1");
  // Nothing fits: the plan with the least memory, and a refusal naming the numbers.
  chosen = plan("auto", int64_t(1) << 30);
  EXPECT_EQ(chosen.recompute.kind, RecomputePlan::Kind::blocks);
  EXPECT_LE(chosen.total_bytes(), blocks1);
  EXPECT_NE(chosen.reason.find("least memory"), std::string::npos) << chosen.reason;
  try {
    check_memory_plan(chosen, int64_t(1) << 30, "the GPU");
    FAIL() << "expected flashlm::OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the GPU has 1.00 GiB free"), std::string::npos) << m;
    EXPECT_NE(m.find("GiB short"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(check_memory_plan(chosen, chosen.total_bytes(), "the GPU"));
  EXPECT_NO_THROW(check_memory_plan(chosen, -1, "the GPU"));  // no limit known
}

// Under ZeRO-1 or FSDP a rank holds 1/world of the AdamW moments and the model none of its own: the plan
// counts that share, and the rest of the plan is unchanged. The xl model in bf16 on one of 2 GPUs.
TEST(MemoryPlan, ASharedOptimizerCountsThisRanksShareOfTheMoments) {
  const ModelConfig c = ModelConfig::named("xl", 512);
  ModelOptions o;
  const MemoryPlan whole = plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o);
  o.optimizer_shards = 2;
  const MemoryPlan half = plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o);
  ASSERT_EQ(whole.items.size(), half.items.size());
  int changed = 0;
  for (size_t i = 0; i < whole.items.size(); ++i) {
    if (whole.items[i].what.find("AdamW moments") == std::string::npos) {
      EXPECT_EQ(half.items[i].bytes, whole.items[i].bytes) << whole.items[i].what;
      continue;
    }
    ++changed;
    EXPECT_EQ(half.items[i].bytes, (c.parameter_count() + 1) / 2 * 8);
    EXPECT_NE(half.items[i].what.find("1/2"), std::string::npos) << half.items[i].what;
  }
  EXPECT_EQ(changed, 1);
  for (int64_t bad : {int64_t{0}, int64_t{-2}, (int64_t{1} << 20) + 1}) {
    o.optimizer_shards = bad;
    EXPECT_THROW(plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o), Error) << bad;
  }
}

// bf16 moments beside fp32 masters: the plan counts 4 bytes of moments per parameter (of this rank's share),
// named by their state, and nothing else changes; with bf16-pure the option is an error.
TEST(MemoryPlan, Bf16MomentsCountTwoBytesEach) {
  const ModelConfig c = ModelConfig::named("xl", 512);
  ModelOptions o;
  const MemoryPlan fp32 = plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o);
  for (const OptimizerState state : {OptimizerState::bf16, OptimizerState::bf16_sr}) {
    o.optimizer_state = state;
    const MemoryPlan bf16 = plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o);
    ASSERT_EQ(fp32.items.size(), bf16.items.size());
    for (size_t i = 0; i < fp32.items.size(); ++i) {
      if (fp32.items[i].what.find("AdamW moments") == std::string::npos) {
        EXPECT_EQ(bf16.items[i].bytes, fp32.items[i].bytes) << fp32.items[i].what;
        continue;
      }
      EXPECT_EQ(bf16.items[i].bytes, c.parameter_count() * 4);
      EXPECT_EQ(bf16.items[i].what, "AdamW moments (" + std::string(optimizer_state_name(state)) + ")");
    }
  }
  o.bf16_pure = true;
  EXPECT_THROW(plan_model_memory(c, 4, 512, Device::cuda, DType::bf16, o), Error);
}

// resolve_model_memory is the one "plan, resolve auto, write it back" step: the options it leaves hold the
// plan it returns, and on the CPU it plans against no limit.
TEST(MemoryPlan, ResolveWritesThePlansRecomputationBack) {
  ModelOptions o;
  o.recompute = RecomputePlan::parse("auto");
  int64_t available = 0;
  const MemoryPlan plan =
      resolve_model_memory(ModelConfig::named("tiny", 16), 1, 16, Device::cpu, DType::f32, o, available);
  EXPECT_EQ(available, -1);
  EXPECT_EQ(plan.recompute, RecomputePlan{});  // no limit known: nothing recomputed
  EXPECT_EQ(o.recompute, plan.recompute);
  EXPECT_EQ(plan.total_bytes(),
            plan_model_memory(ModelConfig::named("tiny", 16), 1, 16, Device::cpu, DType::f32, o).total_bytes());
}

TEST(MemoryPlan, BadRequestsAreErrors) {
  ModelOptions o;
  o.bf16_pure = true;
  EXPECT_THROW(plan_model_memory(ModelConfig::named("tiny"), 1, 16, Device::cpu, DType::f32, o), Error);
  EXPECT_THROW(CpuModel(ModelConfig::named("tiny"), 1, 16, o), Error);
  EXPECT_THROW(make_model(ModelConfig::named("tiny"), 1, 16, Device::cpu, DType::bf16, o), Error);
  o.bf16_pure = false;
  o.recompute = RecomputePlan::parse("auto");
  EXPECT_THROW(CpuModel(ModelConfig::named("tiny"), 1, 16, o), Error);  // auto is resolved by the plan first
  // A token count whose logits would overflow 64-bit byte counts.
  o.recompute = {};
  ModelConfig big = ModelConfig::named("tiny", 65536, (int64_t(1) << 31) - 1);
  EXPECT_THROW(plan_model_memory(big, int64_t(1) << 40, 65536, Device::cpu, DType::f32, o), Error);
}
