// The CS336 Transformer LM: token embedding, pre-norm blocks (RMSNorm, causal multi-head attention with
// RoPE, SwiGLU feed-forward), final RMSNorm, untied LM head, no biases. Linear weights are stored
// [d_out, d_in] and applied as y = x Wᵀ, as torch.nn.Linear does.
//
// Parameters, gradients and activations each live in one allocation with named views, so the memory a
// model needs is known when it is built and stays constant while it trains (under FSDP's sharded storage,
// ModelOptions::external_parameters, the parameters and gradients live in FsdpParameters' shards and pool
// instead, equally fixed in size).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flashlm/attention.h"
#include "flashlm/fp8.h"
#include "flashlm/tensor.h"

namespace flashlm {

struct ModelConfig {
  int64_t vocab = 10000;
  int64_t context = 256;  // longest sequence the model accepts (RoPE table size)
  int64_t d_model = 512;
  int64_t d_ff = 1344;
  int64_t layers = 4;
  int64_t heads = 16;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  static constexpr int64_t kMaxLayers = int64_t{1} << 16;  // validate() bounds layers before looping over them

  int64_t head_dim() const { return d_model / heads; }
  int64_t parameter_count() const;                // all parameters
  int64_t non_embedding_parameter_count() const;  // without the token embedding (for MFU)
  void validate() const;                          // flashlm::Error naming the first bad field

  // Longest context any model accepts: RoPE tables, attention and the data path are tested up to it.
  static constexpr int64_t kMaxContext = 65536;

