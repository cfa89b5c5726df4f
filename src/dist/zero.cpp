// ZeRO-1 (include/flashlm/ddp.h): AdamW moments sharded across ranks. Each rank clips and updates its shard
// of the flat parameters with the model's own AdamW arithmetic (cpu::adamw_step, gpu::adamw_step), then the
// ranks gather each other's shards.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "core/check.h"
#include "flashlm/ddp.h"
#include "flashlm/dist.h"
#include "model/ops_cpu.h"

#ifdef FLASHLM_WITH_CUDA
#include "core/cuda_runtime.h"
#include "model/ops_cuda.h"
#endif

namespace flashlm {

struct ZeroOptimizer::Impl {
  Communicator& comm;
  DdpParameters params;
  int64_t grain = 0, n = 0, shard_elements = 0;
  DdpRange shard;                     // this rank's elements, within [0, n)
  std::vector<DdpRange> updated;      // the trainable runs within the shard
  std::vector<int64_t> counts;        // every rank's elements within [0, n), for the gather
  Buffer m, v;                        // shard_elements floats each, on the parameters' device
  int64_t steps = 0;
  bool masters_stale = false;         // other ranks' shards of the fp32 masters not gathered since a step
  // The masters the model reads in fp32 (DdpParameters::read_as_master), gathered with the working copy:
  // packed in flat order into one buffer, so one all-gather moves them (rank r's pieces are then at the
  // packed position of its shard, as all_gather_v expects).
  std::vector<DdpRange> read_ranges;  // ascending
  std::vector<int64_t> read_counts;   // every rank's packed elements
  Buffer read_packed;                 // sum(read_counts) floats (device)
#ifdef FLASHLM_WITH_CUDA
  Buffer norm_parts;  // one fp64 sum of squares per trainable run (device)
#endif

  Impl(Communicator& c, DdpParameters p) : comm(c), params(std::move(p)) {}

  bool cuda() const { return params.device == Device::cuda; }

  // Every rank's shard of the read_ranges masters: pack this rank's pieces, all-gather, unpack all (CUDA).
  void gather_read_masters(float* params_flat, void* stream) {
#ifdef FLASHLM_WITH_CUDA
    if (read_packed.data() == nullptr) return;
    auto* packed = static_cast<float*>(read_packed.data());
    const auto copy_pieces = [&](bool pack) {
      int64_t at = 0;
      for (const DdpRange& x : read_ranges) {
        const int64_t a = std::max(x.offset, shard.offset), b = std::min(x.offset + x.count, shard.offset + shard.count);
        if (pack && a < b) {  // this rank's piece, at its packed position
          cuda_copy_async(packed + at + (a - x.offset), params_flat + a, size_t(b - a) * sizeof(float), stream);
        }
        if (!pack) cuda_copy_async(params_flat + x.offset, packed + at, size_t(x.count) * sizeof(float), stream);
        at += x.count;
      }
    };
    copy_pieces(true);
    int64_t total = 0;
    for (int64_t c : read_counts) total += c;
    comm.all_gather_v(TensorView::contiguous(packed, DType::f32, {total}, Device::cuda), read_counts, stream);
    comm.wait(stream);
    copy_pieces(false);
#else
    (void)params_flat;
    (void)stream;
#endif
  }
  float* moment(const Buffer& b, const DdpRange& r) const {
    return static_cast<float*>(b.data()) + (r.offset - shard.offset);
  }

  // Σ of squares of the trainable gradients, summed across ranks. CPU: per grain-sized chunk of the flat
  // buffer (whole chunks per shard), the chunks' sums added in chunk order, as CpuModel::gradient_norm.
  double squared_norm(const float* grads, void* stream) {
    std::vector<double> mine;
    if (!cuda()) {
      const int64_t chunks = shard_elements / grain;
      const std::vector<DdpRange> trainable = params.trainable_ranges();
      mine.assign(size_t(chunks), 0.0);
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = shard.offset + c * grain, hi = std::min(lo + grain, shard.offset + shard.count);
        double ss = 0;
        for (const DdpRange& r : trainable) {
          const int64_t a = std::max(lo, r.offset), b = std::min(hi, r.offset + r.count);
          if (a < b) ss += cpu::sum_squares(grads + a, b - a);
        }
        mine[size_t(c)] = ss;
      }
    } else {
#ifdef FLASHLM_WITH_CUDA
      std::vector<double> parts(updated.size());
      auto* out = static_cast<double*>(norm_parts.data());
      for (size_t k = 0; k < updated.size(); ++k) gpu::squared_norm(grads + updated[k].offset, updated[k].count, out + k, stream);
      gpu::stream_synchronize(stream);
      if (!parts.empty()) cuda_copy(parts.data(), out, parts.size() * sizeof(double));
      double ss = 0;
      for (double p : parts) ss += p;
      mine.assign(1, ss);
#endif
    }
    std::vector<double> all(mine.size() * size_t(comm.world_size()));
    comm.all_gather(std::span<double>(mine), std::span<double>(all));
    double total = 0;
    for (double x : all) total += x;
    return total;
  }
};

