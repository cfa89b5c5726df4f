// Data-parallel gradient synchronisation (include/flashlm/ddp.h): the parameters' description, the bucket
// plans, and DataParallel's variants as one mechanism (a bucket plan, launched after the backward or as
// buckets complete). DdpModel, which wires it to a LanguageModel, is in ddp_model.cpp.
#include "flashlm/ddp.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "flashlm/dist.h"
#include "flashlm/fsdp.h"
#include "flashlm/zero.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#include "core/array_ops.h"
#endif

namespace flashlm {

std::string_view ddp_variant_name(DdpVariant variant) {
  switch (variant) {
    case DdpVariant::per_param: return "per-param";
    case DdpVariant::flat: return "flat";
    case DdpVariant::async: return "async";
    case DdpVariant::bucketed: return "bucketed";
    case DdpVariant::fsdp: return "fsdp";
  }
  return "?";
}

DdpVariant parse_ddp_variant(std::string_view name) {
  for (DdpVariant v :
       {DdpVariant::per_param, DdpVariant::flat, DdpVariant::async, DdpVariant::bucketed, DdpVariant::fsdp}) {
    if (name == ddp_variant_name(v)) return v;
  }
  fail_argument("unknown DDP variant '{}': expected per-param, flat, async, bucketed or fsdp", name);
}

DType parse_reduce_dtype(std::string_view name) {
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    if (name == dtype_name(t)) return t;
  }
  fail_argument("unknown gradient reduction type '{}': expected fp32, bf16 or fp16", name);
}

namespace {

// Ascending runs of [offset, offset + count) ranges, adjacent ones merged.
std::vector<DdpRange> merge_ranges(std::vector<DdpRange> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const DdpRange& a, const DdpRange& b) { return a.offset < b.offset; });
  std::vector<DdpRange> out;
  for (const DdpRange& r : ranges) {
    if (!out.empty() && out.back().offset + out.back().count == r.offset) out.back().count += r.count;
    else out.push_back(r);
  }
  return out;
}

#ifdef FLASHLM_WITH_CUDA
// n gradients between the fp32 buffer and a staging area of T, on `stream`: rounded to T on the way in
// (to_staging), widened back (exactly) on the way out. T = float copies.
template <class T>
void convert_staged(float* grads, void* staged, int64_t n, bool to_staging, void* stream) {
  if (to_staging) gpu::cast_from_f32<T>(grads, static_cast<T*>(staged), n, stream);
  else gpu::cast_to_f32<T>(static_cast<const T*>(staged), grads, n, stream);
}

void convert_staged(DType type, float* grads, void* staged, int64_t n, bool to_staging, void* stream) {
  switch (type) {
    case DType::bf16: return convert_staged<bf16_t>(grads, staged, n, to_staging, stream);
    case DType::f16: return convert_staged<fp16_t>(grads, staged, n, to_staging, stream);
    default: return convert_staged<float>(grads, staged, n, to_staging, stream);
  }
}
#endif

}  // namespace

DdpParameters DdpParameters::of(const LanguageModel& model) {
  DdpParameters p;
  p.layout = model.layout();
  p.device = model.device();
  p.read_as_master = model.master_read_parameters();
  return p;
}

int64_t DdpParameters::flat_size() const {
  int64_t end = 0;
  for (const auto& p : layout) end = std::max(end, p.offset + p.numel());
  return end;
}