  // SPEC sizes ("small", "medium", "large", "xl", "2.7B"), the CS336 2026 leaderboard's "cs336-8b" and test
  // sizes ("tiny": 2 layers, d_model 32). vocab 0: the size's own (151936 for cs336-8b, 10000 otherwise).
  static ModelConfig named(std::string_view name, int64_t context = 256, int64_t vocab = 0);
  // A JSON object with any of the fields above ("vocab", "context", "d_model", "d_ff", "layers", "heads",
  // "rope_theta", "norm_eps"), optionally "base": a named size the others override. Unknown keys and
  // values of the wrong type are errors; the result is validated.
  // keys_given (when not null) receives the keys the text itself holds, "base" included.
  static ModelConfig from_json(std::string_view json_text, std::vector<std::string>* keys_given = nullptr);
  static ModelConfig from_json_file(const std::string& path, std::vector<std::string>* keys_given = nullptr);
};

// Activation recomputation: what the forward keeps for the backward, and what the backward recomputes.
//   none       every activation of every block is kept;
//   blocks:k   the input of every k-th block is kept; the backward recomputes the blocks of a segment from
//              it (calling the same per-layer hooks as the forward) just before it needs them;
//   selective  each block keeps its input, attention output and logsumexp; the backward recomputes the
//              norms, projections, RoPE and SwiGLU (everything but attention itself);
//   auto       resolved before allocating (resolve_recompute): the fastest plan that fits.
// Gradients are bit-identical to none's: the recomputed forward runs the same kernels on the same inputs.
struct RecomputePlan {
  enum class Kind { none, blocks, selective, automatic };
  Kind kind = Kind::none;
  int64_t every = 1;  // blocks: k
  static RecomputePlan parse(std::string_view text);  // "none", "blocks", "blocks:K", "selective", "auto"
  std::string name() const;                           // as parse reads it
  bool operator==(const RecomputePlan&) const = default;
};

// How the AdamW moments are stored beside fp32 master weights (`--optimizer-state`): fp32 (the default);
// bf16, each moment widened to fp32, updated in fp32 and rounded back to nearest even; bf16-sr, rounded back
// stochastically from a counter-based hash of (seed, step, index) (src/optim/optimizer.h says exactly what
// changes). bf16 moments save 4 of AdamW's 30 bytes per parameter each (xl's mixed-precision step: 30 -> 22).
// bf16-pure keeps its moments in bf16 by definition and takes only the default here.
enum class OptimizerState { fp32, bf16, bf16_sr };
OptimizerState parse_optimizer_state(std::string_view text);  // "fp32", "bf16" or "bf16-sr"
std::string_view optimizer_state_name(OptimizerState s);
// ModelOptions::grad_dtype: "fp32" or "bf16" (an InvalidArgument otherwise).
DType parse_grad_dtype(std::string_view text);

// How a model is built beyond its size: the attention implementation, the recomputation plan and (CUDA,
// bf16 only) pure bf16 — parameters, gradients and AdamW moments stored in bf16 with fp32 arithmetic in
// registers, as model.to(torch.bfloat16) with torch's AdamW holds them — instead of fp32 masters.
struct ModelOptions {
  AttentionImpl attention = AttentionImpl::flash;
  RecomputePlan recompute;
  bool bf16_pure = false;
  OptimizerState optimizer_state = OptimizerState::fp32;
  // `--grad-dtype`: how the gradients beside fp32 master weights are stored. fp32 (the
  // default), or bf16 on CUDA with precision bf16 (fp8 included): the weight-gradient GEMMs write bf16
  // directly (the product accumulated in fp32, rounded once), AdamW widens them, and the norm and clipping read
  // them — 6 bytes a parameter less per step. Where a gradient sums several contributions (the embedding's
  // rows, the LM head's chunks, the RMSNorm gains' tokens) it is accumulated in fp32 and rounded once, as
  // bf16-pure does; a backward onto gradients that were not zeroed adds to the stored bf16 values in fp32
  // and rounds the sum once (the running sum of micro-batches is then stored in bf16). Not on the CPU, not
  // with fp32, fp16 or bf16-pure (whose gradients are bf16 already), nor under data parallelism
  // (check_grad_dtype; DdpModel refuses it).
  DType grad_dtype = DType::f32;
  uint64_t moment_rounding_seed = 0;  // bf16-sr: the seed of its rounding (the run's seed)
  // Tokens per chunk of the LM head + cross-entropy (the [chunk, vocab] logits are all that exists of
  // them at once). 0: automatic (about 1 GiB of logits, or every token when that is fewer).
  int64_t head_chunk = 0;
  // CUDA: the attention backward's separate dQ pass, so that a step is bit-reproducible (checkpoint resume
  // relies on it); false: dQ by fp32 atomics, faster at long contexts, the last bits vary from run to run.
  bool deterministic = true;
  // CUDA: each gradient's squared norm computed as the backward finalises it, on a stream beside the
  // backward's GEMMs; false (the default): one pass over every gradient when the norm is asked for. The
  // two sum in different orders, so the norms differ in the last bits. Inside the step's CUDA graph the
  // single pass was faster (docs/perf.md, the xl step: the side stream's small
  // kernels slow the GEMMs beside them by more than the pass costs).
  bool overlap_grad_norm = false;
  // Ranks that share the AdamW moments (ZeRO-1 and FSDP: DdpModel releases the model's own and the sharded
  // optimizer keeps 1/world of them): the memory plan counts one such share. 1: the model's own moments.
  int64_t optimizer_shards = 1;
  // FSDP's sharded storage (flashlm/fsdp.h): the model allocates no flat parameter, working-copy or gradient
  // buffers; it reads and writes them through the pointers its parameter_storage() table holds, which
  // FsdpParameters fills part by part (ParametersNeededHook, GradientsNeededHook). parameters() and
  // gradients() are then nullptr, and what works on the whole flat buffers (init_parameters, save_state,
  // load_state, the model's own norm, clip and AdamW) is an error: DdpModel does those on the shards.
  // For the memory plan, which then counts this rank's share of them (FSDP's per-rank bytes): the ranks,
  // the prefetch depth (the pool holds prefetch + 2 parts) and grad_accum (> 1 keeps whole local gradients).
  bool external_parameters = false;
  int64_t fsdp_world = 1;
  int64_t fsdp_prefetch = 1;
  int64_t fsdp_grad_accum = 1;
  // CUDA: train_step captures the whole step (forward, backward, gradient norm, clipping, AdamW) as one CUDA
  // graph on its first call after a warm-up step and replays it (no host work between the kernels); it
  // runs eagerly, saying why (CudaModel::cuda_graph_status), where a step cannot be captured: fp16's loss
  // scaling, data-parallel hooks, profiled ranges, or a capture that failed. false: always eager.
  bool cuda_graph = true;
  // --precision fp8. On CUDA, over bf16 mixed precision (or over bf16_pure: --precision bf16-pure-fp8, the
  // leaderboard's storage with FP8 GEMMs): every linear layer of the blocks (q/k/v, output
  // projection, w1/w2/w3; not the LM head, nor attention) computes its forward GEMM and both backward GEMMs
  // in FP8 through cuBLASLt, each operand scaled tensorwise by fp8_max / amax of the tensor now (torchao's
  // "tensorwise" recipe; src/model/fp8.h; or per row: fp8_recipe below): weights and activations in e4m3, the output gradients in
  // fp8_gradients' format. The scales are computed on the device each step, so the step stays one CUDA
  // graph and keeps no FP8 state between steps (a checkpoint is a bf16 run's). Needs d_model, d_ff and
  // batch · seq to be multiples of 16. On the CPU, emulated over fp32: the same operands rounded through FP8
  // with the same scales (fp8_round_trip_cpu) before the fp32 GEMMs, so that the recipe's numerics can be
  // tried and tested without a GPU (slower than fp32, not faster).
  bool fp8 = false;
  Fp8Format fp8_gradients = Fp8Format::e5m2;
  // How fp8 scales the operands: tensorwise (above), or rowwise (torchao's "rowwise"): one scale per row of
  // each operand along the dimension its product does not sum over — the forward's x per token and w per
  // output channel, dgrad's dy per token and w per input column, wgrad's dy per output channel and x per input
  // column — through cuBLASLt's outer-vector scaling (cuBLAS >= 12.9 on Hopper). Each of x, w and dy is then
  // cast twice (scaled per row and, transposed, per column) and every cast reduces its own amaxes: more cast
  // work than tensorwise, for a finer quantisation. On the CPU emulated the same way.
  Fp8Recipe fp8_recipe = Fp8Recipe::tensorwise;
  // fp8 on CUDA, tensorwise: the amaxes of the FP8 operands come from the kernels that write the tensors (the
  // RMSNorm, SwiGLU and RoPE kernels for activations and gradients, the AdamW step for the block weights:
  // src/model/fp8.h's Fp8Produced, src/model/cuda/fp8_linear.h) instead of a reduction before each cast. The
  // same bits either way; false, every cast reducing its own, is for the tests that check so.
  bool fp8_fused_amax = true;
  // fp8 on CUDA, tensorwise, fp32 masters (not bf16_pure), the model's own storage: the AdamW step writes the
  // block weights' FP8 copies (w and its transpose) as it stores the weights, scaled from a bound on their new
  // amax (src/optim/optimizer.h's Fp8WeightCopies), so that no pass casts them. Needs fp8_fused_amax,
  // beta1² < beta2 and fp32 gradients (grad_dtype; bf16 ones not yet); otherwise, or with
  // FLASHLM_FP8_WEIGHT_CAST=pass, the first product of each pass casts its weight as with false.
  bool fp8_optimizer_weight_cast = true;
  // fp8 needs precision bf16 (bf16_pure or not) on CUDA, fp32 without bf16_pure on the CPU: an Error
  // otherwise (the models and the memory plan check it).
  void check_fp8(DType precision, Device device = Device::cuda) const;
  // Whether FSDP's sharded storage gathers the blocks' linear weights (q, k, v, output_proj, w1, w2, w3) as
  // the e4m3 bytes and scales their FP8 GEMMs read (dist/fp8_gather.h), one byte an element on the wire,
  // rather than in the precision the shards hold: fp8 with the tensorwise recipe under external_parameters,
  // on the CPU (whose emulation decodes them) and on CUDA (whose Fp8Linear multiplies them as they stand
  // and transposes the bytes for the backward's dx product instead of casting a gathered bf16 weight).
  // Rowwise scales each row and column of a weight, which a gather of tensorwise bytes cannot give: its
  // weights are gathered as without fp8. (At one rank nothing is gathered at all, unless
  // DdpOptions::fsdp_gather_alone.)
  bool fsdp_fp8_gather() const { return fp8 && fp8_recipe == Fp8Recipe::tensorwise && external_parameters; }
  // optimizer_state other than fp32 needs fp32 masters: with bf16_pure it is an Error (the models and the
  // memory plan check it).
  void check_optimizer_state() const;
  // grad_dtype bf16 needs CUDA, precision bf16 (mixed, or fp8 over it) and the model's own storage: an
  // InvalidArgument naming what to change otherwise (the models and the memory plan check it).
  void check_grad_dtype(DType precision, Device device) const;
  static ModelOptions with_attention(AttentionImpl attention) {
    ModelOptions o;
    o.attention = attention;
    return o;
  }
};

// "fp32", "bf16", "fp16", "bf16-pure", "fp8" or "bf16-pure-fp8" into (dtype, bf16_pure, fp8): fp8 is dtype
// bf16 with ModelOptions::fp8, bf16-pure-fp8 that over bf16-pure. The three-argument form is for commands
// without FP8 and refuses both FP8 ones.
void parse_precision(std::string_view text, DType& dtype, bool& bf16_pure, bool& fp8);
void parse_precision(std::string_view text, DType& dtype, bool& bf16_pure);
std::string precision_name(DType dtype, bool bf16_pure, bool fp8 = false);

// What a model will allocate, by kind, computed before anything is allocated with the arithmetic the
// models size their buffers with.
struct MemoryPlan {
  struct Item {
    std::string what;
    int64_t bytes = 0;
  };
  std::vector<Item> items;
  RecomputePlan recompute;  // resolved (never automatic)
  std::string reason;       // why auto chose it (empty otherwise)
  int64_t total_bytes() const;
  std::string format() const;  // one line per item and the total, in GiB
};

// The plan for a model of this size, batch and sequence on `device` in `precision`. options.recompute may
// be automatic only when `available_bytes` (the device's free memory) is given: then it resolves to the
// fastest plan that fits (none, selective, blocks:1), or else the one needing least memory (blocks:k at the
// k that minimises kept inputs + the recomputed segment, CS336's sqrt(L)-style trade-off), and says why.
MemoryPlan plan_model_memory(const ModelConfig& config, int64_t batch, int64_t seq, Device device, DType precision,
                             const ModelOptions& options, int64_t available_bytes = -1);
// The plan against the free memory of `device` (CUDA; the CPU sets no limit here, available_bytes -1), with
// options.recompute resolved in place (auto becomes the plan chosen): the one step train, bench and ddp-bench
// take before building a model. available_bytes receives what it planned against, for check_memory_plan.
MemoryPlan resolve_model_memory(const ModelConfig& config, int64_t batch, int64_t seq, Device device, DType precision,
                                ModelOptions& options, int64_t& available_bytes);
// Throws flashlm::OutOfMemory naming the plan's total, the available bytes and the shortfall when the plan
// does not fit.
void check_memory_plan(const MemoryPlan& plan, int64_t available_bytes, std::string_view device_label);


// One named parameter: its place in the flat parameter buffer and its shape.
struct ParameterInfo {
  std::string name;  // "layers.0.attn.q_proj.weight", as in the CS336 PyTorch model's state_dict
  int64_t offset = 0;
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// The order and shapes of every parameter; the same layout serves parameters, gradients and optimizer
// moments.
std::vector<ParameterInfo> parameter_layout(const ModelConfig& config);

// Normal(0, 0.02) weights truncated at 3 sigma, unit RMSNorm gains: the one initialisation every model
// (CPU or CUDA) uses, so that equal seeds give equal weights.
void init_parameters_host(const std::vector<ParameterInfo>& layout, float* params, uint64_t seed);
// One parameter's values of that initialisation into w[0, p.numel()) (for models that upload parameter by
// parameter instead of holding every value on the host at once).
void init_parameter_host(const ParameterInfo& p, float* w, uint64_t seed);

struct AdamWConfig {
  double lr_max = 1e-3, lr_min = 1e-4;
  int64_t warmup_steps = 10, cosine_steps = 1000;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double max_grad_norm = 1.0;  // 0: no clipping
};

// Cosine learning rate with linear warm-up (CS336's schedule): lr at step t (0-based).
double cosine_lr(const AdamWConfig& c, int64_t step);

// The global gradient norm adds fp64 sums of squares over fixed chunks of this many elements of the flat
// gradient, in chunk order: the same bits whatever the thread count, and for ZeRO-1, whose shards are whole
// chunks, whatever the world size.
constexpr int64_t kGradientNormChunk = int64_t{1} << 16;

// Called by backward() when the gradients of parameters [first, last] (indices into the layout) are final:
// data parallelism starts reducing them while the rest of the backward runs (flashlm/ddp.h).
using GradientReadyHook = std::function<void(int64_t first, int64_t last)>;

// Called by forward() and backward() before they queue the kernels that read elements [offset, offset + count)
// of the flat parameters (or of their working copy), one model part (embedding, layer, final norm, head) at a
// time: ZeRO-1 makes the model's stream wait there for the gather of just those parameters, so that the
// forward starts while the rest are still arriving; FSDP gathers the part's shards there (flashlm/fsdp.h).
using ParametersNeededHook = std::function<void(int64_t offset, int64_t count)>;
// Called after the kernels that read a part's parameters are queued (the same elements as the needed call
// before them): FSDP frees the part's gathered weights there, until the next needed call.
using ParametersDoneHook = std::function<void(int64_t offset, int64_t count)>;
// Called by backward() before it writes the first gradient of a model part (the same elements as the
// needed hook): FSDP's sharded storage points the part's gradient pointers at a gradient buffer there.
using GradientsNeededHook = std::function<void(int64_t offset, int64_t count)>;

// Where a model reads and writes one parameter (LanguageModel::parameter_storage()): `weight` what the GEMMs
// read (the low-precision working copy, or the fp32 master), `master` the fp32 value (what the embedding
// lookup and the RMSNorm gains read on CUDA, and everything on the CPU), `grad` the fp32 gradient. A model
// fills them with its own flat buffers; under FSDP's sharded storage the hooks fill them. A block linear
// weight that FSDP gathered in FP8 (ModelOptions::fsdp_fp8_gather) has `weight` pointing at its e4m3 bytes,
// `master` null, and `fp8_scales` at the scale slot of its scale group (model/fp8.h's kFp8DequantIndex and
// kFp8AmaxIndex; q, k and v share one); fp8_scales is null for every other parameter.
struct ParameterStorage {
  void* weight = nullptr;
  float* master = nullptr;
  float* grad = nullptr;
  const float* fp8_scales = nullptr;
};

// What one train_step did: the batch's mean loss, the gradient norm before clipping, and whether the
// parameters were updated (false: an fp16 overflow skipped the update and halved the loss scale).
struct StepResult {
  double loss = 0;
  double grad_norm = 0;
  bool updated = true;
};

class AdamWState;  // src/optim/adamw_state.h
class LossScaler;  // src/optim/loss_scaler.h

// What the training loop, the benchmarks and data parallelism need from a model, whatever device it runs
// on. The optimizer's state (AdamW moments and step count) and fp16's loss scale are parts the models share
// (src/optim/): what reads them is not virtual.
class LanguageModel {
 public:
  virtual ~LanguageModel();
  LanguageModel(const LanguageModel&) = delete;
  LanguageModel& operator=(const LanguageModel&) = delete;

