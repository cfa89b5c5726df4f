// The training run: data in, train steps with evaluation and checkpoints, losses out. A checkpoint
// holds the parameters, AdamW's moments and step, and the data position, so that a run resumed from it
// continues bit-exactly (tested: 20 steps == 10 steps + resume + 10 steps).
#include "flashlm/train.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/bench.h"
#include "flashlm/data.h"
#include "flashlm/ddp_model.h"
#include "flashlm/dist.h"
#include "flashlm/safetensors.h"
#include "train/checkpoint.h"

namespace flashlm {

namespace {

// The fields of a checkpoint this run would write, but for the progress ones (next_step, optimizer_steps,
// the batcher's position, the loss scale), which write_run_checkpoint fills in.
CheckpointHeader run_header(const TrainConfig& cfg, const LanguageModel& model, DataIdentity train_data) {
  CheckpointHeader h;
  h.model = model.config();
  h.batch = cfg.batch;
  h.seq = cfg.seq;
  h.seed = cfg.seed;
  h.train_data = std::move(train_data);
  h.batcher.seed = cfg.seed;
  h.parameter_count = model.parameter_count();
  h.precision = model.precision();
  h.bf16_pure = model.bf16_pure();
  h.optimizer_state = model.optimizer_state();
  h.world_size = cfg.comm ? cfg.comm->world_size() : 1;
  h.grad_accum = cfg.ddp.grad_accum;
  return h;
}

// Rank r's file of a sharded checkpoint at `path` written by `world` ranks.
std::string shard_path(const std::string& path, int rank, int world) {
  return fmt::format("{}.rank{}-of-{}", path, rank, world);
}

// Collective under data parallelism (ZeRO-1 gathers the moments); rank 0 writes. Sharded (FSDP): every rank
// writes its own shard file, nothing is gathered.
void write_run_checkpoint(const std::string& path, const LanguageModel& model, DdpModel* dp, const TrainConfig& cfg,
                          CheckpointHeader header, int64_t next_step, const BatcherState& batcher) {
  if (cfg.sharded_checkpoint) {
    header.shard_rank = cfg.comm->rank();
    header.shard_elements = dp->zero()->shard_elements();
  }
  const auto n = size_t(header.payload_elements());
  std::vector<float> params(n), m(n), v(n);
  if (cfg.sharded_checkpoint) {
    dp->save_shard(params.data(), m.data(), v.data());
  } else {
    if (dp && dp->sharded_storage()) {
      dp->save_parameters(*cfg.comm, params.data());  // FSDP's shards gathered on the host
    } else {
      if (dp) dp->gather_master_parameters();  // ZeRO-1 in bf16/fp16 gathers only the working weights per step
      model.save_state(params, m, v);
    }
    if (dp && dp->zero()) dp->zero()->gather_state(m.data(), v.data());
    if (cfg.comm && !cfg.comm->is_root()) return;
  }
  header.next_step = next_step;
  header.optimizer_steps = dp ? dp->optimizer_steps() : model.optimizer_steps();
  header.batcher = batcher;
  header.loss_scale = model.loss_scale();
  header.loss_scale_good_steps = model.loss_scale_good_steps();
  write_checkpoint(cfg.sharded_checkpoint ? shard_path(path, cfg.comm->rank(), cfg.comm->world_size()) : path, header,
                   params, m, v);
}

// Before step 1, so that a path that cannot be written fails now rather than when the first checkpoint is due.
// Rank 0 alone writes checkpoints (sharded: every rank its own); the others learn its verdict, so that every
// rank stops together.
CheckpointLock check_run_checkpoint_writable(const TrainConfig& cfg) {
  std::string error;
  CheckpointLock lock;
  if (!cfg.comm || cfg.comm->is_root() || cfg.sharded_checkpoint) {
    try {
      lock = check_checkpoint_writable(cfg.sharded_checkpoint
                                    ? shard_path(cfg.checkpoint, cfg.comm->rank(), cfg.comm->world_size())
                                    : cfg.checkpoint);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  double failed = error.empty() ? 0 : 1;
  if (cfg.comm) cfg.comm->all_reduce(std::span<double>(&failed, 1), ReduceOp::max);
  if (!error.empty()) throw Error(error);
  FLASHLM_CHECK(failed == 0, "train: rank 0 cannot write the checkpoint '{}' (its error is in rank 0's output)",
                cfg.checkpoint);
  return lock;
}

// The token sources of a run: the training sequence and the validation sequence.
struct DataSources {
  std::unique_ptr<SyntheticTokens> synthetic;
  std::unique_ptr<TokenFile> train_file, val_file;  // on the heap: the views refer to them, and DataSources moves
  TokenView train, val;
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
    d.train_file = std::make_unique<TokenFile>(cfg.train_data, cfg.model.vocab);
    d.train = *d.train_file;
    d.train_name = cfg.train_data;
  }
  if (!cfg.val_data.empty()) {
    d.val_file = std::make_unique<TokenFile>(cfg.val_data, cfg.model.vocab);
    d.val = *d.val_file;
    d.val_name = cfg.val_data;
  } else {
    // Hold out the last 10% of the training tokens.
    const int64_t split = d.train.size() - d.train.size() / 10;
    d.val = d.train.subview(split, d.train.size() - split);
    d.train = d.train.subview(0, split);
    d.val_name = d.train_name + " (last 10%)";
  }
  return d;
}

// What every rank of a data-parallel run must agree on (Communicator::agree_settings): whatever decides
// which collectives a rank calls and how large they are, or what the ranks compute together. Rank-local,
// and left out: the paths (a node may read its own copy of the data and of the checkpoint to resume from;
// rank 0 alone writes), what rank 0 alone does (evaluation, progress lines), and the CPU threads.
std::vector<RunSetting> run_settings(const TrainConfig& cfg, const DataSources& data, const Communicator& comm) {
  std::vector<RunSetting> out;
  auto add = [&out](std::string name, const auto& value) { out.push_back({std::move(name), fmt::format("{}", value)}); };
  const ModelConfig& mc = cfg.model;
  add("model.vocab", mc.vocab);
  add("model.context", mc.context);
  add("model.d_model", mc.d_model);
  add("model.d_ff", mc.d_ff);
  add("model.layers", mc.layers);
  add("model.heads", mc.heads);
  add("model.rope_theta", mc.rope_theta);
  add("model.norm_eps", mc.norm_eps);
  add("batch", cfg.batch);
  add("seq", cfg.seq);
  add("steps", cfg.steps);
  const AdamWConfig& o = cfg.optimizer;
  add("optimizer.lr_max", o.lr_max);
  add("optimizer.lr_min", o.lr_min);
  add("optimizer.warmup_steps", o.warmup_steps);
  add("optimizer.cosine_steps", o.cosine_steps);
  add("optimizer.beta1", o.beta1);
  add("optimizer.beta2", o.beta2);
  add("optimizer.eps", o.eps);
  add("optimizer.weight_decay", o.weight_decay);
  add("optimizer.max_grad_norm", o.max_grad_norm);
  // The same kind and amount of training data (each rank reads its shard of it); not its path.
  add("train_data", data.synthetic ? "synthetic" : "a token file");
  add("train_tokens", data.train.size());
  add("checkpoint", cfg.checkpoint.empty() ? "none" : "a file");  // writing one is collective
  add("checkpoint_every", cfg.checkpoint_every);
  add("resume", cfg.resume);
  add("init", cfg.init.empty() ? "none" : "a file");  // rank 0's weights are broadcast; all must mean to start from one
  add("seed", cfg.seed);
  add("attention", attention_impl_name(cfg.options.attention));
  add("device", device_name(cfg.device));
  add("precision", dtype_name(cfg.precision));
  // Only when on: the shards of runs without FP8, written before it existed, hold no such setting.
  if (cfg.options.fp8) add("fp8", std::string(fp8_format_name(cfg.options.fp8_gradients)) + " gradients");
  // Only when rowwise, for the same reason: tensorwise runs' shards predate the recipe.
  if (cfg.options.fp8 && cfg.options.fp8_recipe != Fp8Recipe::tensorwise) {
    add("fp8_recipe", fp8_recipe_name(cfg.options.fp8_recipe));
  }
  add("ddp.variant", ddp_variant_name(cfg.ddp.variant));
  add("ddp.bucket_mb", cfg.ddp.bucket_mb);
  add("ddp.grad_accum", cfg.ddp.grad_accum);
  add("ddp.reduce_dtype", dtype_name(cfg.ddp.reduce_dtype));
  add("ddp.gemm_sm_reserve", cfg.ddp.gemm_sm_reserve);
  add("ddp.reduce_scatter", cfg.ddp.reduce_scatter);
  add("ddp.fsdp_prefetch", cfg.ddp.fsdp_prefetch);
  add("ddp.fsdp_poison_freed", cfg.ddp.fsdp_poison_freed);
  add("sharded_checkpoint", cfg.sharded_checkpoint);  // each rank writes its shard
  add("zero1", cfg.zero1);
  add("nccl_max_ctas", comm.nccl_max_ctas());
  return out;
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

// "1:02:03", or "2:03" under an hour.
std::string clock_time(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60) : fmt::format("{}:{:02}", s / 60, s % 60);
}

// --log: one JSON object per line, flushed as written, so that a run that dies keeps its metrics so far.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path) : path_(path) {
    if (path.empty()) return;
    out_.open(path, std::ios::out | std::ios::trunc);
    FLASHLM_CHECK(out_.good(), "train: cannot open the metrics log '{}' for writing", path);
  }
  void write(const nlohmann::json& record) {
    if (path_.empty()) return;
    out_ << record.dump() << '\n' << std::flush;
    FLASHLM_CHECK(out_.good(), "train: failed writing the metrics log '{}'", path_);
  }

