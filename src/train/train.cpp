// The training run: data in, train steps with evaluation and checkpoints, losses out. A checkpoint
// holds the parameters, AdamW's moments and step, and the data position, so that a run resumed from it
// continues bit-exactly (tested: 20 steps == 10 steps + resume + 10 steps).
#include "flashlm/train.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/bench.h"
#include "flashlm/data.h"
#include "flashlm/dist.h"

namespace flashlm {

namespace {

constexpr char kCheckpointMagic[8] = {'F', 'L', 'M', 'C', 'K', 'P', 'T', '1'};

nlohmann::json model_json(const ModelConfig& c) {
  return {{"vocab", c.vocab},   {"context", c.context}, {"d_model", c.d_model},         {"d_ff", c.d_ff},
          {"layers", c.layers}, {"heads", c.heads},     {"rope_theta", c.rope_theta}, {"norm_eps", c.norm_eps}};
}

struct Checkpoint {
  nlohmann::json meta;
  std::vector<float> params, m, v;
};

// The header and the three arrays (parameters, first and second moments), written beside `path` and renamed
// over it: a run killed mid-write leaves the previous checkpoint.
void write_checkpoint_file(const std::string& path, const nlohmann::json& meta, const std::vector<float>& params,
                           const std::vector<float>& m, const std::vector<float>& v) {
  const std::string text = meta.dump();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    FLASHLM_CHECK(bool(out), "checkpoint: cannot open '{}' for writing", tmp);
    const uint64_t len = text.size();
    out.write(kCheckpointMagic, sizeof kCheckpointMagic);
    out.write(reinterpret_cast<const char*>(&len), sizeof len);
    out.write(text.data(), std::streamsize(len));
    for (const std::vector<float>* a : {&params, &m, &v}) {
      out.write(reinterpret_cast<const char*>(a->data()), std::streamsize(a->size() * sizeof(float)));
    }
    FLASHLM_CHECK(bool(out), "checkpoint: failed writing '{}'", tmp);
  }
  FLASHLM_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint: cannot rename '{}' to '{}'", tmp, path);
}

// Rank r's file of a sharded checkpoint at `path` written by `world` ranks.
std::string shard_path(const std::string& path, int rank, int world) {
  return fmt::format("{}.rank{}-of-{}", path, rank, world);
}

// Collective under data parallelism (ZeRO-1 gathers the moments); rank 0 writes. Sharded (FSDP): every rank
// writes its own shard file, nothing is gathered.
void write_checkpoint(const std::string& path, const LanguageModel& model, DdpModel* dp, const TrainConfig& cfg,
                      int64_t next_step, const BatcherState& batcher) {
  const auto n = size_t(cfg.sharded_checkpoint ? dp->zero()->shard_elements() : model.parameter_count());
  std::vector<float> params(n), m(n), v(n);
  if (cfg.sharded_checkpoint) {
    dp->save_shard(params.data(), m.data(), v.data());
  } else {
    if (dp) dp->gather_master_parameters();  // ZeRO-1 in bf16/fp16 gathers only the working weights per step
    model.save_state(params.data(), m.data(), v.data());
    if (dp && dp->zero()) dp->zero()->gather_state(m.data(), v.data());
    if (cfg.comm && !cfg.comm->is_root()) return;
  }
  nlohmann::json meta = {{"model", model_json(model.config())},
                               {"batch", cfg.batch},
                               {"seq", cfg.seq},
                               {"next_step", next_step},
                               {"optimizer_steps", dp ? dp->optimizer_steps() : model.optimizer_steps()},
                               {"seed", cfg.seed},
                               {"train_data", cfg.train_data},
                               {"batcher_seed", batcher.seed},
                               {"batcher_step", batcher.step},
                               {"parameter_count", model.parameter_count()},
                               {"precision", std::string(dtype_name(model.precision()))},
                               {"loss_scale", model.loss_scale()},
                               {"world_size", cfg.comm ? cfg.comm->world_size() : 1},
                               {"grad_accum", cfg.ddp.grad_accum}};
  if (!cfg.sharded_checkpoint) return write_checkpoint_file(path, meta, params, m, v);
  // This rank's parts of the masters and moments, packed in the order of ZeroOptimizer::updated_ranges().
  meta["shard_rank"] = cfg.comm->rank();
  meta["shard_elements"] = int64_t(n);
  write_checkpoint_file(shard_path(path, cfg.comm->rank(), cfg.comm->world_size()), meta, params, m, v);
}

Checkpoint read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FLASHLM_CHECK(bool(in), "checkpoint: cannot open '{}'", path);
  char magic[8] = {};
  uint64_t len = 0;
  in.read(magic, sizeof magic);
  in.read(reinterpret_cast<char*>(&len), sizeof len);
  FLASHLM_CHECK(in && std::equal(magic, magic + 8, kCheckpointMagic) && len < (1u << 20),
                "checkpoint: '{}' is not a flashlm checkpoint", path);
  std::string text(len, '\0');
  in.read(text.data(), std::streamsize(len));
  Checkpoint ck;
  try {
    ck.meta = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint: '{}' has a corrupt header: {}", path, e.what());
  }
  // A shard file holds this rank's elements only.
  const int64_t n = ck.meta.value("shard_elements", ck.meta.at("parameter_count").get<int64_t>());
  FLASHLM_CHECK(n >= 0 && n <= ck.meta.at("parameter_count").get<int64_t>(), "checkpoint: '{}' has a corrupt header",
                path);
  for (auto* v : {&ck.params, &ck.m, &ck.v}) {
    v->resize(size_t(n));
    in.read(reinterpret_cast<char*>(v->data()), std::streamsize(n * int64_t(sizeof(float))));
  }
  FLASHLM_CHECK(bool(in), "checkpoint: '{}' is truncated", path);
  return ck;
}

