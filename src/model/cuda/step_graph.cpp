// CudaModel::train_step as one CUDA graph (step_graph.h): whether the step can run as a graph, its eager
// warm-up, the capture of zero_grad, forward, backward, clipping and AdamW with the step's scalars read from
// device memory, and the replay that leaves the host state as the eager step would; and abandon_capture.
#include "model/cuda/step_graph.h"

#include <cuda_runtime.h>

#include <fmt/format.h>

#include "core/cuda_check.h"
#include "flashlm/model.h"
#include "flashlm/profile.h"
#include "model/cuda/model_impl.h"
#include "optim/optimizer.h"

namespace flashlm {

void abandon_capture(cudaStream_t stream, cudaGraph_t graph) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial) cudaGraphDestroy(partial);
  }
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
}

std::string CudaModel::cuda_graph_status() const { return impl_->graph_status; }

StepResult CudaModel::train_step(const int32_t* tokens, const int32_t* targets, const AdamWConfig& cfg, double lr) {
  Impl& m = *impl_;
  const char* why = nullptr;
  if (!m.options.cuda_graph) {
    why = "off: --cuda-graph off";
  } else if (m.precision == DType::f16) {
    why = "off: fp16's loss scaling reads the overflow count on the host";
  } else if (has_gradient_ready_hook() || has_parameter_hooks()) {
    why = "off: data-parallel hooks run on the host between the step's kernels";
  } else if (RangeProfiler::instance().enabled()) {
    why = "off: profiled ranges time each part with events on the host's side";
  } else if (m.graph && !m.graph->failure.empty()) {
    why = m.graph->failure.c_str();
  }
  if (why) {
    m.graph_status = why;
    return LanguageModel::train_step(tokens, targets, cfg, lr);
  }
  if (!m.graph) m.graph = std::make_unique<StepGraph>();
  StepGraph& g = *m.graph;
  // The step's stream follows the work already queued on the model's own.
  FLASHLM_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(m.stream)), "cudaStreamSynchronize");
  const StreamScope on_step_stream(m.stream, g.stream);
  if (!g.warmed_up) {  // eager, on the step's stream: what it allocates exists before the capture
    const StepResult r = LanguageModel::train_step(tokens, targets, cfg, lr);
    g.scalars = Buffer::allocate(sizeof(DeviceStepScalars), Device::cuda, "train-step scalars");
    g.in = std::make_unique<PinnedArray<DeviceStepScalars>>(1);
    g.out = std::make_unique<PinnedArray<DeviceStepScalars>>(1);
    g.rows = std::make_unique<PinnedArray<float>>(size_t(m.n));
    g.warmed_up = true;
    m.graph_status = "on (this step was the eager warm-up)";
    return r;
  }
  m.upload_batch(tokens, targets);
  if (m.norms) gpu::stream_synchronize(m.norms->stream);  // an eager step's norms may still be running
  *g.in->data = DeviceStepScalars{adamw_scalars(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, m.adam->steps() + 1),
                                  cfg.max_grad_norm, 0.0};
  g.in->data->adam.rounding_key = moment_rounding_key(m.options.moment_rounding_seed, m.adam->steps() + 1);
  // With FP8's fused weight amaxes the graph's begin_pass takes those its AdamW step wrote at the previous replay
  // (captured so: the flag is set by the eager warm-up's step). Where anything else wrote the weights since
  // (a checkpoint load, an eager step without them), their amaxes are reduced here first, outside the graph.
  // With the optimizer's FP8 weight copies the graph's begin_pass takes the copies instead (and casts nothing):
  // where they are stale, the weights are cast here, outside the graph. A graph captured with them runs only
  // while the betas still bound the update (fp8_copies_wanted); otherwise this step is eager.
  const bool fused_amax = m.fp8_stored_amaxes().count > 0;
  m.fp8_betas_bounded = adamw_update_bounded(cfg.beta1, cfg.beta2);
  const bool copies = m.fp8_copies_wanted();
  if (g.exec && copies != g.fp8_copies) {
    m.graph_status = "off for this step: the betas changed whether AdamW writes the FP8 weight copies";
    return LanguageModel::train_step(tokens, targets, cfg, lr);
  }
  if (copies && !m.fp8->weight_copies_current()) {
    m.restore_fp8_weights_bf16();  // the cast reads the bf16 copy
    const std::span<const Fp8WeightRef> weights = m.fp8_pass_weights();
    if (m.fp8->cast_weights(weights, m.stream)) {
      m.fp8->set_weight_amaxes_current(weights);
      m.fp8->set_weight_copies_current(weights);
    }
  } else if (fused_amax && !m.fp8->weight_amaxes_current()) {
    const std::span<const Fp8WeightRef> weights = m.fp8_pass_weights();
    if (m.fp8->reduce_weight_amaxes(weights, m.stream)) m.fp8->set_weight_amaxes_current(weights);
  }
  if (!g.exec) g.fp8_copies = copies;
  if (!g.exec && !capture_step()) {
    m.graph_status = g.failure;
    return LanguageModel::train_step(tokens, targets, cfg, lr);
  }
  FLASHLM_CUDA_CHECK(cudaGraphLaunch(g.exec, g.stream), "cudaGraphLaunch (train step)");
  gpu::stream_synchronize(g.stream);
  ++g.replays;
  m.adam->begin_step();
  // The host state the step leaves, as its eager run would.
  m.zero_pending = false;
  m.have_forward = false;
  m.norms_current = g.norms_current;
  m.materialized_segment = g.materialized_segment;
  m.pending_clip = g.out->data->adam.grad_scale;
  if (fused_amax) m.fp8->set_weight_amaxes_current(m.fp8_pass_weights());  // the graph's AdamW step wrote them
  if (copies) m.fp8->set_weight_copies_current(m.fp8_pass_weights());
  m.fp8_weights_bf16_stale = g.fp8_weights_bf16_stale;  // as the captured AdamW step leaves it
  m.graph_status = "on";
  return StepResult{m.mean_loss(g.rows->data), g.out->data->norm, true};
}