 private:
  std::string path_;
  std::ofstream out_;
};

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
  FLASHLM_CHECK_ARG(!cfg.sharded_checkpoint || (cfg.comm && cfg.ddp.variant == DdpVariant::fsdp),
                    "train: sharded checkpoints are FSDP's: they need --ddp fsdp");
  FLASHLM_CHECK_ARG(!cfg.sharded_checkpoint || !cfg.checkpoint.empty(),
                    "train: a sharded checkpoint needs --checkpoint PATH");
  FLASHLM_CHECK_ARG(!(cfg.loss_scale_init > 0) || cfg.precision == DType::f16,
                    "train: loss_scale_init (--loss-scale-init) needs fp16, not {}", dtype_name(cfg.precision));
  check_sharded_optimizer_state(cfg.options.optimizer_state, cfg.zero1,
                                cfg.comm && cfg.ddp.variant == DdpVariant::fsdp);
  if (cfg.comm) check_data_parallel_grad_dtype(cfg.options.grad_dtype);
  const bool root = !cfg.comm || cfg.comm->is_root();
  const int world = cfg.comm ? cfg.comm->world_size() : 1;
  const int64_t accum = cfg.ddp.grad_accum;
  DataSources data = open_data(cfg);
  // Before anything else the ranks do together: ranks started with other settings would call other
  // collectives (and hang) or silently train something else.
  const std::vector<RunSetting> settings = cfg.comm ? run_settings(cfg, data, *cfg.comm) : std::vector<RunSetting>{};
  if (cfg.comm) cfg.comm->agree_settings(settings);
  TokenBatcher train_batches(data.train, data.train_name, cfg.batch, cfg.seq, BatchOrder::random, cfg.seed);
  TokenBatcher val_batches(data.val, data.val_name, cfg.batch, cfg.seq, BatchOrder::sequential);
  if (cfg.comm) train_batches.select_shard(cfg.comm->rank(), world);
  // Under mpirun each rank takes its own GPU before the model is placed on it.
  if (cfg.comm && cfg.device == Device::cuda) cfg.comm->setup_cuda();