void DdpParameters::validate() const {
  const auto n = static_cast<int64_t>(layout.size());
  FLASHLM_CHECK(n > 0, "DdpParameters: the layout is empty");
  FLASHLM_CHECK(trainable.empty() || static_cast<int64_t>(trainable.size()) == n,
                "DdpParameters: trainable has {} entries for {} parameters", trainable.size(), n);
  FLASHLM_CHECK(tied_to.empty() || static_cast<int64_t>(tied_to.size()) == n,
                "DdpParameters: tied_to has {} entries for {} parameters", tied_to.size(), n);
  std::vector<DdpRange> owned;
  for (int64_t i = 0; i < n; ++i) {
    const ParameterInfo& p = layout[size_t(i)];
    FLASHLM_CHECK(p.offset >= 0 && p.numel() > 0, "DdpParameters: parameter '{}' has offset {} and {} elements",
                  p.name, p.offset, p.numel());
    const int64_t j = tied_to.empty() ? -1 : tied_to[size_t(i)];
    if (j < 0) {
      owned.push_back({p.offset, p.numel()});
      continue;
    }
    FLASHLM_CHECK(j < n && j != i, "DdpParameters: '{}' is tied to parameter {}, expected another of 0..{}", p.name,
                  j, n - 1);
    const ParameterInfo& q = layout[size_t(j)];
    FLASHLM_CHECK(tied_to[size_t(j)] < 0, "DdpParameters: '{}' is tied to '{}', which is itself tied", p.name, q.name);
    FLASHLM_CHECK(p.offset == q.offset && p.shape == q.shape,
                  "DdpParameters: '{}' is tied to '{}' but does not share its storage (offsets {} and {}, {} and {} "
                  "elements)",
                  p.name, q.name, p.offset, q.offset, p.numel(), q.numel());
    FLASHLM_CHECK(trainable.empty() || trainable[size_t(i)] == trainable[size_t(j)],
                  "DdpParameters: '{}' and '{}' are tied, so both are trainable or both frozen", p.name, q.name);
  }
  for (int64_t i : read_as_master) {
    FLASHLM_CHECK(i >= 0 && i < n, "DdpParameters: read_as_master names parameter {}, expected one of 0..{}", i,
                  n - 1);
  }
  std::sort(owned.begin(), owned.end(), [](const DdpRange& a, const DdpRange& b) { return a.offset < b.offset; });
  for (size_t k = 1; k < owned.size(); ++k) {
    FLASHLM_CHECK(owned[k - 1].offset + owned[k - 1].count <= owned[k].offset,
                  "DdpParameters: parameters overlap at element {} without being tied", owned[k].offset);
  }
}

std::vector<DdpRange> DdpParameters::read_as_master_ranges() const {
  std::vector<int64_t> owners;
  for (int64_t i : read_as_master) owners.push_back(owner(i));  // a tied parameter's storage, once
  std::sort(owners.begin(), owners.end());
  owners.erase(std::unique(owners.begin(), owners.end()), owners.end());
  std::vector<DdpRange> ranges;
  for (int64_t i : owners) ranges.push_back({layout[size_t(i)].offset, layout[size_t(i)].numel()});
  return merge_ranges(std::move(ranges));
}

std::vector<DdpRange> DdpParameters::trainable_ranges() const {
  std::vector<DdpRange> ranges;
  for (int64_t i = 0; i < static_cast<int64_t>(layout.size()); ++i) {
    if (owner(i) == i && is_trainable(i)) ranges.push_back({layout[size_t(i)].offset, layout[size_t(i)].numel()});
  }
  return merge_ranges(std::move(ranges));
}

std::vector<DdpBucket> ddp_buckets(const std::vector<ParameterInfo>& layout, std::span<const int64_t> params,
                                   int64_t bucket_bytes) {
  FLASHLM_CHECK(bucket_bytes >= 0, "ddp_buckets: bucket_bytes = {}, expected >= 0", bucket_bytes);
  std::vector<DdpBucket> buckets;
  int64_t bytes = 0;
  for (int64_t p : params) {
    FLASHLM_CHECK(p >= 0 && p < static_cast<int64_t>(layout.size()), "ddp_buckets: parameter index {} outside [0, {})",
                  p, layout.size());
    const int64_t size = layout[size_t(p)].numel() * int64_t(sizeof(float));
    if (buckets.empty() || (!buckets.back().params.empty() && bytes + size > bucket_bytes)) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().params.push_back(p);
    bytes += size;
  }
  for (DdpBucket& b : buckets) {
    for (int64_t p : b.params) {
      b.ranges.push_back({layout[size_t(p)].offset, layout[size_t(p)].numel()});
      b.elements += layout[size_t(p)].numel();
    }
    b.ranges = merge_ranges(std::move(b.ranges));
  }
  return buckets;
}

std::string fsdp_unit_name(std::string_view name) {
  constexpr std::string_view kLayers = "layers.";
  if (name.substr(0, kLayers.size()) == kLayers) {
    const size_t dot = name.find('.', kLayers.size());
    if (dot != std::string_view::npos) return std::string(name.substr(0, dot + 1));
  }
  const size_t dot = name.find('.');
  return std::string(dot == std::string_view::npos ? name : name.substr(0, dot + 1));
}

