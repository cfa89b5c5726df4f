// ZeRO-1 (include/flashlm/zero.h): AdamW moments sharded across ranks. Each rank clips and updates its shard
// of the flat parameters with the model's own AdamW arithmetic (cpu::adamw_step, gpu::adamw_step), then the
// ranks gather each other's shards. The shard is one contiguous run of the flat buffers, or (per bucket)
// one run per DDP bucket plus the buckets' replicated tails; either way a list of updated runs whose
// moments are packed one after the other.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "core/check.h"
#include "dist/values.h"
#include "flashlm/dist.h"
#include "flashlm/zero.h"
#include "optim/optimizer.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/array_ops.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#endif

namespace flashlm {

ZeroBucketLayout zero_bucket_layout(std::span<const DdpBucket> buckets, int world, int rank) {
  FLASHLM_CHECK(world >= 1 && 0 <= rank && rank < world, "zero_bucket_layout: rank {} of a world of {}", rank, world);
  ZeroBucketLayout layout;
  for (const DdpBucket& b : buckets) {
    FLASHLM_CHECK(b.ranges.size() == 1, "zero_bucket_layout: a bucket of {} ranges, expected one contiguous range",
                  b.ranges.size());
    const DdpRange& r = b.ranges.front();
    ZeroBucketShard shard;
    shard.offset = r.offset;
    shard.part = b.replicated ? 0 : r.count / world;
    shard.owned = {r.offset + rank * shard.part, shard.part};
    shard.tail = {r.offset + world * shard.part, r.count - world * shard.part};
    layout.shard_elements += shard.part + shard.tail.count;
    layout.buckets.push_back(shard);
  }
  return layout;
}

// A run of trainable elements this rank updates.
struct ZeroRun {
  DdpRange range;          // elements of the flat buffers
  int64_t moment_at = 0;   // its first element in the packed moments
  bool in_norm = true;     // its squares count in this rank's part of the norm (a replicated tail: rank 0's)
};

struct ZeroOptimizer::Impl {
  Communicator& comm;
  DdpParameters params;
  int64_t grain = 0, n = 0, shard_elements = 0;
  bool per_bucket = false;
  bool gather_after_step = true;      // false: FSDP gathers the parts when the model reads them
  DdpRange shard;                     // contiguous: this rank's elements, within [0, n)
  std::vector<int64_t> counts;        // contiguous: every rank's elements within [0, n), for the gather
  std::vector<Communicator::Segment> segments;  // per bucket: each bucket's parts, for the gather
  std::vector<ZeroRun> updated;       // ascending, their moments packed in the same order
  // `updated` with the runs that touch (in the flat buffers and in the moments) and count alike in the norm
  // merged: what the norm and AdamW kernels run over. At one rank every bucket touches the next, so a step
  // is one norm and one AdamW over the whole model, as the model's own, not one of each per bucket.
  std::vector<ZeroRun> launches;
  Buffer m, v;                        // shard_elements floats each, on the parameters' device
  int64_t steps = 0;
  bool masters_stale = false;         // other ranks' shards of the fp32 masters not gathered since a step
  // FSDP's sharded storage: the parameters, gradients and working copy passed to step() hold this rank's
  // runs packed as the moments are (a run at moment_at), not the flat buffers.
  bool packed = false;
  int64_t at(const ZeroRun& r) const { return packed ? r.moment_at : r.range.offset; }
  // bf16-pure (use_bf16_state): the moments are bf16, and step_bf16 rounds the fp32 gradients it is given
  // into `rounded` (bf16, shard_elements) once before the norm and the update read them.
  bool bf16_state = false;
  Buffer rounded;
  // The masters the model reads in fp32 (DdpParameters::read_as_master), gathered with the working copy.
  std::vector<std::vector<DdpRange>> read_pieces;  // every rank's pieces of them, ascending
  std::vector<int64_t> read_counts;                // every rank's elements of them
  Buffer read_packed;                              // the pieces packed rank after rank (device)
#ifdef FLASHLM_WITH_CUDA
  Buffer norm_parts;  // one fp64 sum of squares per launch run (device)
#endif