  auto say = [&](const std::string& line) {
    if (cfg.progress && root) cfg.progress(line);
  };
  ModelOptions options = cfg.options;
  options.moment_rounding_seed = cfg.seed;
  // ZeRO-1 and FSDP keep this rank's shard of the moments, not the model (DdpModel releases its own).
  if (cfg.comm && (cfg.zero1 || cfg.ddp.variant == DdpVariant::fsdp)) options.optimizer_shards = world;
  // FSDP: the model allocates no flat parameters or gradients; this rank's shards and the gathered parts'
  // pool hold them (flashlm/fsdp.h), which the plan counts.
  const bool sharded = cfg.comm && cfg.ddp.variant == DdpVariant::fsdp;
  if (sharded) {
    options.external_parameters = true;
    options.fsdp_world = world;
    options.fsdp_prefetch = cfg.ddp.fsdp_prefetch;
    options.fsdp_grad_accum = cfg.ddp.grad_accum;
  }
  // bf16-pure under data parallelism: FSDP's bf16 shards are its parameters; DDP and ZeRO-1 reduce and update
  // the fp32 masters that bf16-pure does not keep.
  FLASHLM_CHECK(!cfg.options.bf16_pure || !cfg.comm || sharded,
                "train: bf16-pure keeps no fp32 masters for DDP or ZeRO-1 to reduce and update: use --ddp fsdp (bf16 "
                "shards), or --precision bf16");
  // The memory plan, printed before anything is allocated and refused when it cannot fit.
  int64_t available = -1;
  const MemoryPlan plan =
      resolve_model_memory(cfg.model, cfg.batch, cfg.seq, cfg.device, cfg.precision, options, available);
  say(fmt::format("memory plan (recompute {}):\n{}", plan.recompute.name(), plan.format()));
  check_memory_plan(plan, available, "the GPU");
  const std::unique_ptr<LanguageModel> model_ptr =
      make_model(cfg.model, cfg.batch, cfg.seq, cfg.device, cfg.precision, options);
  LanguageModel& model = *model_ptr;
  if (!sharded) model.init_parameters(cfg.seed);
  // A resumed run then takes the checkpoint's scale instead.
  if (cfg.loss_scale_init > 0) model.restore_loss_scale(cfg.loss_scale_init, 0);
  std::unique_ptr<DdpModel> dp;
  if (cfg.comm) dp = std::make_unique<DdpModel>(*cfg.comm, model, cfg.batch * cfg.seq, cfg.ddp, cfg.zero1);
  if (sharded) dp->init_parameters(cfg.seed);  // the single process's values, each rank keeping its shard
  TrainResult result;
  result.best_possible_loss = data.best_possible_loss;