  // --- What the model is (fixed when it is built).
  const ModelConfig& config() const { return config_; }
  // The order and shapes of every parameter (parameter_layout(config())).
  const std::vector<ParameterInfo>& layout() const { return layout_; }
  int64_t parameter_count() const { return parameter_count_; }
  Device device() const { return device_; }
  DType precision() const { return precision_; }
  // Parameters, gradients and moments stored in precision() itself, without fp32 masters (CudaModel's
  // bf16-pure). Such a model has no parameters()/gradients() in fp32 to hand to data parallelism.
  bool bf16_pure() const { return bf16_pure_; }
  // The type of the copy of the weights the GEMMs read: precision() for CudaModel's bf16/fp16 mixed
  // precision (working_parameters()), fp32 otherwise.
  DType working_dtype() const { return bf16_pure_ || precision_ == DType::f32 ? DType::f32 : precision_; }
  // Built with ModelOptions::external_parameters: FSDP's sharded storage holds parameters and gradients.
  bool external_parameters() const { return external_parameters_; }
  // Built with ModelOptions::fsdp_fp8_gather: under FSDP at more than one rank its block linear weights
  // arrive as e4m3 bytes (ParameterStorage::fp8_scales), which the model reads (CPU and CUDA).
  bool fsdp_fp8_gather() const { return fsdp_fp8_gather_; }