  // Per bucket on CUDA, the gather after a step is not waited for: it is queued in chunks of buckets in
  // ascending order (the order the forward reads them), an event after each, and the model's stream waits
  // for a chunk only when the forward is about to read it (await; LanguageModel's ParametersNeededHook), so
  // that the next forward overlaps the rest of the gather.
  struct GatherChunk {
    int64_t begin = 0, end = 0;                   // the elements its buckets cover
    std::vector<Communicator::Segment> segments;  // its buckets' parts
#ifdef FLASHLM_WITH_CUDA
    cudaEvent_t gathered = nullptr;  // recorded on the communicator's stream after its gather
#endif
    bool awaited = true;  // the model's stream has waited for its last gather
  };
  std::vector<GatherChunk> chunks;
  bool gather_pending() const {
    return std::any_of(chunks.begin(), chunks.end(), [](const GatherChunk& c) { return !c.awaited; });
  }

  Impl(Communicator& c, DdpParameters p) : comm(c), params(std::move(p)) {}
  ~Impl() {
#ifdef FLASHLM_WITH_CUDA
    for (GatherChunk& c : chunks) {
      if (c.gathered) cudaEventDestroy(c.gathered);
    }
#endif
  }

  // Chunks of whole buckets, ascending, of at least kChunkElements each (fewer, larger NCCL groups: one
  // group per bucket was slower), with their events (CUDA only).
  void plan_gather_chunks(const std::vector<DdpRange>& bucket_extents) {
#ifdef FLASHLM_WITH_CUDA
    if (!cuda()) return;
    constexpr int64_t kChunkElements = int64_t{32} << 20;
    std::vector<size_t> order(segments.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return bucket_extents[a].offset < bucket_extents[b].offset; });
    for (size_t i : order) {
      if (chunks.empty() || chunks.back().end - chunks.back().begin >= kChunkElements) {
        chunks.emplace_back();
        chunks.back().begin = bucket_extents[i].offset;
        FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&chunks.back().gathered, cudaEventDisableTiming),
                           "cudaEventCreateWithFlags (ZeRO-1 gather)");
      }
      chunks.back().end = bucket_extents[i].offset + bucket_extents[i].count;
      chunks.back().segments.push_back(segments[i]);
    }
#else
    (void)bucket_extents;
#endif
  }

  // Queues every chunk's all-gather of `x` after the work on `stream`, without making `stream` wait.
  void queue_chunked_gather(const TensorView& x, void* stream) {
#ifdef FLASHLM_WITH_CUDA
    for (GatherChunk& c : chunks) {
      comm.all_gather_segments(x, c.segments, stream);
      FLASHLM_CUDA_CHECK(cudaEventRecord(c.gathered, static_cast<cudaStream_t>(comm.cuda_stream())),
                         "cudaEventRecord (ZeRO-1 gather)");
      c.awaited = false;
    }
#else
    (void)x;
    (void)stream;
#endif
  }

  // `stream` waits for the pending gather of the chunks that hold any of [offset, offset + count).
  void await(int64_t offset, int64_t count, void* stream) {
#ifdef FLASHLM_WITH_CUDA
    for (GatherChunk& c : chunks) {
      if (!c.awaited && c.begin < offset + count && offset < c.end) {
        FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), c.gathered, 0),
                           "cudaStreamWaitEvent (ZeRO-1 gather)");
        c.awaited = true;
      }
    }
#else
    (void)offset;
    (void)count;
    (void)stream;