bool CudaModel::capture_step() {
  Impl& m = *impl_;
  StepGraph& g = *m.graph;
  const auto s = static_cast<cudaStream_t>(m.stream);
  auto* scalars = static_cast<DeviceStepScalars*>(g.scalars.data());
  // The host state the captured code changes, to restore when the capture fails.
  const bool zero_pending = m.zero_pending, norms_current = m.norms_current, have_forward = m.have_forward;
  const float pending_clip = m.pending_clip;
  const int64_t segment = m.materialized_segment;
  const bool bf16_stale = m.fp8_weights_bf16_stale;
  cudaGraph_t graph = nullptr;
  try {
    FLASHLM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    m.capturing = true;
    FLASHLM_CUDA_CHECK(cudaMemcpyAsync(scalars, g.in->data, sizeof(DeviceStepScalars), cudaMemcpyHostToDevice, s),
                       "cudaMemcpyAsync (step scalars)");
    zero_grad();
    queue_forward();
    FLASHLM_CUDA_CHECK(cudaMemcpyAsync(g.rows->data, m.row_loss.data(), size_t(m.n) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync (per-token losses)");
    backward();
    {
      // clip_gradients on the device: gradient_norm's sum of the per-parameter norms (or of one pass).
      ScopedRange range("clip_gradients");
      if (m.norms_current) {
        m.norms->join(m.stream);
        gpu::clip_on_device(static_cast<const double*>(m.partial_norms.data()), int64_t(m.layout.size()), scalars,
                            m.stream);
      } else {
        m.settle_gradients();
        auto* out = static_cast<double*>(m.reduce_out.data());
        if (m.bf16_gradients()) {
          gpu::squared_norm<bf16_t>(static_cast<const bf16_t*>(m.grads.data()), m.n_params, out, m.stream);
        } else {
          gpu::squared_norm<float>(static_cast<const float*>(m.grads.data()), m.n_params, out, m.stream);
        }
        gpu::clip_on_device(out, 1, scalars, m.stream);
      }
    }
    {
      memory_set_phase("optimizer");
      ScopedRange range("optimizer_step");
      m.queue_adamw(AdamWConfig{}, 0.0, &scalars->adam);
    }
    FLASHLM_CUDA_CHECK(cudaMemcpyAsync(g.out->data, scalars, sizeof(DeviceStepScalars), cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync (step scalars back)");
    m.capturing = false;
    FLASHLM_CUDA_CHECK(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
    FLASHLM_CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(graph);
  } catch (const std::exception& e) {
    m.capturing = false;
    abandon_capture(s, graph);  // the capture's error is reported as the reason, not by the next call
    g.exec = nullptr;
    g.failure = fmt::format("off: the step could not be captured ({})", e.what());
    m.zero_pending = zero_pending;
    m.norms_current = norms_current;
    m.have_forward = have_forward;
    m.pending_clip = pending_clip;
    m.materialized_segment = segment;
    m.fp8_weights_bf16_stale = bf16_stale;
    m.weights_changed();  // the captured host code moved FP8's amax flag, for work that never ran
    return false;
  }
  g.norms_current = m.norms_current;
  g.materialized_segment = m.materialized_segment;
  g.fp8_weights_bf16_stale = m.fp8_weights_bf16_stale;
  m.fp8_weights_bf16_stale = bf16_stale;  // until the graph runs
  return true;
}

}  // namespace flashlm