  // --- The step.
  virtual void init_parameters(uint64_t seed) = 0;
  // tokens, targets: host arrays [batch, seq]; returns the mean cross-entropy.
  virtual double forward(const int32_t* tokens, const int32_t* targets) = 0;
  virtual void backward() = 0;
  virtual void zero_grad() = 0;
  // One training step on one batch (host arrays as forward's): zero_grad, forward, backward and
  // optimizer_step (below) at lr. CudaModel replays it as one CUDA graph where it can (ModelOptions::cuda_graph).
  virtual StepResult train_step(const int32_t* tokens, const int32_t* targets, const AdamWConfig& c, double lr);
  // How train_step runs: "on", or "off: <why>" ("" on a device without graphs).
  virtual std::string cuda_graph_status() const { return ""; }
  virtual void synchronize() const {}  // waits for queued device work (for timing)

  // --- The update after a backward (optimizer_step below runs the three in order).
  // fp16 loss scaling: divides the scale out of the gradients, or returns false on an overflow (skip the
  // step). Always true for the other precisions.
  virtual bool unscale_gradients() = 0;
  virtual double clip_gradients(double max_norm) = 0;  // returns the norm before clipping
  virtual void adamw_step(const AdamWConfig& c, double lr) = 0;

  // --- The optimizer's state.
  // How the AdamW moments are stored beside the fp32 masters (ModelOptions::optimizer_state).
  OptimizerState optimizer_state() const;
  // How the gradients are stored beside fp32 masters (ModelOptions::grad_dtype; bf16-pure's are bf16 whatever
  // this says).
  DType grad_dtype() const { return grad_dtype_; }
  int64_t optimizer_steps() const;  // AdamW steps taken (or loaded)
  // Frees the AdamW moments and restarts the step count at 0 (the next own step starts from zero moments,
  // as a new optimizer would): for data parallelism whose sharded optimizer keeps the state instead (ZeRO-1,
  // FSDP), so that a rank does not hold both. No-op for a model that has taken no step.
  virtual void release_optimizer_state() = 0;