#endif
  }

  bool cuda() const { return params.device == Device::cuda; }
  // The elements rank r updates and no other rank does: its contiguous shard, or its part of every bucket
  // (the replicated tails are updated everywhere and need no gather).
  std::vector<DdpRange> owned_by(int64_t r) const {
    if (!per_bucket) {
      const int64_t lo = std::min(n, r * shard_elements);
      return {{lo, std::min(n, lo + shard_elements) - lo}};
    }
    std::vector<DdpRange> owned;
    for (const Communicator::Segment& s : segments) {
      if (s.part > 0) owned.push_back({s.offset + r * s.part, s.part});
    }
    return owned;
  }

  // After the layout is set: every rank's pieces of the read_as_master masters, packed rank after rank, so
  // that one all_gather_v moves them (CUDA with a working copy only; the fp32 path gathers every master).
  void plan_read_gather() {
    if (!cuda()) return;
    const std::vector<DdpRange> reads = params.read_as_master_ranges();
    int64_t total = 0;
    for (int64_t r = 0; r < comm.world_size(); ++r) {
      std::vector<DdpRange> pieces;
      int64_t count = 0;
      for (const DdpRange& o : owned_by(r)) {
        for (const DdpRange& x : reads) {
          const int64_t a = std::max(o.offset, x.offset), b = std::min(o.offset + o.count, x.offset + x.count);
          if (a < b) pieces.push_back({a, b - a}), count += b - a;
        }
      }
      read_pieces.push_back(std::move(pieces));
      read_counts.push_back(count);
      total += count;
    }
    if (total > 0) {
      read_packed = Buffer::allocate(size_t(total) * sizeof(float), Device::cuda, "ZeRO-1 fp32-read masters (packed)");
    }
  }

  // Every rank's pieces of the read_as_master masters: pack this rank's, all-gather, unpack the others'.
  void gather_read_masters(float* params_flat, void* stream) {
#ifdef FLASHLM_WITH_CUDA
    if (read_packed.data() == nullptr) return;
    auto* packed = static_cast<float*>(read_packed.data());
    int64_t total = 0;
    for (int64_t c : read_counts) total += c;
    const auto copy_pieces = [&](int64_t rank, bool pack) {
      int64_t at = 0;
      for (int64_t r = 0; r < rank; ++r) at += read_counts[size_t(r)];
      for (const DdpRange& x : read_pieces[size_t(rank)]) {
        const size_t bytes = size_t(x.count) * sizeof(float);
        if (pack) cuda_copy_async(packed + at, params_flat + x.offset, bytes, stream);
        else cuda_copy_async(params_flat + x.offset, packed + at, bytes, stream);
        at += x.count;
      }
    };
    copy_pieces(comm.rank(), true);
    comm.all_gather_v(TensorView::contiguous(packed, DType::f32, {total}, Device::cuda), read_counts, stream);
    comm.wait(stream);
    for (int64_t r = 0; r < comm.world_size(); ++r) {
      if (r != comm.rank()) copy_pieces(r, false);
    }
#else
    (void)params_flat;
    (void)stream;
#endif
  }

  float* moment(const Buffer& b, const ZeroRun& r) const { return static_cast<float*>(b.data()) + r.moment_at; }
  bf16_t* moment_bf16(const Buffer& b, const ZeroRun& r) const { return static_cast<bf16_t*>(b.data()) + r.moment_at; }
  size_t moment_size() const { return bf16_state ? sizeof(bf16_t) : sizeof(float); }

  void plan_launches() {
    launches.clear();
    for (const ZeroRun& r : updated) {
      if (!launches.empty()) {
        ZeroRun& last = launches.back();
        if (last.range.offset + last.range.count == r.range.offset &&
            last.moment_at + last.range.count == r.moment_at && last.in_norm == r.in_norm) {
          last.range.count += r.range.count;
          continue;
        }
      }
      launches.push_back(r);
    }
  }

  // Both layouts: checks, agreement, the CUDA set-up.
  void validate() {
    params.validate();
    FLASHLM_CHECK(params.device == Device::cpu || Communicator::nccl_built(),
                  "ZeroOptimizer: CUDA parameters need flashlm built with NCCL");
    n = params.flat_size();
    comm.agree(n, "the number of parameter elements");
    comm.agree(per_bucket ? 1 : 0, "the ZeRO-1 layout (0: contiguous, 1: per bucket)");
    if (cuda()) comm.setup_cuda();
  }

  // The moments (zero) and the norm's partial sums, once `updated` and shard_elements are known.
  void allocate() {
    const size_t bytes = size_t(shard_elements) * moment_size();
    m = Buffer();  // freed before the next pair is allocated (use_bf16_state replaces the fp32 pair)
    v = Buffer();
    m = Buffer::allocate(bytes, params.device, bf16_state ? "ZeRO AdamW first moment (bf16 shard)"
                                                          : "ZeRO-1 AdamW first moment (shard)");
    v = Buffer::allocate(bytes, params.device, bf16_state ? "ZeRO AdamW second moment (bf16 shard)"
                                                          : "ZeRO-1 AdamW second moment (shard)");
    if (!cuda()) {
      std::memset(m.data(), 0, bytes);
      std::memset(v.data(), 0, bytes);
      return;
    }
#ifdef FLASHLM_WITH_CUDA
    gpu::memset_async(m.data(), 0, bytes, nullptr);
    gpu::memset_async(v.data(), 0, bytes, nullptr);
    gpu::stream_synchronize(nullptr);
    if (!launches.empty()) {
      norm_parts = Buffer::allocate(launches.size() * sizeof(double), Device::cuda, "ZeRO-1 norm partial sums");
    }
#endif
  }

  // Every rank's updated parameters (or working copy) gathered into `x` on every rank.
  void gather(const TensorView& x, void* stream) {
    if (per_bucket) comm.all_gather_segments(x, segments, stream);
    else comm.all_gather_v(x, counts, stream);
  }

  // Σ of squares of the trainable gradients, summed across ranks. CPU, contiguous: per grain-sized chunk of
  // the flat buffer (whole chunks per shard), the chunks' sums added in chunk order, as
  // CpuModel::gradient_norm. Otherwise one partial sum per rank over its runs in the norm (each replicated
  // tail counted once, by rank 0), so that no rank reads a gradient outside the elements it updates.
  // T: float, or bf16_t for step_bf16's rounded gradients (per bucket only).
  template <class T>
  double squared_norm(const T* grads, void* stream) {
    std::vector<double> mine;
    if (!cuda() && per_bucket) {
      double ss = 0;
      for (const ZeroRun& r : launches) {
        if (r.in_norm) ss += cpu::sum_squares(grads + at(r), r.range.count);
      }
      mine.assign(1, ss);
    } else if (!cuda()) {
      if constexpr (std::is_same_v<T, float>) {
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
      }
    } else {
#ifdef FLASHLM_WITH_CUDA
      std::vector<double> parts(launches.size());
      auto* out = static_cast<double*>(norm_parts.data());
      for (size_t k = 0; k < launches.size(); ++k) {
        if (launches[k].in_norm) {
          gpu::squared_norm<T>(grads + at(launches[k]), launches[k].range.count, out + k, stream);
        }
      }
      gpu::stream_synchronize(stream);
      if (!parts.empty()) cuda_copy(parts.data(), out, parts.size() * sizeof(double));
      double ss = 0;
      for (size_t k = 0; k < parts.size(); ++k) {
        if (launches[k].in_norm) ss += parts[k];
      }
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
  FLASHLM_CHECK(grain >= 1, "ZeroOptimizer: grain = {}, expected >= 1", grain);
  m.validate();
  m.grain = grain;
  comm.agree(grain, "the ZeRO-1 shard grain");
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
    if (a < b) m.updated.push_back({{a, b - a}, a - m.shard.offset, true});
  }
  m.plan_launches();
  m.allocate();
  m.plan_read_gather();
}