std::vector<DdpBucket> fsdp_bucket_plan(const DdpParameters& params) {
  std::vector<DdpBucket> buckets;
  std::string unit;  // of the last bucket
  for (int64_t i = static_cast<int64_t>(params.layout.size()) - 1; i >= 0; --i) {
    if (params.owner(i) != i || !params.is_trainable(i)) continue;
    const ParameterInfo& p = params.layout[size_t(i)];
    const bool replicated = p.shape.size() < 2;
    std::string name = fsdp_unit_name(p.name);
    // Reverse order: the new parameter ends where the bucket's first run begins.
    const bool joins = !buckets.empty() && buckets.back().replicated == replicated && name == unit &&
                       p.offset + p.numel() == buckets.back().ranges.front().offset;
    if (!joins) {
      buckets.emplace_back();
      buckets.back().replicated = replicated;
      buckets.back().ranges.push_back({p.offset, 0});
      unit = std::move(name);
    }
    DdpBucket& b = buckets.back();
    b.params.push_back(i);
    b.ranges.front() = {p.offset, b.ranges.front().count + p.numel()};
    b.elements += p.numel();
  }
  return buckets;
}

namespace {

// bucketed: bytes per bucket (MB = 10^6 bytes), from 1 (every parameter alone) to "all in one"; other
// variants: 0.
int64_t bucket_limit(const DdpOptions& options) {
  if (options.variant != DdpVariant::bucketed) return 0;
  return std::max<int64_t>(1, std::llround(std::min(options.bucket_mb * 1e6, 1e18)));
}

}  // namespace

std::vector<DdpBucket> ddp_bucket_plan(const DdpParameters& params, const DdpOptions& options) {
  if (options.variant == DdpVariant::fsdp) return fsdp_bucket_plan(params);
  int64_t bucket_bytes = 0;  // per-param, async: one parameter per bucket
  if (options.variant == DdpVariant::flat) bucket_bytes = INT64_MAX;
  if (options.variant == DdpVariant::bucketed) bucket_bytes = bucket_limit(options);
  std::vector<int64_t> order;  // trainable owners, last parameter first: the order a backward finishes them
  for (int64_t i = static_cast<int64_t>(params.layout.size()) - 1; i >= 0; --i) {
    if (params.owner(i) == i && params.is_trainable(i)) order.push_back(i);
  }
  return ddp_buckets(params.layout, order, bucket_bytes);
}

std::string reduce_scatter_obstacle(const DdpParameters& params, const DdpOptions& options) {
  if (options.variant != DdpVariant::bucketed && options.variant != DdpVariant::fsdp) {
    return fmt::format("the {} variant (reduce-scatter needs bucketed or fsdp)", ddp_variant_name(options.variant));
  }
  if (options.reduce_dtype != DType::f32) {
    return fmt::format("{} gradient reduction (reduce-scatter reduces fp32)", dtype_name(options.reduce_dtype));
  }
  for (const DdpBucket& b : ddp_bucket_plan(params, options)) {
    if (b.ranges.size() != 1) {
      return fmt::format("a bucket of {} separate ranges (a frozen or tied parameter between its parameters)",
                         b.ranges.size());
    }
  }
  return "";
}

struct DataParallel::Impl {
  Communicator& comm;
  DdpParameters params;
  DdpOptions options;
  bool overlap = false;  // async, bucketed: buckets start during the backward
  // A world of one reducing fp32 (not FSDP, whose sharded storage moves gradients into its shard): each
  // rank's gradients are already their average, so no bucket is staged, reduced or waited for (the
  // collectives would be identities: in place, an average over one, a copy out and back).
  bool alone = false;
  std::vector<DdpBucket> buckets;
  std::vector<int64_t> bucket_of;  // per parameter: its owner's bucket, -1 when not communicated
  std::vector<int> expected;       // per bucket: gradient-ready reports that complete it
  // Per bucket: the element of `staging` where it is packed (-1: reduced in place in the gradients).
  std::vector<int64_t> staging_at;
  Buffer staging;  // elements of options.reduce_dtype
  ZeroBucketLayout shards;               // options.reduce_scatter: where each bucket is scattered to
  std::vector<DdpRange> averaged;        // averaged_ranges()