// The token sources of a run: the training sequence and the validation sequence.
struct DataSources {
  std::unique_ptr<SyntheticTokens> synthetic;
  std::optional<TokenFile> train_file, val_file;
  std::span<const uint16_t> train, val;
  std::string train_name, val_name;
  double best_possible_loss = 0;
};

DataSources open_data(const TrainConfig& cfg) {
  DataSources d;
  if (cfg.train_data == "synthetic") {
    d.synthetic = std::make_unique<SyntheticTokens>(cfg.model.vocab, int64_t{1} << 20, cfg.seed);
    d.train = d.synthetic->tokens();
    d.train_name = "synthetic";
    d.best_possible_loss = d.synthetic->optimal_cross_entropy();
  } else {
    d.train_file.emplace(cfg.train_data, cfg.model.vocab);
    d.train = d.train_file->tokens();
    d.train_name = cfg.train_data;
  }
  if (!cfg.val_data.empty()) {
    d.val_file.emplace(cfg.val_data, cfg.model.vocab);
    d.val = d.val_file->tokens();
    d.val_name = cfg.val_data;
  } else {
    // Hold out the last 10% of the training tokens.
    const size_t split = d.train.size() - d.train.size() / 10;
    d.val = d.train.subspan(split);
    d.train = d.train.subspan(0, split);
    d.val_name = d.train_name + " (last 10%)";
  }
  return d;
}

// Parameters from the host into the model, leaving its optimizer state alone (ZeRO-1 keeps its own).
void load_parameters(LanguageModel& model, const float* host) {
  const size_t bytes = size_t(model.parameter_count()) * sizeof(float);
  model.synchronize();
  if (model.device() == Device::cpu) std::memcpy(model.parameters(), host, bytes);
  else cuda_copy(model.parameters(), host, bytes);
  model.parameters_changed();
  model.synchronize();
}

double evaluate(LanguageModel& model, TokenBatcher& val, int64_t batches, std::span<int32_t> x, std::span<int32_t> y) {
  val.restore({0, 0});  // every evaluation scores the same tokens
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    val.next(x, y);
    total += model.forward(x.data(), y.data());
  }
  return total / double(batches);
}

}  // namespace