  // --- The loss scale (fp16's dynamic one; the other precisions keep a scale of 1 and no count).
  // The scale and the good steps in a row since it last changed, so that a checkpoint resumes it;
  // restore_loss_scale refuses a scale that is not finite and positive or a count outside [0, the growth
  // interval), and on a model without loss scaling anything but (1, 0).
  static constexpr double kInitialLossScale = 65536.0;
  static constexpr int64_t kLossScaleGrowthInterval = 2000;  // good steps in a row that double the scale
  double loss_scale() const;
  int64_t loss_scale_good_steps() const;
  void restore_loss_scale(double scale, int64_t good_steps);

  // --- Checkpoints: fp32 master parameters and AdamW moments, host arrays of parameter_count() floats each
  // (another size is an Error naming the argument), and the AdamW step count (>= 0).
  virtual void save_state(std::span<float> params, std::span<float> m, std::span<float> v) const = 0;
  virtual void load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                          int64_t optimizer_steps) = 0;

  // --- For data parallelism (flashlm/ddp.h), which reduces the gradients and may update the parameters in
  // place: the flat fp32 master parameters and gradients in device() memory, and the stream the model
  // queues its work on (CUDA; nullptr on the CPU).
  virtual float* parameters() const = 0;
  virtual float* gradients() const = 0;
  virtual void* stream() const { return nullptr; }
  // After parameters() changed in place (a broadcast, ZeRO-1's update): refreshes what is derived from them
  // (CudaModel's low-precision weights), queued on stream().
  virtual void parameters_changed() {}
  // The low-precision copy of parameters() that forward and backward read (CudaModel in bf16 or fp16; the
  // same flat layout, precision() elements), or nullptr where they read parameters() itself. ZeRO-1
  // gathers this copy instead of the fp32 masters (flashlm/zero.h).
  virtual void* working_parameters() const { return nullptr; }
  // Indices into layout() of the parameters that forward and backward read from parameters() in fp32 even
  // though working_parameters() exists (CudaModel: the token embeddings and the RMSNorm gains). ZeRO-1,
  // which gathers only the working copy after a step, gathers these masters too.
  virtual std::vector<int64_t> master_read_parameters() const { return {}; }
  // backward() calls `hook` as each parameter's gradient becomes final — on CUDA when the kernels that
  // produce it are queued on stream(), not when they have run. An empty hook removes it.
  void set_gradient_ready_hook(GradientReadyHook hook) { gradient_ready_hook_ = std::move(hook); }
  // forward() and backward() call `hook` before each part of the model (embedding, each layer, final norm,
  // head) reads its parameters, and the done hook after. An empty hook removes it.
  void set_parameters_needed_hook(ParametersNeededHook hook) { parameters_needed_hook_ = std::move(hook); }
  void set_parameters_done_hook(ParametersDoneHook hook) { parameters_done_hook_ = std::move(hook); }
  void set_gradients_needed_hook(GradientsNeededHook hook) { gradients_needed_hook_ = std::move(hook); }
  // Per parameter of layout(), where forward() and backward() find it (ParameterStorage). Its pointers point
  // into the model's flat buffers, unless the model was built with ModelOptions::external_parameters: then
  // they are null until the hooks' owner (FsdpParameters) fills them, and the model reads them only between
  // a part's needed and done calls (and its gradients after the gradients-needed call).
  std::span<ParameterStorage> parameter_storage() { return storage_; }