  // The current backward.
  float* grads = nullptr;
  void* stream = nullptr;
  bool in_backward = false, sync = false;
  int64_t micro_steps = 0;  // backwards since the last synchronisation
  std::vector<int> ready;   // per bucket
  std::vector<uint8_t> reported;  // per parameter
  size_t next_launch = 0;
  std::vector<CommRequest> requests;  // CPU, overlapped variants: in launch order
  size_t first_pending = 0;
  DdpStats stats;
#ifdef FLASHLM_WITH_CUDA
  cudaEvent_t backward_done = nullptr, synced = nullptr;
  bool events_pending = false;
#endif
  // FSDP's sharded storage (route_through): each bucket's gradients are read where the backward wrote them
  // (FsdpParameters::gradient_source) and reduced into this rank's packed shard; a bucket's requests (CPU)
  // or an event after its collectives (CUDA) say when its gradient buffer may be written again.
  FsdpParameters* route = nullptr;
  std::vector<std::vector<size_t>> bucket_requests;
#ifdef FLASHLM_WITH_CUDA
  std::vector<cudaEvent_t> sent;
#endif

  Impl(Communicator& c, DdpParameters p, const DdpOptions& o) : comm(c), params(std::move(p)), options(o) {}

  ~Impl() {
#ifdef FLASHLM_WITH_CUDA
    if (backward_done) cudaEventDestroy(backward_done);
    if (synced) cudaEventDestroy(synced);
    for (cudaEvent_t e : sent) cudaEventDestroy(e);
#endif
  }

  // Where the reduced gradient of element `offset` is kept: the flat gradients, or the packed shard.
  float* kept(int64_t offset) const { return route ? route->shard_gradients() + route->packed_index(offset) : grads + offset; }
  TensorView kept_view(int64_t offset, int64_t count) const {
    return TensorView::contiguous(kept(offset), DType::f32, {count}, params.device);
  }

  // Sharded storage: bucket b reduce-scattered from the gradient buffer the backward wrote into this rank's
  // shard, its tail copied there and all-reduced in place (a replicated bucket is written in the shard by
  // the backward and all-reduced there).
  void scatter_routed(size_t b) {
    const ZeroBucketShard& s = shards.buckets[b];
    const int64_t world = comm.world_size();
    const bool async = params.device == Device::cpu;
    float* source = route->gradient_source(s.offset);
    const auto start = [&](CommRequest request) {
      bucket_requests[b].push_back(requests.size());
      requests.push_back(std::move(request));
    };
    if (s.part > 0) {
      const TensorView in = TensorView::contiguous(source, DType::f32, {world * s.part}, params.device);
      const TensorView out = kept_view(s.owned.offset, s.part);
      if (async) start(comm.reduce_scatter_async(in, out, ReduceOp::avg));
      else comm.reduce_scatter(in, out, ReduceOp::avg, stream);
      ++stats.collectives;
    }
    if (s.tail.count > 0) {
      float* from = source + world * s.part;
      float* to = kept(s.tail.offset);
      if (from != to) {
        const size_t bytes = size_t(s.tail.count) * sizeof(float);
        if (async) std::memcpy(to, from, bytes);
#ifdef FLASHLM_WITH_CUDA
        else cuda_copy_async(to, from, bytes, stream);  // on the model's stream, which the all-reduce follows
#endif
      }
      const TensorView tail = kept_view(s.tail.offset, s.tail.count);
      if (async) start(comm.all_reduce_async(tail, ReduceOp::avg));
      else comm.all_reduce(tail, ReduceOp::avg, stream);
      ++stats.collectives;
    }
#ifdef FLASHLM_WITH_CUDA
    if (!async) {
      FLASHLM_CUDA_CHECK(cudaEventRecord(sent[b], static_cast<cudaStream_t>(comm.cuda_stream())),
                         "cudaEventRecord (FSDP gradients sent)");
    }
#endif
    stats.elements += buckets[b].elements;
  }

  char* staging_of(size_t b) const {
    return static_cast<char*>(staging.data()) + size_t(staging_at[b]) * dtype_size(options.reduce_dtype);
  }