TrainResult train(const TrainConfig& cfg) {
  cfg.model.validate();
  FLASHLM_CHECK(cfg.steps >= 1, "train: steps = {}, expected at least 1", cfg.steps);
  FLASHLM_CHECK(!cfg.resume || !cfg.checkpoint.empty(), "train: --resume needs --checkpoint PATH");
  FLASHLM_CHECK(cfg.eval_batches >= 1, "train: eval_batches = {}, expected at least 1", cfg.eval_batches);
  FLASHLM_CHECK(cfg.comm || (cfg.ddp.grad_accum == 1 && !cfg.zero1),
                "train: gradient accumulation and ZeRO-1 run through the data-parallel layer: they need a communicator");
  FLASHLM_CHECK(cfg.ddp.grad_accum >= 1, "train: grad_accum = {}, expected at least 1", cfg.ddp.grad_accum);
  FLASHLM_CHECK(!cfg.sharded_checkpoint || (cfg.comm && cfg.ddp.variant == DdpVariant::fsdp),
                "train: sharded checkpoints are FSDP's: they need --ddp fsdp");
  FLASHLM_CHECK(!cfg.sharded_checkpoint || !cfg.checkpoint.empty(), "train: a sharded checkpoint needs --checkpoint PATH");
  const bool root = !cfg.comm || cfg.comm->is_root();
  const int world = cfg.comm ? cfg.comm->world_size() : 1;
  const int64_t accum = cfg.ddp.grad_accum;
  DataSources data = open_data(cfg);
  TokenBatcher train_batches(data.train, data.train_name, cfg.batch, cfg.seq, BatchOrder::random, cfg.seed);
  TokenBatcher val_batches(data.val, data.val_name, cfg.batch, cfg.seq, BatchOrder::sequential);
  if (cfg.comm) train_batches.select_shard(cfg.comm->rank(), world);
  // Under mpirun each rank takes its own GPU before the model is placed on it.
  if (cfg.comm && cfg.device == Device::cuda) cfg.comm->setup_cuda();

  const std::unique_ptr<LanguageModel> model_ptr =
      make_model(cfg.model, cfg.batch, cfg.seq, cfg.device, cfg.precision, cfg.attention);
  LanguageModel& model = *model_ptr;
  model.init_parameters(cfg.seed);
  std::unique_ptr<DdpModel> dp;
  if (cfg.comm) dp = std::make_unique<DdpModel>(*cfg.comm, model, cfg.batch * cfg.seq, cfg.ddp, cfg.zero1);
  TrainResult result;
  result.best_possible_loss = data.best_possible_loss;
  auto say = [&](const std::string& line) {
    if (cfg.progress && root) cfg.progress(line);
  };

  int64_t step = 0;
  bool resumed_from_shards = false;
  if (cfg.resume) {
    const Checkpoint ck =
        read_checkpoint(cfg.sharded_checkpoint ? shard_path(cfg.checkpoint, cfg.comm->rank(), world) : cfg.checkpoint);
    FLASHLM_CHECK(ck.meta.at("model") == model_json(cfg.model),
                  "train: checkpoint '{}' holds a different model ({}) than configured ({})", cfg.checkpoint,
                  ck.meta.at("model").dump(), model_json(cfg.model).dump());
    FLASHLM_CHECK(ck.meta.at("seq") == cfg.seq, "train: checkpoint '{}' was written with seq {}, not {}",
                  cfg.checkpoint, ck.meta.at("seq").dump(), cfg.seq);
    FLASHLM_CHECK(ck.meta.value("precision", "fp32") == dtype_name(cfg.precision),
                  "train: checkpoint '{}' was trained in {}, not {}", cfg.checkpoint, ck.meta.value("precision", "fp32"),
                  dtype_name(cfg.precision));
    // The checkpoint holds the whole state (gathered from ZeRO's and FSDP's shards), so any world size may
    // continue it, as long as the ranks together read the same data: the same global batch (batch x ranks)
    // in the same micro-batches. The same world size and batch continue bit-exactly.
    const int64_t ck_world = ck.meta.value("world_size", int64_t{1}), ck_batch = ck.meta.at("batch").get<int64_t>();
    const int64_t ck_accum = ck.meta.value("grad_accum", int64_t{1});
    FLASHLM_CHECK(ck_world * ck_batch == int64_t(world) * cfg.batch && ck_accum == accum,
                  "train: checkpoint '{}' was written by {} rank(s) with grad_accum {}, not {} with {}, and a global "
                  "batch of {} x {} sequences, not {} x {}: another world size must keep the global batch and "
                  "grad_accum",
                  cfg.checkpoint, ck_world, ck_accum, world, accum, ck_world, ck_batch, world, cfg.batch);
    const int64_t optimizer_steps = ck.meta.at("optimizer_steps").get<int64_t>();
    if (cfg.sharded_checkpoint) {
      // Every rank its own file, of the same step, written by as many ranks with this rank's shard layout.
      FLASHLM_CHECK(ck.meta.value("shard_rank", -1) == cfg.comm->rank() && ck_world == world &&
                        ck.meta.at("shard_elements").get<int64_t>() == dp->zero()->shard_elements(),
                    "train: '{}' is not rank {}'s shard of {} ranks with {} elements", cfg.checkpoint,
                    cfg.comm->rank(), world, dp->zero()->shard_elements());
      cfg.comm->agree(ck.meta.at("next_step").get<int64_t>(), "the step of the sharded checkpoint's files");
      dp->load_shard(ck.params.data(), ck.m.data(), ck.v.data(), optimizer_steps);
      resumed_from_shards = true;
    } else if (dp && dp->zero()) {
      load_parameters(model, ck.params.data());
      dp->zero()->load_state(ck.m.data(), ck.v.data(), optimizer_steps);
    } else {
      model.load_state(ck.params.data(), ck.m.data(), ck.v.data(), optimizer_steps);
    }
    train_batches.restore({ck.meta.at("batcher_seed").get<uint64_t>(), ck.meta.at("batcher_step").get<int64_t>()});
    step = ck.meta.at("next_step").get<int64_t>();
    say(fmt::format("resumed from {} at step {}", cfg.checkpoint, step));
  }
  result.first_step = step;
  say(fmt::format("model: {} parameters ({} layers, d_model {}, heads {}) on {} in {}; data: {} ({} train tokens); "
                  "batch {} x {} tokens{}",
                  model.parameter_count(), cfg.model.layers, cfg.model.d_model, cfg.model.heads,
                  device_name(cfg.device), dtype_name(cfg.precision), data.train_name,
                  data.train.size(), cfg.batch, cfg.seq,
                  data.best_possible_loss > 0 ? fmt::format("; best possible loss {:.4f}", data.best_possible_loss)
                                              : std::string()));
  if (dp) {
    if (!resumed_from_shards) dp->broadcast_parameters();
    const DataParallel& ddp = dp->data_parallel();
    constexpr double kMiB = 1024.0 * 1024.0;
    say(fmt::format("data parallel: {} rank(s) x {} sequences x grad_accum {}; DDP {} ({} {} {}(s) per "
                    "step{}{}{}){}",
                    world, cfg.batch, accum, ddp_variant_name(cfg.ddp.variant), ddp.buckets().size(),
                    dtype_name(cfg.ddp.reduce_dtype), dp->gradient_sync(),
                    cfg.ddp.variant == DdpVariant::bucketed ? fmt::format(", buckets of {} MB", cfg.ddp.bucket_mb)
                    : dp->fsdp() ? fmt::format(", {} parts gathered, prefetch {}", dp->fsdp()->units(),
                                               cfg.ddp.fsdp_prefetch)
                                 : "",
                    ddp.staging_bytes() > 0 ? fmt::format(", {:.1f} MiB of staging", double(ddp.staging_bytes()) / kMiB)
                                            : "",
                    cfg.comm->nccl_max_ctas() > 0 ? fmt::format(", NCCL max CTAs {}", cfg.comm->nccl_max_ctas()) : "",
                    dp->fsdp() ? fmt::format("; FSDP keeps {:.1f} MiB of parameters, {:.1f} of gradients and {:.1f} "
                                             "of AdamW state per rank",
                                             double(dp->memory().parameters) / kMiB,
                                             double(dp->memory().gradients) / kMiB,
                                             double(dp->memory().optimizer_state) / kMiB)
                    : dp->zero() ? fmt::format("; ZeRO-1: {:.1f} MiB of AdamW state per rank",
                                               double(dp->zero()->state_bytes()) / kMiB)
                                 : ""));
  }

  // accum micro-batches of batch rows; evaluation reads the first.
  std::vector<int32_t> x(size_t(accum * cfg.batch * cfg.seq)), y(x.size());
  const size_t micro = size_t(cfg.batch * cfg.seq);
  auto t_log = std::chrono::steady_clock::now();
  int64_t tokens_since_log = 0, skipped = 0;
  const double flops_per_token = train_flops_per_token(cfg.model, cfg.seq);
  for (; step < cfg.steps; ++step) {
    for (int64_t k = 0; k < accum; ++k) {
      train_batches.next(std::span(x).subspan(k * micro, micro), std::span(y).subspan(k * micro, micro));
    }
    const double lr = cosine_lr(cfg.optimizer, step);
    double loss = 0, norm = 0;
    bool stepped = true;
    if (dp) {
      loss = dp->forward_backward(x, y);
      cfg.comm->all_reduce(std::span<double>(&loss, 1), ReduceOp::avg);  // the global batch's loss
      stepped = dp->optimizer_step(cfg.optimizer, lr, &norm);
    } else {
      model.zero_grad();
      loss = model.forward(x.data(), y.data());
      model.backward();
      stepped = optimizer_step(model, cfg.optimizer, lr, &norm);
    }
    if (!stepped) ++skipped;  // fp16 overflow: no update, the loss scale was halved
    result.train_loss.emplace_back(step, loss);
    tokens_since_log += int64_t(world) * accum * cfg.batch * cfg.seq;

    const bool last = step + 1 == cfg.steps;
    if ((cfg.log_every > 0 && (step + 1) % cfg.log_every == 0) || last || step == result.first_step) {
      model.synchronize();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_log).count();
      const double tok_s = double(tokens_since_log) / std::max(secs, 1e-9);
      std::string line = fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s",
                                     step + 1, cfg.steps, loss, lr, norm, tok_s);
      if (cfg.device == Device::cuda) {
        line += fmt::format(" | MFU {:.1f}%", 100.0 * tok_s * flops_per_token / kHopperBf16PeakFlops);
      }
      if (cfg.precision == DType::f16) {
        line += fmt::format(" | loss scale {:.0f}, {} skipped", model.loss_scale(), skipped);
      }
      say(line);
      t_log = std::chrono::steady_clock::now();
      tokens_since_log = 0;
    }
    // The ranks hold the same parameters (FSDP gathers them for it): rank 0 evaluates for all.
    const bool evaluate_now = (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last;
    if (evaluate_now && dp) dp->gather_parameters();
    if (root && evaluate_now) {
      std::span<int32_t> vx(x.data(), micro), vy(y.data(), micro);
      const double val = evaluate(model, val_batches, cfg.eval_batches, vx, vy);
      result.val_loss.emplace_back(step + 1, val);
      say(fmt::format("step {:>6}/{} | val loss {:.4f}", step + 1, cfg.steps, val));
    }
    if (!cfg.checkpoint.empty() && ((cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0) || last)) {
      write_checkpoint(cfg.checkpoint, model, dp.get(), cfg, step + 1, train_batches.state());
      say(fmt::format("step {:>6}/{} | checkpoint {}", step + 1, cfg.steps, cfg.checkpoint));
    }
  }
  result.last_step = step;
  return result;
}

std::vector<float> checkpoint_parameters(const std::string& path) { return read_checkpoint(path).params; }

}  // namespace flashlm