ZeroOptimizer::ZeroOptimizer(Communicator& comm, DdpParameters params, int64_t grain)
    : impl_(std::make_unique<Impl>(comm, std::move(params))) {
  Impl& m = *impl_;
  m.params.validate();
  FLASHLM_CHECK(grain >= 1, "ZeroOptimizer: grain = {}, expected >= 1", grain);
  FLASHLM_CHECK(m.params.device == Device::cpu || Communicator::nccl_built(),
                "ZeroOptimizer: CUDA parameters need flashlm built with NCCL");
  m.grain = grain;
  m.n = m.params.flat_size();
  comm.agree(m.n, "the number of parameter elements");
  comm.agree(grain, "the ZeRO-1 shard grain");
  if (m.cuda()) comm.setup_cuda();
  const int64_t world = comm.world_size();
  const int64_t granules = (m.n + grain - 1) / grain;
  m.shard_elements = (granules + world - 1) / world * grain;
  for (int64_t r = 0; r < world; ++r) {
    m.counts.push_back(std::clamp(m.n - r * m.shard_elements, int64_t{0}, m.shard_elements));
  }
  const int64_t begin = std::min(m.n, comm.rank() * m.shard_elements);
  m.shard = {begin, m.counts[size_t(comm.rank())]};
  for (const DdpRange& r : m.params.trainable_ranges()) {
    const int64_t a = std::max(r.offset, m.shard.offset), b = std::min(r.offset + r.count, m.shard.offset + m.shard.count);
    if (a < b) m.updated.push_back({a, b - a});
  }
  const size_t bytes = size_t(m.shard_elements) * sizeof(float);
  m.m = Buffer::allocate(bytes, m.params.device, "ZeRO-1 AdamW first moment (shard)");
  m.v = Buffer::allocate(bytes, m.params.device, "ZeRO-1 AdamW second moment (shard)");
  m.read_ranges = m.params.read_as_master_ranges();
  for (int64_t r = 0; r < world; ++r) {
    const int64_t lo = r * m.shard_elements, hi = lo + m.shard_elements;
    int64_t count = 0;
    for (const DdpRange& x : m.read_ranges) count += std::max<int64_t>(0, std::min(hi, x.offset + x.count) - std::max(lo, x.offset));
    m.read_counts.push_back(count);
  }
  int64_t read_total = 0;
  for (int64_t c : m.read_counts) read_total += c;
  if (m.cuda() && read_total > 0) {
    m.read_packed = Buffer::allocate(size_t(read_total) * sizeof(float), Device::cuda, "ZeRO-1 fp32-read masters (packed)");
  }
  if (!m.cuda()) {
    std::memset(m.m.data(), 0, bytes);
    std::memset(m.v.data(), 0, bytes);
  } else {
#ifdef FLASHLM_WITH_CUDA
    gpu::memset_async(m.m.data(), 0, bytes, nullptr);
    gpu::memset_async(m.v.data(), 0, bytes, nullptr);
    gpu::stream_synchronize(nullptr);
    if (!m.updated.empty()) {
      m.norm_parts = Buffer::allocate(m.updated.size() * sizeof(double), Device::cuda, "ZeRO-1 norm partial sums");
    }
#endif
  }
}

ZeroOptimizer::~ZeroOptimizer() = default;

int64_t ZeroOptimizer::shard_elements() const { return impl_->shard_elements; }
DdpRange ZeroOptimizer::shard() const { return impl_->shard; }
int64_t ZeroOptimizer::state_bytes() const { return 2 * impl_->shard_elements * int64_t(sizeof(float)); }
int64_t ZeroOptimizer::steps() const { return impl_->steps; }

double ZeroOptimizer::step(float* params, float* grads, const AdamWConfig& c, double lr, void* stream) {
  return step(params, grads, nullptr, DType::f32, c, lr, stream);
}

