// `flashlm train`: the training run — data, the train step, evaluation, checkpoints and resume.
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "flashlm/ddp.h"
#include "flashlm/model.h"

namespace flashlm {

struct TrainConfig {
  ModelConfig model = ModelConfig::named("tiny", 64, 256);
  int64_t batch = 16;
  int64_t seq = 64;  // tokens per sequence (<= model.context)
  int64_t steps = 200;
  AdamWConfig optimizer;
  // "synthetic" (a learnable Markov chain, see data.h) or a token file (.bin, nanoGPT or llm.c format).
  std::string train_data = "synthetic";
  // A token file for validation; empty: the last 10% of the training tokens are held out instead.
  std::string val_data;
  int64_t eval_every = 50;   // 0: never
  int64_t eval_batches = 8;
  int64_t log_every = 10;
  std::string checkpoint;        // path; empty: no checkpoints
  int64_t checkpoint_every = 0;  // 0: only at the end (when checkpoint is set)
  bool resume = false;           // continue from `checkpoint`
  // A safetensors file (flashlm export's, or PyTorch's with the same names and shapes) whose weights replace
  // the seeded initialisation; the optimizer starts afresh. Not with resume.
  std::string init;
  // JSON lines, one per step ({"step", "loss", "lr", "grad_norm", "loss_scale", "elapsed_s"}, plus
  // "tokens_per_s" and "ms_per_step" on the steps that print a progress line) and one per evaluation
  // ({"step", "val_loss", "elapsed_s"}); written by rank 0; empty: none.
  std::string metrics_log;
  // FSDP: every rank writes (and resumes from) its own shard file, `checkpoint`.rank<R>-of-<N>, instead of
  // one gathered file written by rank 0; resuming needs the same world size.
  bool sharded_checkpoint = false;
  uint64_t seed = 1234;          // weights, data order and synthetic data
  Device device = Device::cpu;
  DType precision = DType::f32;  // fp32 on the CPU; fp32, bf16 or fp16 on CUDA
  // How the model is built: attention, recompute (automatic: resolved against the device's free memory),
  // bf16_pure (with bf16 on CUDA: no fp32 masters), optimizer_state, head_chunk, deterministic (false: resume
  // is no longer bit-exact) and cuda_graph (without data parallelism: one CUDA graph per step). train() sets
  // the rest itself: moment_rounding_seed from `seed`, the sharding fields from comm, ddp and zero1.
  ModelOptions options;
  double loss_scale_init = 0;    // fp16: the dynamic loss scale's start (0: LanguageModel::kInitialLossScale)
  // Data parallelism: with a communicator (the ranks of an mpirun job; a world of one works too) every rank
  // trains on its own `batch` rows of each step's global batch of batch · world size · grad_accum rows, the
  // gradients are synchronised as `ddp` says (and the AdamW moments sharded with zero1), and rank 0 alone
  // reports progress and writes checkpoints. ddp.grad_accum and zero1 need a communicator.
  Communicator* comm = nullptr;
  DdpOptions ddp;
  bool zero1 = false;
  std::function<void(const std::string&)> progress;  // one line per log / eval / checkpoint event
};

struct TrainResult {
  std::vector<std::pair<int64_t, double>> train_loss;  // (step, loss) of every step run
  std::vector<std::pair<int64_t, double>> val_loss;    // (step, loss) of every evaluation
  int64_t first_step = 0, last_step = 0;               // steps run: [first_step, last_step)
  double best_possible_loss = 0;                       // synthetic data: ln(branching); else 0
};

// Runs (or, with resume, continues) training. Bad configuration is a flashlm::Error.
TrainResult train(const TrainConfig& config);

// The final parameters of a checkpoint file (for tests and tools).
std::vector<float> checkpoint_parameters(const std::string& path);

// A model's configuration and flat fp32 parameters (parameter_layout order), from a training checkpoint or a
// safetensors file that flashlm export wrote (told apart by their first bytes): what generate and export
// start from.
struct ModelWeights {
  ModelConfig config;
  std::vector<float> params;
};
ModelWeights load_model_weights(const std::string& path);

}  // namespace flashlm