ZeroOptimizer::ZeroOptimizer(Communicator& comm, DdpParameters params, std::span<const DdpBucket> buckets,
                             bool gather_after_step)
    : impl_(std::make_unique<Impl>(comm, std::move(params))) {
  Impl& m = *impl_;
  m.per_bucket = true;
  m.gather_after_step = gather_after_step;
  m.validate();
  comm.agree(static_cast<int64_t>(buckets.size()), "the number of ZeRO-1 buckets");
  // Only trainable elements may be updated: a bucket is DataParallel's (trainable owners), checked here
  // because a frozen element inside one would silently train.
  const std::vector<DdpRange> trainable = m.params.trainable_ranges();
  const ZeroBucketLayout layout = zero_bucket_layout(buckets, comm.world_size(), comm.rank());
  std::vector<DdpRange> extents;  // each bucket's elements: its parts and its tail
  for (const ZeroBucketShard& s : layout.buckets) {
    const DdpRange whole{s.offset, s.part * comm.world_size() + s.tail.count};
    FLASHLM_CHECK(whole.offset + whole.count <= m.n &&
                      std::any_of(trainable.begin(), trainable.end(),
                                  [&](const DdpRange& t) {
                                    return t.offset <= whole.offset && whole.offset + whole.count <= t.offset + t.count;
                                  }),
                  "ZeroOptimizer: bucket [{}, {}) is not a run of trainable parameter elements", whole.offset,
                  whole.offset + whole.count);
    m.segments.push_back({s.offset, s.part});
    extents.push_back(whole);
    if (s.owned.count > 0) m.updated.push_back({s.owned, 0, true});
    if (s.tail.count > 0) m.updated.push_back({s.tail, 0, comm.rank() == 0});
  }
  m.shard_elements = layout.shard_elements;
  std::sort(m.updated.begin(), m.updated.end(),
            [](const ZeroRun& a, const ZeroRun& b) { return a.range.offset < b.range.offset; });
  for (size_t k = 1; k < m.updated.size(); ++k) {
    const DdpRange& prev = m.updated[k - 1].range;
    FLASHLM_CHECK(prev.offset + prev.count <= m.updated[k].range.offset, "ZeroOptimizer: buckets overlap at element {}",
                  m.updated[k].range.offset);
  }
  // The moments packed in ascending order (updated_ranges(): the order of a sharded checkpoint's arrays).
  int64_t at = 0;
  for (ZeroRun& r : m.updated) r.moment_at = at, at += r.range.count;
  m.plan_launches();
  m.allocate();
  if (!gather_after_step) return;
  m.plan_read_gather();
  m.plan_gather_chunks(extents);
}