  // What the all-reduce of bucket b reads and writes: its staging area, or its run of the gradients.
  TensorView bucket_view(size_t b) const {
    void* data = staging_at[b] >= 0 ? static_cast<void*>(staging_of(b)) : grads + buckets[b].ranges.front().offset;
    return TensorView::contiguous(data, options.reduce_dtype, {buckets[b].elements}, params.device);
  }

  // Moves a bucket's ranges between the fp32 gradients and its staging area (to_staging: before the
  // reduction), rounding to reduce_dtype on the way in and widening back on the way out. CUDA: queued on
  // `on`; the CPU reduces fp32 only, so it copies.
  void pack(size_t b, bool to_staging, void* on) {
    char* at = staging_of(b);
    for (const DdpRange& r : buckets[b].ranges) {
      float* g = grads + r.offset;
      if (params.device == Device::cpu) {
        const size_t bytes = size_t(r.count) * sizeof(float);
        if (to_staging) std::memcpy(at, g, bytes);
        else std::memcpy(g, at, bytes);
      } else {
#ifdef FLASHLM_WITH_CUDA
        convert_staged(options.reduce_dtype, g, at, r.count, to_staging, on);
#endif
      }
      at += size_t(r.count) * dtype_size(options.reduce_dtype);
    }
  }

  TensorView grads_view(int64_t offset, int64_t count) const {
    return TensorView::contiguous(grads + offset, DType::f32, {count}, params.device);
  }

  // Bucket b reduce-scattered in place into its shards (rank r's part averaged at grads + owned.offset:
  // NCCL's in-place form, recv = send + rank · part), and its tail all-reduced. Ordered like the all-reduce
  // (queued behind `stream` on the communicator's stream; the CPU blocks).
  void scatter(size_t b) {
    if (route) return scatter_routed(b);
    const ZeroBucketShard& s = shards.buckets[b];
    const int64_t world = comm.world_size();
    // The CPU's overlapped variants go through MPI's non-blocking collectives, finished in finish_backward().
    const bool async = overlap && params.device == Device::cpu;
    if (s.part > 0) {
      const TensorView in = grads_view(s.offset, world * s.part), out = grads_view(s.owned.offset, s.part);
      if (async) requests.push_back(comm.reduce_scatter_async(in, out, ReduceOp::avg));
      else comm.reduce_scatter(in, out, ReduceOp::avg, stream);
      ++stats.collectives;
    }
    if (s.tail.count > 0) {
      const TensorView tail = grads_view(s.tail.offset, s.tail.count);
      if (async) requests.push_back(comm.all_reduce_async(tail, ReduceOp::avg));
      else comm.all_reduce(tail, ReduceOp::avg, stream);
      ++stats.collectives;
    }
    stats.elements += buckets[b].elements;
  }

  void launch(size_t b) {
    if (options.reduce_scatter) return scatter(b);
    const bool staged = staging_at[b] >= 0;
    if (staged) pack(b, true, stream);  // CUDA: on the model's stream, which the all-reduce is queued behind
    const TensorView view = bucket_view(b);
    if (overlap && params.device == Device::cpu) {
      requests.push_back(comm.all_reduce_async(view, ReduceOp::avg));
    } else {
      comm.all_reduce(view, ReduceOp::avg, stream);  // CUDA: queued behind `stream`; CPU: blocking
      // CUDA: unpacked on the communicator's stream right behind its all-reduce, while the backward goes on
      // (it no longer touches these gradients); finish_backward() makes the model's stream wait for it.
      if (staged && params.device == Device::cuda) pack(b, false, comm.cuda_stream());
    }
    ++stats.collectives;
    stats.elements += buckets[b].elements;
  }

  // The sum over grad_accum micro-steps into their mean: only the averaged elements (with reduce_scatter
  // the rest of a bucket is not this rank's to read). CUDA: on `on`, the model's stream.
  void scale_averaged(void* on) {
    const float scale = 1.0f / float(options.grad_accum);
    for (const DdpRange& r : averaged) {
      float* g = kept(r.offset);
      if (params.device == Device::cpu) {
        for (int64_t i = 0; i < r.count; ++i) g[i] *= scale;
      } else {
#ifdef FLASHLM_WITH_CUDA
        gpu::scale_inplace(g, r.count, scale, on);
#else
        (void)on;
#endif
      }
    }
  }