 protected:
  // What the model is, from its constructor's arguments: the size (validated; its layout), the device, the
  // precision of its activations, and options.bf16_pure and options.external_parameters. The subclass
  // checks that it supports them.
  LanguageModel(const ModelConfig& config, Device device, DType precision, const ModelOptions& options);
  // For a model's constructor, before anything reads them: its optimizer state, for parameter_count()
  // parameters in device() memory with moments stored as `state` says (in bf16 whatever it says when
  // bf16_pure()), and its loss scale (dynamic for fp16).
  void init_optimizer_state(OptimizerState state);
  AdamWState& adamw() { return *adamw_; }
  const AdamWState& adamw() const { return *adamw_; }
  LossScaler& loss_scaler() { return *loss_scaler_; }
  const LossScaler& loss_scaler() const { return *loss_scaler_; }
  // For save_state and load_state (`caller` names it in errors): each array holds parameter_count() floats,
  // and the step count is not negative.
  void check_state_arrays(std::string_view caller, size_t params, size_t m, size_t v, int64_t optimizer_steps) const;
  // For load_state into bf16 moments (OptimizerState bf16, bf16-sr): every value of m and v is a bf16 value
  // (what save_state's exact widening wrote), so that the narrowing is exact and the resume bit-exact;
  // another value (fp32 moments) is an Error naming the first.
  static void check_bf16_moments(std::string_view caller, std::span<const float> m, std::span<const float> v);
  void gradient_ready(std::string_view parameter_name) const;  // for backward(): calls the hook, if any
  // Whether someone else acts on the gradients as they become final (data parallelism reduces them).
  bool has_gradient_ready_hook() const { return bool(gradient_ready_hook_); }
  bool has_parameter_hooks() const {
    return parameters_needed_hook_ || parameters_done_hook_ || gradients_needed_hook_;
  }
  // For forward(): calls the hook, if any, with the elements of every parameter whose name starts with
  // `name_prefix` (one run: a layer's parameters are contiguous in the layout).
  void parameters_needed(std::string_view name_prefix) const;
  void parameters_done(std::string_view name_prefix) const;  // likewise, the done hook
  void gradients_needed(std::string_view name_prefix) const;  // likewise, the gradients-needed hook
  // Fills parameter_storage() with the flat buffers' pointers (working: nullptr for fp32 weights).
  void point_storage_at(float* params, void* working, DType working_dtype, float* grads);
  // The table's entry for a parameter by name (a linear search: a few hundred names at most).
  const ParameterStorage& stored(std::string_view name) const;
  std::vector<ParameterStorage> storage_;