ZeroOptimizer::~ZeroOptimizer() = default;

bool ZeroOptimizer::per_bucket() const { return impl_->per_bucket; }
int64_t ZeroOptimizer::shard_elements() const { return impl_->shard_elements; }

DdpRange ZeroOptimizer::shard() const {
  FLASHLM_CHECK(!impl_->per_bucket, "ZeroOptimizer::shard: the per-bucket layout has one run per bucket; use "
                                    "updated_ranges()");
  return impl_->shard;
}

std::vector<DdpRange> ZeroOptimizer::updated_ranges() const {
  std::vector<DdpRange> out;
  for (const ZeroRun& r : impl_->updated) out.push_back(r.range);
  return out;
}

int64_t ZeroOptimizer::state_bytes() const { return 2 * impl_->shard_elements * int64_t(impl_->moment_size()); }
int64_t ZeroOptimizer::steps() const { return impl_->steps; }

double ZeroOptimizer::step(float* params, float* grads, const AdamWConfig& c, double lr, void* stream) {
  return step(params, grads, nullptr, DType::f32, c, lr, stream);
}

double ZeroOptimizer::step(float* params, float* grads, void* working, DType working_dtype, const AdamWConfig& c,
                           double lr, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(!m.bf16_state, "ZeroOptimizer::step: bf16 moments (use_bf16_state) are stepped by step_bf16");
  FLASHLM_CHECK(params != nullptr && grads != nullptr, "ZeroOptimizer::step: null params or grads");
  FLASHLM_CHECK(working == nullptr || (m.cuda() && (working_dtype == DType::bf16 || working_dtype == DType::f16)),
                "ZeroOptimizer::step: a working copy must be bf16 or fp16 on cuda, got {} on {}",
                dtype_name(working_dtype), device_name(m.params.device));
  await_parameters(stream);  // the last step's gather reads the parts this step rewrites
  const double norm = std::sqrt(m.squared_norm(grads, stream));
  const bool clip = c.max_grad_norm > 0 && norm > c.max_grad_norm;
  const float scale = cpu::clip_scale(norm, c.max_grad_norm);
  ++m.steps;
  for (const ZeroRun& run : m.launches) {
    const DdpRange& r = run.range;
    const int64_t first = m.at(run);
    float* w = params + first;
    float* g = grads + first;
    float *mo = m.moment(m.m, run), *vo = m.moment(m.v, run);
    if (!m.cuda()) {
      if (clip) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < r.count; ++i) g[i] *= scale;
      }
      cpu::adamw_step(w, g, mo, vo, r.count, lr, c.beta1, c.beta2, c.eps, c.weight_decay, m.steps);
    } else {
#ifdef FLASHLM_WITH_CUDA
      // The clip factor is applied inside the AdamW kernel (same product, one rounding), not by a pass of
      // its own; the stored gradients stay unclipped. With a working copy the kernel also writes this
      // shard of it, rounded as CudaModel::parameters_changed() would.
      const float gs = clip ? scale : 1.0f;
      if (working_dtype == DType::bf16 && working) {
        gpu::adamw_step<bf16_t>(w, g, mo, vo, r.count, lr, c.beta1, c.beta2, c.eps, c.weight_decay, m.steps,
                                static_cast<bf16_t*>(working) + first, stream, gs);
      } else if (working_dtype == DType::f16 && working) {
        gpu::adamw_step<fp16_t>(w, g, mo, vo, r.count, lr, c.beta1, c.beta2, c.eps, c.weight_decay, m.steps,
                                static_cast<fp16_t*>(working) + first, stream, gs);
      } else {
        gpu::adamw_step<float>(w, g, mo, vo, r.count, lr, c.beta1, c.beta2, c.eps, c.weight_decay, m.steps, nullptr,
                               stream, gs);
      }
#endif
    }
  }
  if (!m.gather_after_step) {
    m.masters_stale = !m.packed && m.comm.world_size() > 1;
    return norm;
  }
  if (!m.chunks.empty()) {
    // Per bucket on CUDA: the fp32-read masters now (small, and the embedding is read first), the rest in
    // chunks that the next forward waits for as it reaches them.
    if (working) m.gather_read_masters(params, stream);
    m.queue_chunked_gather(working ? TensorView::contiguous(working, working_dtype, {m.n}, m.params.device)
                                   : TensorView::contiguous(params, DType::f32, {m.n}, m.params.device),
                           stream);
    m.masters_stale = working != nullptr && m.comm.world_size() > 1;
    return norm;
  }
  if (working) {
    // Frozen elements of the shard were not updated, and their copy is already right on every rank.
    m.gather(TensorView::contiguous(working, working_dtype, {m.n}, m.params.device), stream);
    m.gather_read_masters(params, stream);
    m.masters_stale = m.comm.world_size() > 1;
  } else {
    m.gather(TensorView::contiguous(params, DType::f32, {m.n}, m.params.device), stream);
    m.masters_stale = false;
  }
  m.comm.wait(stream);
  return norm;
}