  // Starts the complete buckets that are next in order (every rank starts them in the same order).
  void launch_ready() {
    while (next_launch < buckets.size() && ready[next_launch] == expected[next_launch]) launch(next_launch++);
    // MPI moves non-blocking collectives along only inside MPI calls: poke the oldest one.
    while (first_pending < requests.size() && comm.test(requests[first_pending])) ++first_pending;
  }
};

DataParallel::DataParallel(Communicator& comm, DdpParameters params, const DdpOptions& options)
    : impl_(std::make_unique<Impl>(comm, std::move(params), options)) {
  Impl& m = *impl_;
  m.params.validate();
  FLASHLM_CHECK(options.grad_accum >= 1, "DataParallel: grad_accum = {}, expected >= 1", options.grad_accum);
  FLASHLM_CHECK(options.variant != DdpVariant::bucketed || (options.bucket_mb > 0 && std::isfinite(options.bucket_mb)),
                "DataParallel: bucket_mb = {}, expected a positive size in MB", options.bucket_mb);
  FLASHLM_CHECK(m.params.device == Device::cpu || Communicator::nccl_built(),
                "DataParallel: CUDA parameters need flashlm built with NCCL");
  const DType reduce = options.reduce_dtype;
  FLASHLM_CHECK(reduce == DType::f32 || reduce == DType::bf16 || reduce == DType::f16,
                "DataParallel: reduce_dtype {}, expected fp32, bf16 or fp16", dtype_name(reduce));
  FLASHLM_CHECK(reduce == DType::f32 || m.params.device == Device::cuda,
                "DataParallel: {} gradient reduction needs --device cuda (NCCL); MPI reduces fp32 on the CPU",
                dtype_name(reduce));
  // Every rank must plan the same buckets and run the same variant, or collectives would pair up wrongly.
  comm.agree(static_cast<int64_t>(options.variant), "the DDP variant");
  comm.agree(bucket_limit(options), "the DDP bucket size");
  comm.agree(options.grad_accum, "the gradient accumulation steps");
  comm.agree(static_cast<int64_t>(reduce), "the DDP gradient reduction type");
  comm.agree(options.reduce_scatter ? 1 : 0, "whether DDP reduce-scatters the gradients");
  comm.agree(m.params.flat_size(), "the number of parameter elements");
  comm.agree(static_cast<int64_t>(m.params.layout.size()), "the number of parameters");
  FLASHLM_CHECK(options.variant != DdpVariant::fsdp || options.reduce_scatter,
                "DataParallel: the fsdp variant reduce-scatters (DdpOptions::reduce_scatter)");
  if (options.reduce_scatter) {
    const std::string obstacle = reduce_scatter_obstacle(m.params, options);
    FLASHLM_CHECK(obstacle.empty(), "DataParallel: cannot reduce-scatter the gradients: {}", obstacle);
  }
  if (m.params.device == Device::cuda) comm.setup_cuda();

  m.overlap = options.variant == DdpVariant::async || options.variant == DdpVariant::bucketed ||
              options.variant == DdpVariant::fsdp;
  m.alone = comm.world_size() == 1 && reduce == DType::f32 && options.variant != DdpVariant::fsdp;
  const auto n = static_cast<int64_t>(m.params.layout.size());
  m.buckets = ddp_bucket_plan(m.params, options);
  if (options.reduce_scatter) {
    m.shards = zero_bucket_layout(m.buckets, comm.world_size(), comm.rank());
    for (const ZeroBucketShard& s : m.shards.buckets) {
      for (const DdpRange& r : {s.owned, s.tail}) {
        if (r.count > 0) m.averaged.push_back(r);
      }
    }
  } else {
    for (const DdpBucket& b : m.buckets) m.averaged.insert(m.averaged.end(), b.ranges.begin(), b.ranges.end());
  }
  m.averaged = merge_ranges(std::move(m.averaged));
  m.bucket_of.assign(size_t(n), -1);
  m.expected.assign(m.buckets.size(), 0);
  for (size_t b = 0; b < m.buckets.size(); ++b) {
    for (int64_t p : m.buckets[b].params) m.bucket_of[size_t(p)] = int64_t(b);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (m.params.is_trainable(i)) ++m.expected[size_t(m.bucket_of[size_t(m.params.owner(i))])];
  }
  // A bucket of several separate ranges (frozen or tied parameters between them) is packed for its
  // all-reduce, and with a 16-bit reduce_dtype every bucket is rounded into its staging area; each such
  // bucket has its own area, since several may be in flight at once.
  int64_t staged = 0;
  for (const DdpBucket& b : m.buckets) {
    const bool packed = !m.alone && (reduce != DType::f32 || b.ranges.size() > 1);
    m.staging_at.push_back(packed ? staged : -1);
    if (packed) staged += b.elements;
  }
  if (staged > 0) {
    m.staging = Buffer::allocate(size_t(staged) * dtype_size(reduce), m.params.device,
                                 fmt::format("DDP {} gradient staging", dtype_name(reduce)));
  }
  m.ready.assign(m.buckets.size(), 0);
  m.reported.assign(size_t(n), 0);
}

