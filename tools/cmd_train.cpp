// flashlm train: the training run (flashlm::train), data-parallel under mpirun.
#include <cmath>
#include <cstdio>

#include "cli_common.h"
#include "flashlm/ddp.h"
#include "flashlm/ddp_model.h"
#include "flashlm/device.h"
#include "flashlm/dist.h"
#include "flashlm/train.h"

namespace {

struct TrainArgs {
  flashlm::TrainConfig cfg;
  std::string model = "tiny", device, precision, model_config, ddp, reduce_dtype = "fp32";
  int64_t d_model = 0, d_ff = 0, layers = 0, heads = 0, vocab = 256, context = 64, cosine_steps = 0;
  int threads = 0, zero = 0, nccl_max_ctas = 0;
  double collective_timeout_s = -1;
  CLI::Option *vocab_option = nullptr, *context_option = nullptr;
  ConditionalModelOptions model_options;
};

// The model: --model's size or --model-config's description (its vocab and context unless --vocab or
// --context is given), then the width options.
flashlm::ModelConfig model_config(const TrainArgs& a) {
  using namespace flashlm;
  ModelConfig model;
  if (a.model_config.empty()) {
    model = ModelConfig::named(a.model, a.context, a.vocab);
  } else {
    std::vector<std::string> keys;
    model = ModelConfig::from_json_file(a.model_config, &keys);
    model.context = model_config_value("context", keys, model.context, a.context_option, a.context);
    model.vocab = model_config_value("vocab", keys, model.vocab, a.vocab_option, a.vocab);
  }
  if (a.d_model) model.d_model = a.d_model;
  if (a.d_ff) model.d_ff = a.d_ff;
  if (a.layers) model.layers = a.layers;
  if (a.heads) model.heads = a.heads;
  model.validate();
  return model;
}

int run(TrainArgs& a) {
  using namespace flashlm;
  TrainConfig& cfg = a.cfg;
  resolve_device_and_precision(a.device, a.precision, cfg.device, cfg.precision, &cfg.options.bf16_pure,
                               &cfg.options.fp8);
  refuse_unused_model_options(a.model_options, cfg.options, cfg.device, cfg.options.fp8);
  cfg.options.check_optimizer_state();
  cfg.options.check_grad_dtype(cfg.precision, cfg.device);
  cfg.model = model_config(a);
  cfg.seq = cfg.model.context;
  if (!a.ddp.empty()) cfg.ddp.variant = parse_ddp_variant(a.ddp);
  const std::vector<DType> reduce =
      parse_reduce_dtypes(a.reduce_dtype, cfg.device, a.nccl_max_ctas, cfg.ddp.gemm_sm_reserve);
  if (reduce.size() != 1) throw InvalidArgument(fmt::format("--reduce-dtype {}: train takes one type", a.reduce_dtype));
  cfg.ddp.reduce_dtype = reduce.front();
  cfg.zero1 = a.zero == 1;
  const bool data_parallel = !a.ddp.empty() || cfg.zero1 || cfg.ddp.grad_accum > 1 ||
                             cfg.ddp.reduce_dtype != DType::f32 || a.nccl_max_ctas > 0 ||
                             cfg.ddp.gemm_sm_reserve >= 0 || launched_with_peers();
  if (data_parallel) check_data_parallel_grad_dtype(cfg.options.grad_dtype);
  cfg.optimizer.cosine_steps = a.cosine_steps > 0 ? a.cosine_steps : cfg.steps;
  if (a.threads > 0) set_cpu_threads(a.threads);
  cfg.progress = [](const std::string& line) { fmt::print("{}\n", line), std::fflush(stdout); };
  const auto train_and_report = [&cfg] {
    const TrainResult r = train(cfg);  // under data parallelism, rank 0 alone evaluates and reports
    if (!r.val_loss.empty()) fmt::print("final val loss {:.4f}\n", r.val_loss.back().second);
  };
  if (!data_parallel) {
    train_and_report();
    return 0;
  }
  return run_on_every_rank(a.collective_timeout_s, [&](Communicator& comm) {
    comm.set_nccl_max_ctas(a.nccl_max_ctas);
    cfg.comm = &comm;
    train_and_report();
  });
}

}  // namespace