 private:
  ModelConfig config_;
  std::vector<ParameterInfo> layout_;
  int64_t parameter_count_ = 0;
  Device device_;
  DType precision_;
  bool bf16_pure_ = false;
  DType grad_dtype_ = DType::f32;
  bool external_parameters_ = false;
  bool fsdp_fp8_gather_ = false;
  std::unique_ptr<AdamWState> adamw_;
  std::unique_ptr<LossScaler> loss_scaler_;
  GradientsNeededHook gradients_needed_hook_;
  GradientReadyHook gradient_ready_hook_;
  ParametersNeededHook parameters_needed_hook_;
  ParametersDoneHook parameters_done_hook_;
};

// The update after a backward: fp16 unscaling (an overflow skips the update and returns false), clipping to
// c.max_grad_norm and AdamW at lr. *norm (if given): the gradient norm before clipping.
bool optimizer_step(LanguageModel& model, const AdamWConfig& c, double lr, double* norm = nullptr);

// A model on `device`: CpuModel (fp32) or CudaModel (fp32, bf16, fp16).
std::unique_ptr<LanguageModel> make_model(const ModelConfig& config, int64_t batch, int64_t seq, Device device,
                                          DType precision, AttentionImpl attention = AttentionImpl::flash);
// With recomputation, pure bf16 and the head chunk: options.recompute must be resolved (not automatic).
std::unique_ptr<LanguageModel> make_model(const ModelConfig& config, int64_t batch, int64_t seq, Device device,
                                          DType precision, const ModelOptions& options);

// A block's forward, or the part of it a recomputation needs: everything but the block's output (the last
// block of a recomputed segment), or also without attention, whose output was kept (selective).
enum class BlockPass { full, without_output, without_attention };

// The LM on the CPU in fp32: forward, backward, AdamW. Its buffers are its private implementation's
// (src/model/model_cpu.cpp).
class CpuModel final : public LanguageModel {
 public:
  CpuModel(const ModelConfig& config, int64_t batch, int64_t seq, AttentionImpl attention = AttentionImpl::flash);
  // options.bf16_pure must be false (the CPU runs fp32); options.recompute must be resolved;
  // options.deterministic is ignored (the CPU attention backward is always deterministic).
  CpuModel(const ModelConfig& config, int64_t batch, int64_t seq, const ModelOptions& options);
  ~CpuModel() override;

  float* parameters() const override;
  float* gradients() const override;
  size_t activation_bytes() const;
  const RecomputePlan& recompute() const;

  // Normal(0, 0.02) weights (truncated at 3 sigma), unit RMSNorm gains; reproducible per seed.
  void init_parameters(uint64_t seed) override;