bool ZeroOptimizer::masters_stale() const { return impl_->masters_stale; }

void ZeroOptimizer::use_bf16_state() {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.packed, "ZeroOptimizer::use_bf16_state: FSDP's packed storage only (use_packed_storage first)");
  FLASHLM_CHECK(m.steps == 0, "ZeroOptimizer::use_bf16_state: after {} steps; call it before the first", m.steps);
  if (m.bf16_state) return;
  m.bf16_state = true;
  m.allocate();
  m.rounded = Buffer::allocate(size_t(m.shard_elements) * sizeof(bf16_t), m.params.device,
                               "FSDP gradients (bf16 shard, rounded for AdamW)");
}

bool ZeroOptimizer::bf16_state() const { return impl_->bf16_state; }

double ZeroOptimizer::step_bf16(bf16_t* params, const float* grads, const AdamWConfig& c, double lr, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.bf16_state, "ZeroOptimizer::step_bf16: needs bf16 moments (use_bf16_state)");
  FLASHLM_CHECK(params != nullptr && grads != nullptr, "ZeroOptimizer::step_bf16: null params or grads");
  // The averaged fp32 gradients rounded once (nearest even), as the one-process bf16-pure backward rounds
  // its fp32 accumulator into the bf16 gradient; the norm and the update read the rounded values.
  auto* g16 = static_cast<bf16_t*>(m.rounded.data());
  const int64_t count = m.shard_elements;
  if (!m.cuda()) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) g16[i] = bf16_t(grads[i]);
  } else {
#ifdef FLASHLM_WITH_CUDA
    gpu::cast_from_f32<bf16_t>(grads, g16, count, stream);
#endif
  }
  const double norm = std::sqrt(m.squared_norm<bf16_t>(g16, stream));
  const bool clip = c.max_grad_norm > 0 && norm > c.max_grad_norm;
  const float gs = clip ? cpu::clip_scale(norm, c.max_grad_norm) : 1.0f;
  ++m.steps;
  for (const ZeroRun& run : m.launches) {
    const int64_t first = m.at(run);
    bf16_t *mo = m.moment_bf16(m.m, run), *vo = m.moment_bf16(m.v, run);
    if (!m.cuda()) {
      cpu::adamw_step_bf16(params + first, g16 + first, mo, vo, run.range.count, lr, c.beta1, c.beta2, c.eps,
                           c.weight_decay, m.steps, gs);
    } else {
#ifdef FLASHLM_WITH_CUDA
      gpu::adamw_step_bf16(params + first, g16 + first, mo, vo, run.range.count, lr, c.beta1, c.beta2, c.eps,
                           c.weight_decay, m.steps, stream, gs);
#endif
    }
  }
  return norm;
}