DataParallel::~DataParallel() = default;

const DdpParameters& DataParallel::parameters() const { return impl_->params; }
const DdpOptions& DataParallel::options() const { return impl_->options; }
const std::vector<DdpBucket>& DataParallel::buckets() const { return impl_->buckets; }
const std::vector<DdpRange>& DataParallel::averaged_ranges() const { return impl_->averaged; }
bool DataParallel::communicates() const { return !impl_->alone; }
int64_t DataParallel::staging_bytes() const { return static_cast<int64_t>(impl_->staging.bytes()); }

void DataParallel::broadcast_parameters(float* params, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(params != nullptr, "DataParallel::broadcast_parameters: params is null");
  m.comm.broadcast(TensorView::contiguous(params, DType::f32, {m.params.flat_size()}, m.params.device), 0, stream);
  m.comm.wait(stream);
}

void DataParallel::begin_backward(float* grads, bool sync, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(!m.in_backward, "DataParallel::begin_backward: the previous backward was not finished");
  FLASHLM_CHECK(grads != nullptr, "DataParallel::begin_backward: grads is null");
  FLASHLM_CHECK(!sync || m.micro_steps + 1 == m.options.grad_accum,
                "DataParallel::begin_backward: synchronising micro-step {} of an accumulation of grad_accum = {}",
                m.micro_steps + 1, m.options.grad_accum);
  FLASHLM_CHECK(sync || m.micro_steps + 1 < m.options.grad_accum,
                "DataParallel::begin_backward: micro-step {} of grad_accum = {} must synchronise", m.micro_steps + 1,
                m.options.grad_accum);
#ifdef FLASHLM_WITH_CUDA
  if (m.params.device == Device::cuda) {
    FLASHLM_CHECK(cuda_pointer_device(grads) == m.comm.cuda_device(),
                  "DataParallel::begin_backward: grads is not memory of this rank's GPU cuda:{}", m.comm.cuda_device());
  }
#endif
  m.grads = grads;
  m.stream = stream;
  m.sync = sync;
  m.in_backward = true;
  if (!sync) return;
  std::fill(m.ready.begin(), m.ready.end(), 0);
  std::fill(m.reported.begin(), m.reported.end(), uint8_t{0});
  m.next_launch = 0;
  m.requests.clear();
  for (std::vector<size_t>& r : m.bucket_requests) r.clear();
  m.first_pending = 0;
  m.stats = {};
}

void DataParallel::gradients_ready(int64_t first, int64_t last) {
  Impl& m = *impl_;
  const auto n = static_cast<int64_t>(m.params.layout.size());
  FLASHLM_CHECK(0 <= first && first <= last && last < n, "DataParallel::gradients_ready: [{}, {}] is not within [0, {})",
                first, last, n);
  if (!m.in_backward || !m.sync) return;  // outside a synchronised backward: nothing to do
  for (int64_t i = first; i <= last; ++i) {
    FLASHLM_CHECK(!m.reported[size_t(i)], "DataParallel::gradients_ready: '{}' was reported twice in one backward",
                  m.params.layout[size_t(i)].name);
    m.reported[size_t(i)] = 1;
    const int64_t b = m.bucket_of[size_t(m.params.owner(i))];
    if (b >= 0 && m.params.is_trainable(i)) ++m.ready[size_t(b)];
  }
  if (m.overlap && !m.alone) m.launch_ready();
}

GradientReadyHook DataParallel::hook() {
  return [this](int64_t first, int64_t last) { gradients_ready(first, last); };
}