  // tokens and targets: [batch, seq] int32, every id in [0, vocab). Returns the mean cross-entropy. The LM
  // head and the loss run in chunks of head_chunk() tokens (ModelOptions::head_chunk), so that the logits
  // of every token exist at once only when one chunk holds them all.
  double forward(const int32_t* tokens, const int32_t* targets) override;
  int64_t head_chunk() const;
  // [batch, seq, vocab] after forward(), before backward(): recomputed chunk by chunk, the forward's values.
  void copy_logits_to(float* out) const;

  // Adds d(loss)/d(parameters) to gradients() (call zero_grad() first, or accumulate micro-batches).
  void backward() override;
  void zero_grad() override;
  bool unscale_gradients() override { return true; }

  // Global L2 norm of gradients(); clip_gradients scales them to at most max_norm and returns the norm
  // before clipping.
  double gradient_norm() const;
  double clip_gradients(double max_norm) override;

  // One AdamW step (decoupled weight decay, bias-corrected) with learning rate lr.
  void adamw_step(const AdamWConfig& c, double lr) override;
  void release_optimizer_state() override;
  void save_state(std::span<float> params, std::span<float> m, std::span<float> v) const override;
  void load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                  int64_t optimizer_steps) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void forward_block(int64_t l, BlockPass pass);
  void check_own_storage(std::string_view caller) const;  // flashlm::Error under external_parameters
};

// The LM on one GPU. Activations and their gradients in `precision` (fp32, bf16 or fp16); master weights,
// gradients and AdamW moments in fp32, with a low-precision copy of the weights for the GEMMs — or, with
// ModelOptions::bf16_pure, all of them in bf16 (each backward accumulates a weight's gradient in fp32 and
// rounds it once into the bf16 gradient; parameters() and gradients() then throw), or with
// ModelOptions::grad_dtype bf16 the gradients alone (gradients() then throws). The LM head and the loss
// run in token chunks (ModelOptions::head_chunk): the logits of every token never exist at once. fp16 uses
// dynamic loss scaling: the loss gradient is multiplied by loss_scale(); unscale_gradients() divides it
// out, or reports an overflow (inf/nan), halves the scale and the caller skips the step (LossScaler). Every
// call is asynchronous on the model's stream except those that return host values (forward's loss, norms,
// copies). Built only with CUDA; its buffers are its private implementation's (src/model/cuda/model_impl.h).
class CudaModel final : public LanguageModel {
 public:
  CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision,
            AttentionImpl attention = AttentionImpl::flash, void* stream = nullptr);
  // options.recompute must be resolved; options.bf16_pure needs precision bf16.
  CudaModel(const ModelConfig& config, int64_t batch, int64_t seq, DType precision, const ModelOptions& options,
            void* stream = nullptr);
  ~CudaModel() override;
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  float* parameters() const override;  // device memory
  float* gradients() const override;   // device memory
  void* stream() const override;
  void parameters_changed() override;
  void* working_parameters() const override;
  std::vector<int64_t> master_read_parameters() const override;
  const RecomputePlan& recompute() const;

  void init_parameters(uint64_t seed) override;  // the same values as CpuModel::init_parameters(seed)
  void load_parameters(const float* host);
  void copy_parameters_to(float* host) const;
  void copy_gradients_to(float* host) const;  // as stored: multiplied by loss_scale() until unscaled
  void copy_logits_to(float* host) const;     // [batch, seq, vocab] after forward(), before backward()

  double forward(const int32_t* host_tokens, const int32_t* host_targets) override;  // mean cross-entropy
  void backward() override;
  void zero_grad() override;
  bool unscale_gradients() override;  // false: fp16 overflow, the step must be skipped
  double gradient_norm() const;
  double clip_gradients(double max_norm) override;
  void adamw_step(const AdamWConfig& c, double lr) override;
  StepResult train_step(const int32_t* tokens, const int32_t* targets, const AdamWConfig& c, double lr) override;
  std::string cuda_graph_status() const override;
  void release_optimizer_state() override;
  void save_state(std::span<float> params, std::span<float> m, std::span<float> v) const override;
  void load_state(std::span<const float> params, std::span<const float> m, std::span<const float> v,
                  int64_t optimizer_steps) override;
  void synchronize() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void forward_block(int64_t l, BlockPass pass);
  void check_own_storage(std::string_view caller) const;  // flashlm::Error under external_parameters
  void queue_forward();  // forward's kernels, on the tokens and targets already on the device
  // train_step captured into Impl's graph (false: capture failed, the reason is in the status;
  // src/model/cuda/step_graph.cpp).
  bool capture_step();
};

}  // namespace flashlm