  CheckpointHeader header = run_header(cfg, model, data_identity(cfg.train_data, data.train));
  // A shard records the run's settings, but for whether the run was resumed: 3 steps, a resume and 3 more
  // write the files that 6 steps write.
  if (cfg.sharded_checkpoint) {
    for (const RunSetting& s : settings)
      if (s.name != "resume") header.run_settings.push_back(s);
  }
  int64_t step = 0;
  bool resumed_from_shards = false;
  if (cfg.resume) {
    const std::string path =
        cfg.sharded_checkpoint ? shard_path(cfg.checkpoint, cfg.comm->rank(), world) : cfg.checkpoint;
    const CheckpointReader ck(path);
    check_resumable(path, ck.header(), header);
    const size_t n = size_t(ck.header().payload_elements());
    std::vector<float> params(n), m(n), v(n);
    ck.read_payload(params, m, v);
    const int64_t optimizer_steps = ck.header().optimizer_steps;
    if (cfg.sharded_checkpoint) {
      // Every rank its own file, of the same step, written by as many ranks with this rank's shard layout.
      FLASHLM_CHECK(ck.header().shard_rank == cfg.comm->rank() && ck.header().world_size == world &&
                        ck.header().shard_elements == dp->zero()->shard_elements(),
                    "train: '{}' is not rank {}'s shard of {} ranks with {} elements", path, cfg.comm->rank(), world,
                    dp->zero()->shard_elements());
      cfg.comm->agree(ck.header().next_step, "the step of the sharded checkpoint's files");
      // One run's shards were written together and record the same settings, also those a resume may change.
      try {
        cfg.comm->agree_settings(ck.header().run_settings);
      } catch (const SettingsMismatch& e) {
        fail("train: the files of the sharded checkpoint '{}' are not of one run: {}", cfg.checkpoint, e.what());
      }
      dp->load_shard(params.data(), m.data(), v.data(), optimizer_steps);
      resumed_from_shards = true;
    } else if (ck.header().shard_rank >= 0) {
      fail("train: '{}' is one rank's shard of a sharded checkpoint: resume it with --sharded-checkpoint", path);
    } else if (dp && dp->zero()) {
      if (dp->sharded_storage()) dp->load_parameters(params.data());
      else load_parameters(model, params.data());
      dp->zero()->load_state(m.data(), v.data(), optimizer_steps);
    } else {
      model.load_state(params, m, v, optimizer_steps);
    }
    model.restore_loss_scale(ck.header().loss_scale, ck.header().loss_scale_good_steps);
    train_batches.restore(ck.header().batcher);
    step = ck.header().next_step;
    say(fmt::format("resumed from {} at step {}", cfg.checkpoint, step));
  }
  // Each rank read its own copy of the checkpoint: copies of different runs would run different steps.
  if (cfg.comm) cfg.comm->agree(step, "the step resumed at");
  if (!cfg.init.empty()) {
    FLASHLM_CHECK(!cfg.resume, "train: --init and --resume both give the parameters: use one");
    std::vector<float> params(size_t(model.parameter_count()));
    SafetensorsFile(cfg.init).read_parameters(cfg.model, params);
    if (dp && dp->sharded_storage()) {
      dp->load_parameters(params.data());
    } else if (model.bf16_pure()) {  // no fp32 masters to copy into: the weights go in as a fresh optimizer state
      const std::vector<float> zeros(params.size(), 0.0f);
      model.load_state(params, zeros, zeros, 0);
    } else {
      load_parameters(model, params.data());
    }
    say(fmt::format("initialised from {}", cfg.init));
  }
  const CheckpointLock checkpoint_lock =
      cfg.checkpoint.empty() ? CheckpointLock() : check_run_checkpoint_writable(cfg);
  MetricsLog metrics(root ? cfg.metrics_log : std::string());
  result.first_step = step;
  say(fmt::format("model: {} parameters ({} layers, d_model {}, heads {}) on {} in {}{}{}; data: {} ({} train tokens); "
                  "batch {} x {} tokens{}",
                  model.parameter_count(), cfg.model.layers, cfg.model.d_model, cfg.model.heads,
                  device_name(cfg.device), precision_name(cfg.precision, cfg.options.bf16_pure, cfg.options.fp8),
                  cfg.options.fp8 ? fmt::format(" ({}, {} gradients)", fp8_recipe_name(cfg.options.fp8_recipe),
                                                fp8_format_name(cfg.options.fp8_gradients))
                                  : std::string(),
                  cfg.options.optimizer_state == OptimizerState::fp32
                      ? std::string()
                      : fmt::format(" with {} AdamW moments", optimizer_state_name(cfg.options.optimizer_state)),
                  data.train_name,
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
                    : dp->fsdp() ? fmt::format(", {} parts gathered{}, prefetch {}", dp->fsdp()->units(),
                                               dp->fsdp()->fp8_units() > 0
                                                   ? fmt::format(" ({} as FP8 bytes)", dp->fsdp()->fp8_units())
                                                   : "",
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
  std::vector<int32_t> x(size_t(checked_product({accum, cfg.batch, cfg.seq}, "train: tokens per step"))), y(x.size());
  const size_t micro = size_t(cfg.batch * cfg.seq);
  const auto t_start = std::chrono::steady_clock::now();
  auto t_log = t_start;
  int64_t tokens_since_log = 0, steps_since_log = 0, skipped = 0;
  int64_t last_checkpoint = cfg.resume ? step : -1;  // the step the checkpoint file holds
  const double flops_per_token = train_flops_per_token(cfg.model, cfg.seq);
  for (; step < cfg.steps; ++step) {
    for (int64_t k = 0; k < accum; ++k) {
      train_batches.next(std::span(x).subspan(k * micro, micro), std::span(y).subspan(k * micro, micro));
    }
    const double lr = cosine_lr(cfg.optimizer, step);
    const StepResult r = dp ? dp->train_step(x, y, cfg.optimizer, lr)
                            : model.train_step(x.data(), y.data(), cfg.optimizer, lr);
    double loss = r.loss;
    const double norm = r.grad_norm;
    const bool stepped = r.updated;
    if (dp) cfg.comm->all_reduce(std::span<double>(&loss, 1), ReduceOp::avg);  // the global batch's loss
    if (!stepped) ++skipped;  // fp16 overflow: no update, the loss scale was halved
    // fp16 skips such a step and backs off its loss scale (above); in fp32 and bf16 a loss or gradient norm
    // that is not finite means the parameters just updated are not either (a finite loss can come with an
    // overflowing gradient), and a checkpoint of them would overwrite the last good one. Under data
    // parallelism every rank holds the same all-reduced loss and the same global norm, so all stop together.
    if (cfg.precision != DType::f16 && !(std::isfinite(loss) && std::isfinite(norm))) {
      fail("train: the loss is {} and the gradient norm {} at step {} ({}): stopping before it reaches a "
           "checkpoint; {}",
           loss, norm, step + 1, dtype_name(cfg.precision),
           cfg.checkpoint.empty() ? std::string("no checkpoint was configured")
           : last_checkpoint < 0  ? fmt::format("no checkpoint had been written to '{}' yet", cfg.checkpoint)
                                  : fmt::format("'{}' keeps the parameters after step {}", cfg.checkpoint, last_checkpoint));
    }
    result.train_loss.emplace_back(step, loss);
    tokens_since_log += int64_t(world) * accum * cfg.batch * cfg.seq;
    ++steps_since_log;

    const bool last = step + 1 == cfg.steps;
    nlohmann::json record = {{"step", step + 1}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm},
                             {"loss_scale", model.loss_scale()}};
    if ((cfg.log_every > 0 && (step + 1) % cfg.log_every == 0) || last || step == result.first_step) {
      model.synchronize();
      const auto now = std::chrono::steady_clock::now();
      const double secs = std::chrono::duration<double>(now - t_log).count();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double tok_s = double(tokens_since_log) / std::max(secs, 1e-9);
      const double ms_step = 1e3 * secs / double(steps_since_log);
      // The remaining steps at this run's mean pace so far.
      const double eta = elapsed / double(step + 1 - result.first_step) * double(cfg.steps - step - 1);
      record["tokens_per_s"] = tok_s;
      record["ms_per_step"] = ms_step;
      std::string line =
          fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | {:.1f} ms/step | "
                      "elapsed {} | ETA {}",
                      step + 1, cfg.steps, loss, lr, norm, tok_s, ms_step, clock_time(elapsed), clock_time(eta));
      if (cfg.device == Device::cuda) {
        line += fmt::format(" | MFU {:.1f}%", 100.0 * tok_s * flops_per_token / kHopperBf16PeakFlops);
      }
      if (cfg.precision == DType::f16) {
        line += fmt::format(" | loss scale {:.0f}, {} skipped", model.loss_scale(), skipped);
      }
      say(line);
      t_log = std::chrono::steady_clock::now();
      tokens_since_log = 0;
      steps_since_log = 0;
    }
    record["elapsed_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    metrics.write(record);
    // The ranks hold the same parameters (FSDP gathers them for it): rank 0 evaluates for all.
    const bool evaluate_now = (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last;
    if (evaluate_now && dp) dp->gather_parameters();
    if (root && evaluate_now) {
      std::span<int32_t> vx(x.data(), micro), vy(y.data(), micro);
      const double val = evaluate(model, val_batches, cfg.eval_batches, vx, vy);
      result.val_loss.emplace_back(step + 1, val);
      metrics.write({{"step", step + 1},
                     {"val_loss", val},
                     {"elapsed_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()}});
      say(fmt::format("step {:>6}/{} | val loss {:.4f}", step + 1, cfg.steps, val));
    }
    if (!cfg.checkpoint.empty() && ((cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0) || last)) {
      write_run_checkpoint(cfg.checkpoint, model, dp.get(), cfg, header, step + 1, train_batches.state());
      last_checkpoint = step + 1;
      say(fmt::format("step {:>6}/{} | checkpoint {}", step + 1, cfg.steps, cfg.checkpoint));
    }
  }
  result.last_step = step;
  return result;
}

std::vector<float> checkpoint_parameters(const std::string& path) {
  const CheckpointReader ck(path);
  FLASHLM_CHECK(ck.header().shard_rank < 0, "checkpoint: '{}' is one rank's shard of a sharded checkpoint, not the "
                "whole model", path);
  const size_t n = size_t(ck.header().parameter_count);
  std::vector<float> params(n), m(n), v(n);
  ck.read_payload(params, m, v);
  return params;
}

}  // namespace flashlm