void DataParallel::finish_backward() {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.in_backward, "DataParallel::finish_backward: no begin_backward()");
  m.in_backward = false;
  if (!m.sync) {
    ++m.micro_steps;
    return;
  }
  m.micro_steps = 0;
  const bool cuda = m.params.device == Device::cuda;
  if (m.alone) {
    // Nothing to reduce: the mean over the micro-steps is all that is left, on the model's stream (CUDA),
    // with no event or wait between it and the optimizer.
    if (m.options.grad_accum > 1) m.scale_averaged(m.stream);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
#ifdef FLASHLM_WITH_CUDA
  if (cuda) {
    if (!m.backward_done) {
      FLASHLM_CUDA_CHECK(cudaEventCreate(&m.backward_done), "cudaEventCreate");
      FLASHLM_CUDA_CHECK(cudaEventCreate(&m.synced), "cudaEventCreate");
    }
    FLASHLM_CUDA_CHECK(cudaEventRecord(m.backward_done, static_cast<cudaStream_t>(m.stream)), "cudaEventRecord");
  }
#endif
  // What the hooks did not start (every bucket for per-param and flat; for the others, buckets of a model
  // that reports no gradients), in order.
  while (m.next_launch < m.buckets.size()) m.launch(m.next_launch++);
  for (CommRequest& r : m.requests) m.comm.wait(r);
  if (cuda) {
    m.comm.wait(m.stream);  // after the collectives and the unpacking queued behind them (launch())
  } else {
    for (size_t b = 0; b < m.buckets.size(); ++b) {
      if (m.staging_at[b] >= 0) m.pack(b, false, nullptr);
    }
  }
  if (m.options.grad_accum > 1) m.scale_averaged(m.stream);
#ifdef FLASHLM_WITH_CUDA
  if (cuda) {
    FLASHLM_CUDA_CHECK(cudaEventRecord(m.synced, static_cast<cudaStream_t>(m.stream)), "cudaEventRecord");
    m.events_pending = true;
    return;
  }
#endif
  m.stats.exposed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void DataParallel::route_through(FsdpParameters& fsdp) {
  Impl& m = *impl_;
  FLASHLM_CHECK(m.options.variant == DdpVariant::fsdp && fsdp.sharded(),
                "DataParallel::route_through: FSDP's sharded storage only");
  m.route = &fsdp;
  m.bucket_requests.assign(m.buckets.size(), {});
#ifdef FLASHLM_WITH_CUDA
  if (m.params.device == Device::cuda) {
    m.sent.assign(m.buckets.size(), nullptr);
    for (cudaEvent_t& e : m.sent) {
      FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
  }
#endif
}

void DataParallel::await_gradients(int64_t offset, int64_t count) {
  Impl& m = *impl_;
  if (!m.route) return;
  for (size_t b = 0; b < m.buckets.size(); ++b) {
    const DdpRange& r = m.buckets[b].ranges.front();
    if (!(r.offset < offset + count && offset < r.offset + r.count)) continue;
    if (m.params.device == Device::cpu) {
      for (size_t k : m.bucket_requests[b]) m.comm.wait(m.requests[k]);
    } else {
#ifdef FLASHLM_WITH_CUDA
      FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(m.stream), m.sent[b], 0),
                         "cudaStreamWaitEvent (FSDP gradients sent)");
#endif
    }
  }
}

DdpStats DataParallel::last_stats() {
  Impl& m = *impl_;
#ifdef FLASHLM_WITH_CUDA
  if (m.events_pending) {
    float ms = 0;
    FLASHLM_CUDA_CHECK(cudaEventSynchronize(m.synced), "cudaEventSynchronize (DDP)");
    FLASHLM_CUDA_CHECK(cudaEventElapsedTime(&ms, m.backward_done, m.synced), "cudaEventElapsedTime (DDP)");
    m.stats.exposed_ms = ms;
    m.events_pending = false;
  }
#endif
  return m.stats;
}

int resolve_gemm_sm_reserve(int requested, const Communicator& comm) {
  FLASHLM_CHECK(requested >= -1, "gemm_sm_reserve = {}, expected >= 0 (or -1: automatic)", requested);
  return requested >= 0 ? requested : std::max(comm.nccl_max_ctas(), 0);
}

}  // namespace flashlm