void ZeroOptimizer::use_packed_storage() {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.per_bucket && !m.gather_after_step,
                "ZeroOptimizer::use_packed_storage: FSDP's per-bucket layout without a gather after the step only");
  m.packed = true;
  m.masters_stale = false;
}

void ZeroOptimizer::await_parameters(int64_t offset, int64_t count, void* stream) {
  impl_->await(offset, count, stream);
}

void ZeroOptimizer::await_parameters(void* stream) {
  Impl& m = *impl_;
  if (!m.gather_pending()) return;
  m.comm.wait(stream);  // every collective queued so far, the whole gather among them
  for (Impl::GatherChunk& c : m.chunks) c.awaited = true;
}

void ZeroOptimizer::gather_masters(float* params, void* stream) {
  Impl& m = *impl_;
  await_parameters(stream);
  FLASHLM_CHECK(params != nullptr, "ZeroOptimizer::gather_masters: null params");
  m.gather(TensorView::contiguous(params, DType::f32, {m.n}, m.params.device), stream);
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

void values_to_host(float* host, const void* src, int64_t count, bool bf16, Device device) {
  if (!bf16) return copy_floats(host, static_cast<const float*>(src), count, device);
  if (count == 0) return;
  std::vector<bf16_t> staged(static_cast<size_t>(count));
  if (device == Device::cpu) std::memcpy(staged.data(), src, staged.size() * sizeof(bf16_t));
#ifdef FLASHLM_WITH_CUDA
  else cuda_copy(staged.data(), src, staged.size() * sizeof(bf16_t));
#endif
  for (size_t i = 0; i < staged.size(); ++i) host[i] = float(staged[i]);
}

void values_from_host(void* dst, const float* host, int64_t count, bool bf16, Device device) {
  if (!bf16) return copy_floats(static_cast<float*>(dst), host, count, device);
  if (count == 0) return;
  std::vector<bf16_t> staged(static_cast<size_t>(count));
  for (size_t i = 0; i < staged.size(); ++i) staged[i] = bf16_t(host[i]);
  if (device == Device::cpu) std::memcpy(dst, staged.data(), staged.size() * sizeof(bf16_t));
#ifdef FLASHLM_WITH_CUDA
  else cuda_copy(dst, staged.data(), staged.size() * sizeof(bf16_t));
#endif
}

void ZeroOptimizer::gather_state(float* m_out, float* v_out) {
  Impl& m = *impl_;
#ifdef FLASHLM_WITH_CUDA
  if (m.cuda()) cuda_synchronize();
#endif
  const auto s = size_t(m.shard_elements);
  std::vector<float> mine(s);
  if (m.per_bucket) {
    // Each rank places its parts (and the tails, equal everywhere) in a full host array; the host gather of
    // the parts then completes it on every rank.
    for (auto [moment, out] : {std::pair{&m.m, m_out}, std::pair{&m.v, v_out}}) {
      values_to_host(mine.data(), moment->data(), int64_t(s), m.bf16_state, m.params.device);
      std::fill(out, out + m.n, 0.0f);
      for (const ZeroRun& r : m.updated) {
        std::copy_n(mine.begin() + r.moment_at, r.range.count, out + r.range.offset);
      }
      m.comm.all_gather_segments(TensorView::contiguous(out, DType::f32, {m.n}), m.segments);
    }
    return;
  }
  std::vector<float> all(s * size_t(m.comm.world_size()));
  for (auto [moment, out] : {std::pair{&m.m, m_out}, std::pair{&m.v, v_out}}) {
    copy_floats(mine.data(), static_cast<const float*>(moment->data()), int64_t(s), m.params.device);
    m.comm.all_gather(std::span<float>(mine), std::span<float>(all));
    std::copy(all.begin(), all.begin() + m.n, out);
  }
}

void ZeroOptimizer::save_shard(float* m_out, float* v_out) const {
  const Impl& m = *impl_;
#ifdef FLASHLM_WITH_CUDA
  if (m.cuda()) cuda_synchronize();
#endif
  values_to_host(m_out, m.m.data(), m.shard_elements, m.bf16_state, m.params.device);
  values_to_host(v_out, m.v.data(), m.shard_elements, m.bf16_state, m.params.device);
}

void ZeroOptimizer::load_shard(const float* m_in, const float* v_in, int64_t steps) {
  Impl& m = *impl_;
  FLASHLM_CHECK(steps >= 0, "ZeroOptimizer::load_shard: steps = {}, expected >= 0", steps);
  values_from_host(m.m.data(), m_in, m.shard_elements, m.bf16_state, m.params.device);
  values_from_host(m.v.data(), v_in, m.shard_elements, m.bf16_state, m.params.device);
  m.steps = steps;
}

void ZeroOptimizer::load_state(const float* m_in, const float* v_in, int64_t steps) {
  Impl& m = *impl_;
  FLASHLM_CHECK(steps >= 0, "ZeroOptimizer::load_state: steps = {}, expected >= 0", steps);
  std::vector<float> mine(size_t(m.shard_elements), 0.0f);
  for (auto [moment, in] : {std::pair{&m.m, m_in}, std::pair{&m.v, v_in}}) {
    if (m.per_bucket) {
      for (const ZeroRun& r : m.updated) std::copy_n(in + r.range.offset, r.range.count, mine.begin() + r.moment_at);
    } else {
      std::copy(in + m.shard.offset, in + m.shard.offset + m.shard.count, mine.begin());
    }
    values_from_host(moment->data(), mine.data(), m.shard_elements, m.bf16_state, m.params.device);
  }
  m.steps = steps;
}

}  // namespace flashlm