Command add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  flashlm::TrainConfig& cfg = a->cfg;
  // The command's defaults where they differ from the library's.
  cfg.optimizer.lr_max = 3e-3;
  cfg.optimizer.lr_min = 3e-4;
  cfg.optimizer.warmup_steps = 20;
  CLI::App* cmd = app.add_subcommand(
      "train", "Train the Transformer LM on token files or synthetic data; data-parallel under mpirun");
  cmd->add_option("--model", a->model,
                  "Size: tiny, small, medium, large, xl, 2.7B, cs336-8b (overridden by the options below)")
      ->capture_default_str();
  cmd->add_option("--model-config", a->model_config,
                  "A JSON model description instead of --model (keys base, vocab, context, d_model, d_ff, layers, "
                  "heads, rope_theta, norm_eps; the options below override it, --vocab and --context when given)");
  cmd->add_option("--d-model", a->d_model, "Model width")->check(in_range(int64_t{1}, kMaxWidth));
  cmd->add_option("--d-ff", a->d_ff, "Feed-forward width")->check(in_range(int64_t{1}, kMaxWidth));
  cmd->add_option("--layers", a->layers, "Transformer blocks")
      ->check(in_range(int64_t{1}, flashlm::ModelConfig::kMaxLayers));
  cmd->add_option("--heads", a->heads, "Attention heads")->check(in_range(int64_t{1}, kMaxHeads));
  a->vocab_option = cmd->add_option("--vocab", a->vocab, "Vocabulary size")
                        ->capture_default_str()
                        ->check(in_range(int64_t{2}, kMaxVocab));
  a->context_option = cmd->add_option("--context", a->context, "Tokens per sequence")
                          ->capture_default_str()
                          ->check(in_range(int64_t{1}, kMaxContext));
  cmd->add_option("--batch", cfg.batch, "Sequences per step")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxBatch));
  cmd->add_option("--steps", cfg.steps, "Optimizer steps")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxSteps));
  cmd->add_option("--data", cfg.train_data, "'synthetic' or a token file (.bin: nanoGPT uint16 or llm.c headered)")
      ->capture_default_str();
  cmd->add_option("--val-data", cfg.val_data, "Validation token file (default: the last 10% of --data)");
  // Learning rates, decay and clip: finite, and where the update stays an AdamW step.
  cmd->add_option("--lr", cfg.optimizer.lr_max, "Peak learning rate")
      ->capture_default_str()
      ->check(in_range(0.0, 10.0));
  cmd->add_option("--lr-min", cfg.optimizer.lr_min, "Final learning rate of the cosine schedule")
      ->capture_default_str()
      ->check(in_range(0.0, 10.0));
  const auto steps = in_range(int64_t{0}, kMaxSteps);
  cmd->add_option("--warmup", cfg.optimizer.warmup_steps, "Linear warm-up steps")->capture_default_str()->check(steps);
  cmd->add_option("--cosine-steps", a->cosine_steps, "Step where the cosine reaches --lr-min (default: --steps)")
      ->check(steps);
  cmd->add_option("--weight-decay", cfg.optimizer.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str()
      ->check(in_range(0.0, 1.0));
  cmd->add_option("--beta1", cfg.optimizer.beta1, "AdamW beta1")
      ->capture_default_str()
      ->check(in_range(0.0, std::nextafter(1.0, 0.0)));
  cmd->add_option("--beta2", cfg.optimizer.beta2, "AdamW beta2")
      ->capture_default_str()
      ->check(in_range(0.0, std::nextafter(1.0, 0.0)));
  cmd->add_option("--loss-scale-init", cfg.loss_scale_init,
                  "fp16: the dynamic loss scale to start from (default 65536), as GradScaler's init_scale")
      ->check(in_range(1.0, 4294967296.0));
  cmd->add_option("--clip", cfg.optimizer.max_grad_norm, "Global gradient-norm clip (0: none)")
      ->capture_default_str()
      ->check(in_range(0.0, 1e9));
  cmd->add_option("--eval-every", cfg.eval_every, "Validation every N steps (0: only at the end)")
      ->capture_default_str()
      ->check(steps);
  cmd->add_option("--eval-batches", cfg.eval_batches, "Batches per validation")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, int64_t{kMaxReps}));
  cmd->add_option("--log-every", cfg.log_every, "Progress line every N steps")->capture_default_str()->check(steps);
  cmd->add_option("--checkpoint", cfg.checkpoint, "Checkpoint file (written atomically)");
  cmd->add_option("--checkpoint-every", cfg.checkpoint_every, "Checkpoint every N steps (0: at the end)")->check(steps);
  cmd->add_flag("--resume", cfg.resume, "Continue from --checkpoint, bit-exactly");
  cmd->add_option("--init", cfg.init,
                  "Start from these weights (.safetensors: flashlm export's, or PyTorch's with the CS336 names)");
  cmd->add_option("--log", cfg.metrics_log, "Write metrics as JSON lines (one per step and per evaluation)");
  cmd->add_flag("--sharded-checkpoint", cfg.sharded_checkpoint,
                "--ddp fsdp: every rank writes and resumes from its own shard, CHECKPOINT.rank<R>-of-<N>, nothing "
                "gathered (resume at the same world size)");
  cmd->add_option("--seed", cfg.seed, "Seed of weights, data order and synthetic data")
      ->capture_default_str()
      ->check(in_range(uint64_t{0}, uint64_t{INT64_MAX}));
  cmd->add_option("--device", a->device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--precision", a->precision,
                  "fp32, bf16 (fp32 masters), fp16, bf16-pure (parameters, gradients and AdamW moments in bf16) or "
                  "fp8 (bf16 with the blocks' linear layers as FP8 GEMMs, tensorwise scaled; on cpu emulated over fp32), "
                  "bf16-pure-fp8 (the same GEMMs over bf16-pure; cuda) "
                  "(default: bf16 on "
                  "cuda, fp32 on cpu)");
  a->model_options =
      add_model_options(cmd, cfg.options, {.attention = true, .cuda_graph = true, .fp8 = true, .grad_dtype = true});
  add_threads_option(cmd, a->threads);
  cmd->add_option("--ddp", a->ddp,
                  "Data parallelism under mpirun (each rank its --batch sequences): per-param, flat, async, "
                  "bucketed (the default when launched with several ranks) or fsdp (ZeRO-3: weights, gradients and "
                  "AdamW state sharded, each model part gathered when it is read)");
  cmd->add_option("--fsdp-prefetch", cfg.ddp.fsdp_prefetch, "--ddp fsdp: model parts ahead whose gather starts early")
      ->capture_default_str()
      ->check(CLI::Range(0, 2));
  cmd->add_option("--bucket-mb", cfg.ddp.bucket_mb, "Bucket size of --ddp bucketed, MB of fp32 gradients")
      ->capture_default_str()
      ->check(in_range(1e-6, kMaxBucketMb));
  cmd->add_option("--grad-accum", cfg.ddp.grad_accum,
                  "Micro-batches per optimizer step, gradients synchronised on the last")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, int64_t{kMaxReps}));
  cmd->add_option("--zero", a->zero, "1: ZeRO-1, the AdamW moments sharded across ranks")
      ->capture_default_str()
      ->check(CLI::Range(0, 1));
  add_gradient_sync_options(cmd, a->reduce_dtype, a->nccl_max_ctas, cfg.ddp.gemm_sm_reserve,
                            "Element type of the DDP gradient all-reduce");
  add_collective_timeout_option(cmd, a->collective_timeout_s);
  return {cmd, [a] { return run(*a); }};
}