double ZeroOptimizer::step(float* params, float* grads, void* working, DType working_dtype, const AdamWConfig& c,
                           double lr, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(params != nullptr && grads != nullptr, "ZeroOptimizer::step: null params or grads");
  FLASHLM_CHECK(working == nullptr || (m.cuda() && (working_dtype == DType::bf16 || working_dtype == DType::f16)),
                "ZeroOptimizer::step: a working copy must be bf16 or fp16 on cuda, got {} on {}",
                dtype_name(working_dtype), device_name(m.params.device));
  const double norm = std::sqrt(m.squared_norm(grads, stream));
  const bool clip = c.max_grad_norm > 0 && norm > c.max_grad_norm;
  const float scale = cpu::clip_scale(norm, c.max_grad_norm);
  ++m.steps;
  for (const DdpRange& r : m.updated) {
    float* w = params + r.offset;
    float* g = grads + r.offset;
    if (!m.cuda()) {
      if (clip) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < r.count; ++i) g[i] *= scale;
      }
      cpu::adamw_step(w, g, m.moment(m.m, r), m.moment(m.v, r), r.count, lr, c.beta1, c.beta2, c.eps, c.weight_decay,
                      m.steps);
    } else {
#ifdef FLASHLM_WITH_CUDA
      // The clip factor is applied inside the AdamW kernel (same product, one rounding), not by a pass of
      // its own; the stored gradients stay unclipped. With a working copy the kernel also writes this
      // shard of it, rounded as CudaModel::parameters_changed() would.
      const float gs = clip ? scale : 1.0f;
      if (working_dtype == DType::bf16 && working) {
        gpu::adamw_step<bf16_t>(w, g, m.moment(m.m, r), m.moment(m.v, r), r.count, lr, c.beta1, c.beta2, c.eps,
                                       c.weight_decay, m.steps, static_cast<bf16_t*>(working) + r.offset,
                                       stream, gs);
      } else if (working_dtype == DType::f16 && working) {
        gpu::adamw_step<fp16_t>(w, g, m.moment(m.m, r), m.moment(m.v, r), r.count, lr, c.beta1, c.beta2, c.eps,
                                c.weight_decay, m.steps, static_cast<fp16_t*>(working) + r.offset, stream, gs);
      } else {
        gpu::adamw_step<float>(w, g, m.moment(m.m, r), m.moment(m.v, r), r.count, lr, c.beta1, c.beta2, c.eps,
                               c.weight_decay, m.steps, nullptr, stream, gs);
      }
#endif
    }
  }
  if (working) {
    // Frozen elements of the shard were not updated, and their copy is already right on every rank.
    m.comm.all_gather_v(TensorView::contiguous(working, working_dtype, {m.n}, m.params.device), m.counts, stream);
    m.gather_read_masters(params, stream);
    m.masters_stale = m.comm.world_size() > 1;
  } else {
    m.comm.all_gather_v(TensorView::contiguous(params, DType::f32, {m.n}, m.params.device), m.counts, stream);
    m.masters_stale = false;
  }
  m.comm.wait(stream);
  return norm;
}

bool ZeroOptimizer::masters_stale() const { return impl_->masters_stale; }

void ZeroOptimizer::gather_masters(float* params, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(params != nullptr, "ZeroOptimizer::gather_masters: null params");
  m.comm.all_gather_v(TensorView::contiguous(params, DType::f32, {m.n}, m.params.device), m.counts, stream);
  m.comm.wait(stream);
  m.masters_stale = false;
}

namespace {

// Host copy of `count` floats of a CPU or CUDA buffer, and back.
void copy_floats(float* dst, const float* src, int64_t count, Device device_of_src_or_dst) {
  if (count == 0) return;
  if (device_of_src_or_dst == Device::cpu) {
    std::memcpy(dst, src, size_t(count) * sizeof(float));
    return;
  }
#ifdef FLASHLM_WITH_CUDA
  cuda_copy(dst, src, size_t(count) * sizeof(float));
#endif
}

}  // namespace

void ZeroOptimizer::gather_state(float* m_out, float* v_out) {
  Impl& m = *impl_;
  const auto s = size_t(m.shard_elements);
  std::vector<float> mine(s), all(s * size_t(m.comm.world_size()));
  for (auto [moment, out] : {std::pair{&m.m, m_out}, std::pair{&m.v, v_out}}) {
#ifdef FLASHLM_WITH_CUDA
    if (m.cuda()) cuda_synchronize();
#endif
    copy_floats(mine.data(), static_cast<const float*>(moment->data()), int64_t(s), m.params.device);
    m.comm.all_gather(std::span<float>(mine), std::span<float>(all));
    std::copy(all.begin(), all.begin() + m.n, out);
  }
}

void ZeroOptimizer::load_state(const float* m_in, const float* v_in, int64_t steps) {
  Impl& m = *impl_;
  FLASHLM_CHECK(steps >= 0, "ZeroOptimizer::load_state: steps = {}, expected >= 0", steps);
  std::vector<float> mine(size_t(m.shard_elements), 0.0f);
  for (auto [moment, in] : {std::pair{&m.m, m_in}, std::pair{&m.v, v_in}}) {
    std::copy(in + m.shard.offset, in + m.shard.offset + m.shard.count, mine.begin());
    copy_floats(static_cast<float*>(moment->data()), mine.data(), m.shard_elements, m.params.device);
  }
  m.steps = steps;
}

}  // namespace flashlm
