// FSDP's parameter lifetime (include/flashlm/fsdp.h): per sharded bucket, whether the other
// ranks' parts are whole on this rank, arriving, or released; the model's parts (fsdp_unit_name) in the
// order the forward reads them, for the prefetch. The reduce-scatter of the gradients is DataParallel's and
// the sharded update ZeroOptimizer's; this file only gathers and frees.
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "core/check.h"
#include "dist/fp8_gather.h"
#include "flashlm/dist.h"
#include "flashlm/fsdp.h"
#include "flashlm/zero.h"
#include "model/fp8.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/array_ops.h"
#include "core/cuda_check.h"
#include "core/cuda_runtime.h"
#endif

namespace flashlm {

struct FsdpParameters::Impl {
  enum class State : uint8_t { released, arriving, whole };
  // One sharded bucket: rank r owns [offset + r·part, offset + (r + 1)·part) of it.
  struct Shard {
    Communicator::Segment segment;
    int64_t tail = 0;  // the bucket's last E mod world elements, kept by every rank
    bool reads_master = false;  // the model reads it from the fp32 masters (DdpParameters::read_as_master)
    State state = State::whole;
    CommRequest request;  // CPU: the gather in flight
#ifdef FLASHLM_WITH_CUDA
    cudaEvent_t gathered = nullptr;  // CUDA: recorded on the communicator's stream after the gather
#endif
  };
  // A model part: its elements and the shards within them.
  struct Unit {
    int64_t offset = 0, count = 0;
    std::vector<size_t> shards;
  };

  Communicator& comm;
  DdpParameters params;
  int prefetch = 1;
  bool poison = false;
  std::vector<Shard> shards;
  std::vector<Unit> units;  // in the order of their first parameter in the layout: the forward's order
  float* masters = nullptr;
  void* working = nullptr;
  DType working_dtype = DType::f32;
  void* stream = nullptr;
  bool backward = false, held = false;
  // The parts the last forward ([0]) and backward ([1]) read, in the order they read them (a backward reads
  // no embedding; a recomputing one reads each layer twice in a row, recorded once): what the prefetch
  // follows. Every rank records the same calls, so every rank prefetches the same parts.
  std::vector<int64_t> pass_order[2];
  std::vector<DdpBucket> buckets;
  std::vector<int64_t> recording;  // the current pass's
  size_t cursor = 0;               // where in pass_order[backward] the last needed() part was found
  int64_t live_bytes = 0, peak_bytes = 0;

  // Sharded storage (use_sharded_storage). The runs this rank keeps (ZeroOptimizer::updated_ranges(),
  // ascending) and where each starts in the packed shards.
  bool sharded = false;
  // bf16-pure (use_sharded_storage's pure): no fp32 masters; shard_working (bf16) holds the parameters
  // themselves, and every part, the embedding too, is gathered in bf16.
  bool pure = false;
  std::span<ParameterStorage> table;
  std::vector<DdpRange> runs;
  std::vector<int64_t> run_at;
  Buffer shard_masters, shard_working, shard_grads, local_grads;  // local_grads: whole, grad_accum > 1 only
  // Per unit: its sharded parameters (indices into the layout), the type it is gathered in, its pool
  // buffer and gradient buffer while it has them, and its gather's state.
  struct UnitStorage {
    std::vector<size_t> params;
    DType dtype = DType::f32;  // f8e4m3: gathered by the FP8 gather, from the shards' `from`
    DType from = DType::f32;
    std::vector<Communicator::Segment> segments;  // its buckets' parts, relative to the unit's first element
    std::vector<Fp8GatherGroup> fp8_groups;       // FP8: its scale groups, relative to its first element
    int slot = -1, grad_slot = -1;
    State state = State::released;
    CommRequest request;
#ifdef FLASHLM_WITH_CUDA
    cudaEvent_t gathered = nullptr;
#endif
  };
  std::vector<UnitStorage> stored;
  struct Slot {
    Buffer buffer;
    int64_t unit = -1;  // the unit it holds (gathered, arriving) or last held
  };
  std::vector<Slot> pool, grad_pool;
  size_t next_grad_slot = 0;
  // FSDP's FP8 gather (use_sharded_storage's fp8_groups): the gather, and a scale slot per group.
  std::unique_ptr<Fp8WeightGather> fp8;
  Buffer fp8_scales;
#ifdef FLASHLM_WITH_CUDA
  cudaEvent_t fp8_ready = nullptr;  // CUDA: recorded on the model's stream before an FP8 gather (gather_fp8)
#endif
  FsdpGatherTraffic traffic;
  std::function<void(int64_t, int64_t)> await_gradients;

  Impl(Communicator& c, DdpParameters p) : comm(c), params(std::move(p)) {}
  ~Impl() {
#ifdef FLASHLM_WITH_CUDA
    for (Shard& s : shards) {
      if (s.gathered) cudaEventDestroy(s.gathered);
    }
    for (UnitStorage& u : stored) {
      if (u.gathered) cudaEventDestroy(u.gathered);
    }
    if (fp8_ready) cudaEventDestroy(fp8_ready);
#endif
  }

  // Sharded storage: the packed index of a kept element, or -1.
  int64_t packed(int64_t offset) const {
    auto it = std::upper_bound(runs.begin(), runs.end(), offset,
                               [](int64_t o, const DdpRange& r) { return o < r.offset; });
    if (it == runs.begin()) return -1;
    --it;
    if (offset >= it->offset + it->count) return -1;
    return run_at[size_t(it - runs.begin())] + (offset - it->offset);
  }
  void* packed_weight(int64_t index, DType dtype) const {
    if (dtype == DType::f32) return static_cast<float*>(shard_masters.data()) + index;
    return static_cast<char*>(shard_working.data()) + size_t(index) * dtype_size(dtype);
  }
  // Copies `count` elements between two buffers of the parameters' device, queued on the model's stream.
  void copy(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0) return;
    if (!cuda()) {
      std::memcpy(dst, src, bytes);
      return;
    }
#ifdef FLASHLM_WITH_CUDA
    cuda_copy_async(dst, src, bytes, stream);
#endif
  }
  // Every bit set: a NaN in fp32, bf16, fp16 and e4m3 alike.
  void fill_nan(void* p, int64_t count, DType dtype) const {
    if (count == 0) return;
    if (!cuda()) {
      std::memset(p, 0xff, size_t(count) * dtype_size(dtype));
      return;
    }
#ifdef FLASHLM_WITH_CUDA
    gpu::memset_async(p, 0xff, size_t(count) * dtype_size(dtype), stream);
#endif
  }
  int64_t unit_foreign_bytes(size_t u) const {
    int64_t e = 0;
    for (const Communicator::Segment& s : stored[u].segments) e += s.part * (comm.world_size() - 1);
    return e * int64_t(dtype_size(stored[u].dtype));
  }

  // A pool buffer for unit u: a free one, else (the pool full of parts gathered ahead) the one whose part was
  // gathered earliest, after its gather completes. -1 when every buffer holds a part and `evict` is false.
  int take_slot(size_t u, bool evict) {
    for (size_t k = 0; k < pool.size(); ++k) {
      if (pool[k].unit < 0 || stored[size_t(pool[k].unit)].slot != int(k)) return int(k);
    }
    if (!evict) return -1;
    for (size_t k = 0; k < pool.size(); ++k) {
      const auto other = size_t(pool[k].unit);
      if (other == u) continue;
      release_unit(other);
      return int(k);
    }
    fail("FsdpParameters: no pool buffer for part {} (a pool of {})", u, pool.size());
  }

  // Starts gathering unit u into a pool buffer: this rank's parts and tails copied from the shards to their
  // places, then the other ranks' parts by an in-place all-gather of the unit's segments.
  void start_unit(size_t u, bool evict) {
    UnitStorage& us = stored[u];
    if (us.state != State::released || us.segments.empty()) return;
    const int slot = take_slot(u, evict);
    if (slot < 0) return;  // a prefetch with the pool full: gathered when it is needed instead
    us.slot = slot;
    pool[size_t(slot)].unit = int64_t(u);
    gather_into(u);
  }

  void gather_into(size_t u) {
    UnitStorage& us = stored[u];
    const Unit& unit = units[u];
    if (us.dtype == DType::f8e4m3) return gather_fp8(u);
    const size_t esize = dtype_size(us.dtype);
    char* base = unit_base(u);
    for (size_t k : unit.shards) {
      const Shard& s = shards[k];
      const int64_t world = comm.world_size(), rank = comm.rank();
      const int64_t own = s.segment.offset + rank * s.segment.part;
      copy(base + size_t(own - unit.offset) * esize, packed_weight(packed(own), us.dtype), size_t(s.segment.part) * esize);
      if (s.tail > 0) {
        const int64_t tail = s.segment.offset + world * s.segment.part;
        copy(base + size_t(tail - unit.offset) * esize, packed_weight(packed(tail), us.dtype), size_t(s.tail) * esize);
      }
    }
    const TensorView x = TensorView::contiguous(base, us.dtype, {unit.count}, params.device);
    if (!cuda()) {
      us.request = comm.all_gather_segments_async(x, us.segments);
    } else {
#ifdef FLASHLM_WITH_CUDA
      comm.all_gather_segments(x, us.segments, stream);  // behind an event of the model's stream
      FLASHLM_CUDA_CHECK(cudaEventRecord(us.gathered, static_cast<cudaStream_t>(comm.cuda_stream())),
                         "cudaEventRecord (FSDP gather)");
#endif
    }
    arriving(u);
    traffic.bytes += unit_foreign_bytes(u);
  }

  // Unit u as e4m3 bytes (Fp8WeightGather::gather_groups): this rank's parts and tails encoded from its
  // shards straight into the pool buffer, one amax per scale group exchanged, the other ranks' parts
  // gathered — that last all-gather left in flight, as the other parts' gathers are. CUDA: all of it queued
  // on the communicator's stream, behind an event of the model's stream (the shards' last update and the
  // last reads of the pool buffer before it) and followed by the unit's event, as gather_into's all-gather:
  // the model's stream waits for nothing but that event, so the exchange of the amaxes does not hold its
  // compute behind the gradients' reduce-scatters queued on the communicator's stream before it.
  void gather_fp8(size_t u) {
    UnitStorage& us = stored[u];
    const Unit& unit = units[u];
    const int64_t world = comm.world_size(), rank = comm.rank();
    std::vector<Fp8HeldRun> held;
    for (size_t k : unit.shards) {
      const Shard& s = shards[k];
      const int64_t own = s.segment.offset + rank * s.segment.part;
      held.push_back({own - unit.offset, s.segment.part, packed_weight(packed(own), us.from)});
      if (s.tail > 0) {
        const int64_t tail = s.segment.offset + world * s.segment.part;
        held.push_back({tail - unit.offset, s.tail, packed_weight(packed(tail), us.from)});
      }
    }
    const TensorView q = TensorView::contiguous(unit_base(u), DType::f8e4m3, {unit.count}, params.device);
    void* on = nullptr;
#ifdef FLASHLM_WITH_CUDA
    if (cuda()) {
      on = comm.cuda_stream();
      FLASHLM_CUDA_CHECK(cudaEventRecord(fp8_ready, static_cast<cudaStream_t>(stream)),
                         "cudaEventRecord (FSDP FP8 gather)");
      FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(on), fp8_ready, 0),
                         "cudaStreamWaitEvent (FSDP FP8 gather)");
    }
#endif
    const Fp8GatherTraffic t = fp8->gather_groups(held, us.from, us.segments, us.fp8_groups, q, &us.request, on);
#ifdef FLASHLM_WITH_CUDA
    if (cuda()) {
      FLASHLM_CUDA_CHECK(cudaEventRecord(us.gathered, static_cast<cudaStream_t>(on)),
                         "cudaEventRecord (FSDP FP8 gather)");
    }
#endif
    arriving(u);
    traffic.bytes += t.weight_bytes;
    traffic.fp8_bytes += t.weight_bytes;
    traffic.fp8_amax_bytes += t.amax_bytes;
  }

  void arriving(size_t u) {
    stored[u].state = State::arriving;
    live_bytes += unit_foreign_bytes(u);
    peak_bytes = std::max(peak_bytes, live_bytes);
  }

  // Waits for unit u's gather and points its parameters at the pool buffer.
  void finish_unit(size_t u) {
    UnitStorage& us = stored[u];
    if (us.state != State::arriving) return;
    if (!cuda()) {
      comm.wait(us.request);
    } else {
#ifdef FLASHLM_WITH_CUDA
      FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), us.gathered, 0),
                         "cudaStreamWaitEvent (FSDP gather)");
#endif
    }
    char* base = unit_base(u);
    for (size_t i : us.params) {
      ParameterStorage& t = table[i];
      t.weight = base + size_t(params.layout[i].offset - units[u].offset) * dtype_size(us.dtype);
      t.master = us.dtype == DType::f32 ? static_cast<float*>(t.weight) : nullptr;
    }
    us.state = State::whole;
  }

  // Every part released, and the buffer of gather_all() freed (its parameters then point nowhere until
  // their next gather).
  void release_everything() {
    for (size_t u = 0; u < stored.size(); ++u) release_unit(u);
    if (!everything.data()) return;
#ifdef FLASHLM_WITH_CUDA
    if (cuda()) gpu::stream_synchronize(stream);  // the evaluation's kernels may still read it
#endif
    everything = Buffer();
    for (const UnitStorage& us : stored) {
      for (size_t i : us.params) point_away(i);
    }
  }

  // A sharded parameter whose part is not gathered: nowhere, or in the poison mode at its place in the first
  // pool buffer, NaN from its allocation and from every release until a part is gathered into it, so that a
  // read before the part's gather shows in the loss rather than as a crash.
  void point_away(size_t i) {
    ParameterStorage& t = table[i];
    t.weight = nullptr;
    t.master = nullptr;
    if (!poison || pool.empty()) return;
    const int64_t u = unit_at(params.layout[i].offset);
    const DType dtype = stored[size_t(u)].dtype;
    t.weight = static_cast<char*>(pool.front().buffer.data()) +
               size_t(params.layout[i].offset - units[size_t(u)].offset) * dtype_size(dtype);
    t.master = dtype == DType::f32 ? static_cast<float*>(t.weight) : nullptr;
  }

  // Gives unit u's pool buffer back (poisoned with NaN in the poison mode: the parameters still point there,
  // so a read before the next gather shows).
  void release_unit(size_t u) {
    UnitStorage& us = stored[u];
    finish_unit(u);
    if (us.state != State::whole) return;
    us.state = State::released;
    live_bytes -= unit_foreign_bytes(u);
    if (poison && us.slot >= 0) fill_nan(unit_base(u), units[u].count, us.dtype);
    us.slot = -1;
  }

  bool cuda() const { return params.device == Device::cuda; }
  bool in_master(const Shard& s) const {
    if (pure) return false;
    return (sharded ? working_dtype == DType::f32 : working == nullptr) || s.reads_master;
  }
  DType dtype_of(const Shard& s) const { return in_master(s) ? DType::f32 : working_dtype; }
  void* buffer_of(const Shard& s) const { return in_master(s) ? static_cast<void*>(masters) : working; }
  // The other ranks' parts: what a gather brings and a release gives up.
  int64_t foreign_bytes(const Shard& s) const {
    return s.segment.part * (comm.world_size() - 1) * int64_t(dtype_size(dtype_of(s)));
  }

  bool overlaps(const Shard& s, int64_t offset, int64_t count) const {
    const int64_t end = s.segment.offset + s.segment.part * comm.world_size();
    return s.segment.offset < offset + count && offset < end;
  }

  void start(Shard& s) {
    if (s.state != State::released) return;
    const TensorView x =
        TensorView::contiguous(buffer_of(s), dtype_of(s), {params.flat_size()}, params.device);
    const Communicator::Segment seg[] = {s.segment};
    if (!cuda()) {
      s.request = comm.all_gather_segments_async(x, seg);
    } else {
#ifdef FLASHLM_WITH_CUDA
      comm.all_gather_segments(x, seg, stream);  // behind an event of the model's stream
      FLASHLM_CUDA_CHECK(cudaEventRecord(s.gathered, static_cast<cudaStream_t>(comm.cuda_stream())),
                         "cudaEventRecord (FSDP gather)");
#endif
    }
    s.state = State::arriving;
    live_bytes += foreign_bytes(s);
    peak_bytes = std::max(peak_bytes, live_bytes);  // counted where gathers happen, not for a whole model
    traffic.bytes += foreign_bytes(s);
  }

  void finish(Shard& s) {
    if (s.state != State::arriving) return;
    if (!cuda()) {
      comm.wait(s.request);
    } else {
#ifdef FLASHLM_WITH_CUDA
      FLASHLM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), s.gathered, 0),
                         "cudaStreamWaitEvent (FSDP gather)");
#endif
    }
    s.state = State::whole;
  }

  // Overwrites the other ranks' parts with NaN (all bits set: a NaN in fp32, bf16 and fp16).
  void poison_foreign(const Shard& s) {
    const int64_t part = s.segment.part, rank = comm.rank(), world = comm.world_size();
    const size_t esize = dtype_size(dtype_of(s));
    char* base = static_cast<char*>(buffer_of(s)) + size_t(s.segment.offset) * esize;
    const std::pair<int64_t, int64_t> foreign[] = {{0, rank * part}, {(rank + 1) * part, (world - rank - 1) * part}};
    for (const auto& [at, count] : foreign) {
      if (count == 0) continue;
      char* p = base + size_t(at) * esize;
      if (!cuda()) {
        std::fill_n(reinterpret_cast<float*>(p), count, std::numeric_limits<float>::quiet_NaN());
      } else {
#ifdef FLASHLM_WITH_CUDA
        gpu::memset_async(p, 0xff, size_t(count) * esize, stream);
#endif
      }
    }
  }

  void release(Shard& s) {
    finish(s);
    if (s.state != State::whole) return;
    s.state = State::released;
    live_bytes -= foreign_bytes(s);
    if (poison) poison_foreign(s);
  }

  void finish_overlapping(int64_t offset, int64_t count) {
    for (Shard& s : shards) {
      if (overlaps(s, offset, count)) finish(s);
    }
  }

  // The parts expected after part u in this pass: those that followed it in the last pass of this kind, or,
  // before there was one, its neighbours in the layout in the pass's direction.
  std::vector<int64_t> parts_after(int64_t u) {
    const std::vector<int64_t>& last = pass_order[backward];
    if (last.empty()) {
      std::vector<int64_t> after;
      for (int64_t next = backward ? u - 1 : u + 1; 0 <= next && next < int64_t(units.size());
           next += backward ? -1 : 1) {
        after.push_back(next);
      }
      return after;
    }
    auto at = std::find(last.begin() + std::ptrdiff_t(std::min(cursor, last.size())), last.end(), u);
    if (at == last.end()) at = std::find(last.begin(), last.end(), u);
    if (at == last.end()) return {};
    cursor = size_t(at - last.begin());
    return {at + 1, last.end()};
  }

  // The unit holding element `offset`, or -1.
  int64_t unit_at(int64_t offset) const {
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].offset <= offset && offset < units[u].offset + units[u].count) return int64_t(u);
    }
    return -1;
  }
  // Sharded storage: whether element `offset` is in a sharded bucket (gathered, not kept whole here).
  bool in_shard(int64_t offset) const {
    return std::any_of(shards.begin(), shards.end(), [&](const Shard& x) { return overlaps(x, offset, 1); });
  }
  // The part's base address while it is whole: its pool buffer, or the buffer gather_all() gathered into.
  char* unit_base(size_t u) const {
    const UnitStorage& us = stored[u];
    if (us.slot >= 0) return static_cast<char*>(pool[size_t(us.slot)].buffer.data());
    return static_cast<char*>(everything.data()) + size_t(everything_at[u]);
  }
  Buffer everything;                  // gather_all(): every part whole, until released
  std::vector<int64_t> everything_at;  // per unit: its byte offset there

  // The unit whose elements are exactly these (a model part's needed/done call), or -1.
  int64_t unit_of(int64_t offset, int64_t count) const {
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].offset == offset && units[u].count == count) return int64_t(u);
    }
    return -1;
  }
};

FsdpParameters::FsdpParameters(Communicator& comm, DdpParameters params, std::span<const DdpBucket> buckets,
                               int prefetch, bool poison_freed, bool gather_alone)
    : impl_(std::make_unique<Impl>(comm, std::move(params))) {
  Impl& m = *impl_;
  m.params.validate();
  FLASHLM_CHECK(prefetch >= 0 && prefetch <= 2, "FsdpParameters: prefetch = {}, expected 0, 1 or 2 parts ahead",
                prefetch);
  comm.agree(prefetch, "the FSDP prefetch depth");
  m.prefetch = prefetch;
  m.poison = poison_freed;
  m.buckets.assign(buckets.begin(), buckets.end());
  const std::vector<DdpRange> reads = m.params.read_as_master_ranges();
  const ZeroBucketLayout layout = zero_bucket_layout(buckets, comm.world_size(), comm.rank());
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ZeroBucketShard& z = layout.buckets[b];
    // Nothing to gather: a replicated bucket, or a world of one (unless gather_alone: then its one part).
    if (z.part == 0 || (comm.world_size() == 1 && !gather_alone)) continue;
    Impl::Shard s;
    s.segment = {z.offset, z.part};
    s.tail = z.tail.count;
    const DdpRange& r = buckets[b].ranges.front();
    s.reads_master = std::any_of(reads.begin(), reads.end(), [&](const DdpRange& x) {
      return x.offset < r.offset + r.count && r.offset < x.offset + x.count;
    });
#ifdef FLASHLM_WITH_CUDA
    if (m.cuda()) {
      FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&s.gathered, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags (FSDP gather)");
    }
#endif
    m.shards.push_back(std::move(s));
  }
  std::sort(m.shards.begin(), m.shards.end(), [](const Impl::Shard& a, const Impl::Shard& b) {
    return a.segment.offset < b.segment.offset;
  });
  // The parts, in the order of the layout.
  std::vector<std::string> names;
  for (const ParameterInfo& p : m.params.layout) {
    const std::string name = fsdp_unit_name(p.name);
    const auto at = std::find(names.begin(), names.end(), name);
    if (at == names.end()) {
      names.push_back(name);
      m.units.push_back({p.offset, p.numel(), {}});
      continue;
    }
    Impl::Unit& u = m.units[size_t(at - names.begin())];
    const int64_t end = std::max(u.offset + u.count, p.offset + p.numel());
    u.offset = std::min(u.offset, p.offset);
    u.count = end - u.offset;
  }
  for (Impl::Unit& u : m.units) {
    for (size_t k = 0; k < m.shards.size(); ++k) {
      if (m.overlaps(m.shards[k], u.offset, u.count)) u.shards.push_back(k);
    }
  }
}

FsdpParameters::~FsdpParameters() = default;

void FsdpParameters::set_storage(float* masters, void* working, DType working_dtype, void* stream) {
  Impl& m = *impl_;
  FLASHLM_CHECK(masters != nullptr, "FsdpParameters::set_storage: masters is null");
  FLASHLM_CHECK(working == nullptr || working_dtype == DType::bf16 || working_dtype == DType::f16,
                "FsdpParameters::set_storage: a working copy must be bf16 or fp16, got {}", dtype_name(working_dtype));
  m.masters = masters;
  m.working = working;
  m.working_dtype = working_dtype;
  m.stream = stream;
  m.live_bytes = 0;  // in the types the shards are now gathered in
  for (const Impl::Shard& s : m.shards) {
    if (s.state != Impl::State::released) m.live_bytes += m.foreign_bytes(s);
  }
  m.peak_bytes = 0;
}

void FsdpParameters::use_sharded_storage(std::span<ParameterStorage> table, DType working_dtype, bool pure,
                                         int64_t grad_accum, void* stream,
                                         std::function<void(int64_t, int64_t)> await_gradients,
                                         std::span<const DdpRange> fp8_groups) {
  Impl& m = *impl_;
  const DdpParameters& p = m.params;
  FLASHLM_CHECK(table.size() == p.layout.size(), "FsdpParameters::use_sharded_storage: a table of {} entries for {} "
                "parameters", table.size(), p.layout.size());
  FLASHLM_CHECK(working_dtype == DType::f32 || working_dtype == DType::bf16 || working_dtype == DType::f16,
                "FsdpParameters::use_sharded_storage: working_dtype {}, expected fp32, bf16 or fp16",
                dtype_name(working_dtype));
  FLASHLM_CHECK(!pure || working_dtype == DType::bf16,
                "FsdpParameters::use_sharded_storage: bf16-pure keeps bf16 parameters, not {}", dtype_name(working_dtype));
  FLASHLM_CHECK(grad_accum >= 1, "FsdpParameters::use_sharded_storage: grad_accum = {}, expected >= 1", grad_accum);
  for (size_t i = 0; i < p.layout.size(); ++i) {
    FLASHLM_CHECK(p.is_trainable(int64_t(i)) && p.owner(int64_t(i)) == int64_t(i),
                  "FsdpParameters::use_sharded_storage: '{}' is frozen or tied; sharded storage keeps trainable, "
                  "untied parameters only", p.layout[i].name);
  }
  m.sharded = true;
  m.pure = pure;
  m.table = table;
  m.working_dtype = working_dtype;
  m.stream = stream;
  m.await_gradients = std::move(await_gradients);
  // This rank's runs, packed ascending: ZeroOptimizer's updated_ranges() and its moments' order.
  const ZeroBucketLayout layout = zero_bucket_layout(m.buckets, m.comm.world_size(), m.comm.rank());
  for (const ZeroBucketShard& z : layout.buckets) {
    for (const DdpRange& r : {z.owned, z.tail}) {
      if (r.count > 0) m.runs.push_back(r);
    }
  }
  std::sort(m.runs.begin(), m.runs.end(), [](const DdpRange& a, const DdpRange& b) { return a.offset < b.offset; });
  int64_t total = 0;
  for (const DdpRange& r : m.runs) m.run_at.push_back(total), total += r.count;
  FLASHLM_CHECK(total == layout.shard_elements && total > 0, "FsdpParameters: {} packed elements, expected {}", total,
                layout.shard_elements);
  const Device device = p.device;
  const auto zeroed = [&](int64_t count, size_t esize, const char* what) {
    Buffer b = Buffer::allocate(size_t(count) * esize, device, what);
    if (device == Device::cpu) std::memset(b.data(), 0, b.bytes());
#ifdef FLASHLM_WITH_CUDA
    else gpu::memset_async(b.data(), 0, b.bytes(), stream);
#endif
    return b;
  };
  if (!pure) m.shard_masters = zeroed(total, sizeof(float), "FSDP parameters (fp32 master shard)");
  if (working_dtype != DType::f32) {
    m.shard_working = zeroed(total, dtype_size(working_dtype),
                             pure ? "FSDP parameters (bf16 shard)" : "FSDP parameters (low-precision shard)");
  }
  m.shard_grads = zeroed(total, sizeof(float), "FSDP gradients (shard)");
  // Per part: its sharded parameters, the type it is gathered in, its segments; the largest sizes the pool.
  m.stored = std::vector<Impl::UnitStorage>(m.units.size());
  if (!fp8_groups.empty() && !m.shards.empty()) {
    m.fp8 = std::make_unique<Fp8WeightGather>(m.comm, device);
    m.fp8_scales = zeroed(int64_t(fp8_groups.size()) * kFp8ScaleSlotFloats, sizeof(float),
                          "FSDP FP8 gather (a scale slot per weight group)");
#ifdef FLASHLM_WITH_CUDA
    if (m.cuda()) {
      FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.fp8_ready, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags (FSDP FP8 gather)");
    }
#endif
  }
  int64_t largest_bytes = 0, largest_count = 0;
  for (size_t u = 0; u < m.units.size(); ++u) {
    Impl::UnitStorage& us = m.stored[u];
    const Impl::Unit& unit = m.units[u];
    if (unit.shards.empty()) continue;
    us.dtype = m.dtype_of(m.shards[unit.shards.front()]);
    for (size_t k : unit.shards) {
      const Impl::Shard& x = m.shards[k];
      FLASHLM_CHECK(m.dtype_of(x) == us.dtype, "FsdpParameters: part {} mixes weights read in fp32 and in {}", u,
                    dtype_name(working_dtype));
      us.segments.push_back({x.segment.offset - unit.offset, x.segment.part});
    }
    for (size_t i = 0; i < p.layout.size(); ++i) {
      const int64_t at = p.layout[i].offset;
      if (m.unit_at(at) == int64_t(u) && m.in_shard(at)) us.params.push_back(i);
    }
    // FP8: a part holding scale groups (a layer) is gathered as e4m3 bytes; its sharded elements are exactly
    // its FP8 weights, each of which reads its group's scale slot.
    for (size_t g = 0; m.fp8 && g < fp8_groups.size(); ++g) {
      const DdpRange& r = fp8_groups[g];
      if (r.offset < unit.offset || r.offset >= unit.offset + unit.count) continue;
      FLASHLM_CHECK(r.offset + r.count <= unit.offset + unit.count, "FsdpParameters: FP8 scale group [{}, {}) "
                    "crosses the end of part {}", r.offset, r.offset + r.count, u);
      us.fp8_groups.push_back({r.offset - unit.offset, r.count,
                               static_cast<float*>(m.fp8_scales.data()) + g * kFp8ScaleSlotFloats});
    }
    if (!us.fp8_groups.empty()) {
      us.from = us.dtype;
      us.dtype = DType::f8e4m3;
      for (size_t i : us.params) {
        const ParameterInfo& info = p.layout[i];
        const auto in = std::find_if(us.fp8_groups.begin(), us.fp8_groups.end(), [&](const Fp8GatherGroup& x) {
          return unit.offset + x.offset <= info.offset && info.offset + info.numel() <= unit.offset + x.offset + x.count;
        });
        FLASHLM_CHECK(in != us.fp8_groups.end(), "FsdpParameters: '{}' is sharded in part {}, which is gathered in "
                      "FP8, but in none of its scale groups", info.name, u);
        table[i].fp8_scales = in->scales;
      }
    }
    largest_bytes = std::max(largest_bytes, unit.count * int64_t(dtype_size(us.dtype)));
    largest_count = std::max(largest_count, unit.count);
#ifdef FLASHLM_WITH_CUDA
    if (m.cuda()) {
      FLASHLM_CUDA_CHECK(cudaEventCreateWithFlags(&us.gathered, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags (FSDP gather)");
    }
#endif
  }
  if (largest_bytes > 0) {
    // The part being read, the `prefetch` arriving, and one more: a part gathered again while the one
    // before it is still being freed (a recomputing backward).
    m.pool.resize(size_t(m.prefetch + 2));
    for (Impl::Slot& slot : m.pool) {
      slot.buffer = Buffer::allocate(size_t(largest_bytes), device, "FSDP gathered part (pool)");
      if (m.poison) m.fill_nan(slot.buffer.data(), largest_bytes, DType::f8e4m3);  // every byte
    }
    if (grad_accum == 1) {
      m.grad_pool.resize(2);  // one being written by the backward, one being reduce-scattered
      for (Impl::Slot& slot : m.grad_pool) {
        slot.buffer = Buffer::allocate(size_t(largest_count) * sizeof(float), device, "FSDP part gradients");
      }
    } else {
      m.local_grads = zeroed(p.flat_size(), sizeof(float), "FSDP gradients (whole, for grad_accum > 1)");
    }
  }
  for (size_t i = 0; i < p.layout.size(); ++i) {
    const ParameterInfo& q = p.layout[i];
    ParameterStorage& t = table[i];
    if (!m.in_shard(q.offset)) {  // kept whole on every rank: read and written in the shards
      const int64_t at = m.packed(q.offset);
      FLASHLM_CHECK(at >= 0, "FsdpParameters: '{}' is neither sharded nor kept", q.name);
      t.master = pure ? nullptr : static_cast<float*>(m.shard_masters.data()) + at;
      t.weight = m.packed_weight(at, working_dtype);
      t.grad = static_cast<float*>(m.shard_grads.data()) + at;
    } else {
      m.point_away(i);
      t.grad = m.local_grads.data() ? static_cast<float*>(m.local_grads.data()) + q.offset : nullptr;
    }
  }
  for (Impl::Shard& x : m.shards) x.state = Impl::State::released;
  m.live_bytes = m.peak_bytes = 0;
}

bool FsdpParameters::sharded() const { return impl_->sharded; }
float* FsdpParameters::shard_masters() const { return static_cast<float*>(impl_->shard_masters.data()); }
void* FsdpParameters::shard_working() const { return impl_->shard_working.data(); }
float* FsdpParameters::shard_gradients() const { return static_cast<float*>(impl_->shard_grads.data()); }

int64_t FsdpParameters::packed_index(int64_t offset) const {
  const int64_t at = impl_->packed(offset);
  FLASHLM_CHECK(at >= 0, "FsdpParameters::packed_index: element {} is not kept by rank {}", offset, impl_->comm.rank());
  return at;
}

float* FsdpParameters::gradient_source(int64_t offset) const {
  const Impl& m = *impl_;
  FLASHLM_CHECK(m.sharded, "FsdpParameters::gradient_source: not sharded storage");
  if (!m.in_shard(offset)) return static_cast<float*>(m.shard_grads.data()) + m.packed(offset);
  if (m.local_grads.data()) return static_cast<float*>(m.local_grads.data()) + offset;
  const int64_t u = m.unit_at(offset);
  const int slot = m.stored[size_t(u)].grad_slot;
  FLASHLM_CHECK(slot >= 0, "FsdpParameters::gradient_source: element {}'s part has no gradient buffer (the model "
                "did not call its GradientsNeededHook)", offset);
  return static_cast<float*>(m.grad_pool[size_t(slot)].buffer.data()) + (offset - m.units[size_t(u)].offset);
}

void FsdpParameters::gradients_needed(int64_t offset, int64_t count) {
  Impl& m = *impl_;
  if (!m.sharded || m.grad_pool.empty()) return;
  const int64_t u = m.unit_of(offset, count);
  FLASHLM_CHECK(u >= 0, "FsdpParameters::gradients_needed: [{}, {}) is not a model part", offset, offset + count);
  Impl::UnitStorage& us = m.stored[size_t(u)];
  if (us.params.empty() || us.grad_slot >= 0) return;
  const size_t k = m.next_grad_slot;
  m.next_grad_slot = (k + 1) % m.grad_pool.size();
  Impl::Slot& slot = m.grad_pool[k];
  if (slot.unit >= 0) {
    // Its last part's reduce-scatter reads it: reusable once that is done (CUDA: the model's stream waits).
    const Impl::Unit& before = m.units[size_t(slot.unit)];
    if (m.await_gradients) m.await_gradients(before.offset, before.count);
    m.stored[size_t(slot.unit)].grad_slot = -1;
  }
  slot.unit = u;
  us.grad_slot = int(k);
  float* base = static_cast<float*>(slot.buffer.data());
  // The CPU model adds to its gradients; the CUDA model writes over them after zero_grad() (grad_accum 1).
  if (!m.cuda()) std::fill_n(base, m.units[size_t(u)].count, 0.0f);
  for (size_t i : us.params) m.table[i].grad = base + (m.params.layout[i].offset - m.units[size_t(u)].offset);
}

void FsdpParameters::zero_gradients() {
  Impl& m = *impl_;
  if (!m.sharded || m.cuda()) return;
  std::memset(m.shard_grads.data(), 0, m.shard_grads.bytes());
  if (m.local_grads.data()) std::memset(m.local_grads.data(), 0, m.local_grads.bytes());
}

int64_t FsdpParameters::buffer_bytes() const {
  const Impl& m = *impl_;
  int64_t bytes = int64_t(m.local_grads.bytes()) + int64_t(m.fp8_scales.bytes());
  for (const Impl::Slot& s : m.pool) bytes += int64_t(s.buffer.bytes());
  for (const Impl::Slot& s : m.grad_pool) bytes += int64_t(s.buffer.bytes());
  return bytes;
}

void FsdpParameters::begin_pass(bool backward) {
  Impl& m = *impl_;
  // A backward hands out the gradient buffers afresh (the last one's may still be being reduce-scattered:
  // gradients_needed() waits for that before reusing one).
  if (backward) {
    for (Impl::UnitStorage& us : m.stored) us.grad_slot = -1;
  }
  if (!m.recording.empty()) m.pass_order[m.backward] = std::move(m.recording);
  m.recording.clear();
  m.backward = backward;
  m.cursor = 0;
}

void FsdpParameters::needed_sharded(int64_t offset, int64_t count) {
  Impl& m = *impl_;
  const int64_t u = m.unit_of(offset, count);
  FLASHLM_CHECK(u >= 0, "FsdpParameters::needed: [{}, {}) is not a model part", offset, offset + count);
  m.start_unit(size_t(u), true);
  if (m.recording.empty() || m.recording.back() != u) m.recording.push_back(u);
  int64_t ahead = 0;
  for (int64_t next : m.parts_after(u)) {
    if (ahead == m.prefetch) break;
    if (m.stored[size_t(next)].segments.empty()) continue;
    m.start_unit(size_t(next), false);
    ++ahead;
  }
  m.finish_unit(size_t(u));
}

void FsdpParameters::needed(int64_t offset, int64_t count) {
  Impl& m = *impl_;
  // Held whole (evaluation, which runs on one rank alone): nothing to gather, and nothing to record, since
  // the other ranks do not see these calls.
  if (m.held) return;
  if (m.sharded) return needed_sharded(offset, count);
  for (Impl::Shard& s : m.shards) {
    if (m.overlaps(s, offset, count)) m.start(s);
  }
  // The next `prefetch` parts with shards start arriving while this one computes.
  const int64_t u = m.unit_of(offset, count);
  if (u < 0) return m.finish_overlapping(offset, count);
  if (m.recording.empty() || m.recording.back() != u) m.recording.push_back(u);
  int64_t ahead = 0;
  for (int64_t next : m.parts_after(u)) {
    if (ahead == m.prefetch) break;
    if (m.units[size_t(next)].shards.empty()) continue;
    for (size_t k : m.units[size_t(next)].shards) m.start(m.shards[k]);
    ++ahead;
  }
  m.finish_overlapping(offset, count);
}

void FsdpParameters::done(int64_t offset, int64_t count) {
  Impl& m = *impl_;
  if (m.held) return;
  if (m.sharded) {
    const int64_t u = m.unit_of(offset, count);
    if (u >= 0) m.release_unit(size_t(u));
    return;
  }
  for (Impl::Shard& s : m.shards) {
    if (m.overlaps(s, offset, count)) m.release(s);
  }
}

void FsdpParameters::release_all() {
  Impl& m = *impl_;
  m.held = false;
  if (m.sharded) return m.release_everything();
  for (Impl::Shard& s : m.shards) m.release(s);
}

void FsdpParameters::mark_whole() {
  Impl& m = *impl_;
  if (m.sharded) return;  // no rank holds the other ranks' parts: a broadcast gives none
  for (Impl::Shard& s : m.shards) {
    m.finish(s);
    if (s.state == Impl::State::released) m.live_bytes += m.foreign_bytes(s);
    s.state = Impl::State::whole;
  }
}

void FsdpParameters::gather_all() {
  Impl& m = *impl_;
  if (m.sharded) {
    // Every part whole at once: one buffer of the whole model (in the types the parts are read in), held
    // until the next release_all() or hold(false).
    m.release_everything();
    m.everything_at.assign(m.units.size(), 0);
    int64_t bytes = 0;
    for (size_t u = 0; u < m.units.size(); ++u) {
      m.everything_at[u] = bytes;
      if (!m.stored[u].segments.empty()) bytes += (m.units[u].count * int64_t(dtype_size(m.stored[u].dtype)) + 255) / 256 * 256;
    }
    m.everything = Buffer::allocate(size_t(bytes), m.params.device, "FSDP every part gathered (evaluation)");
    for (size_t u = 0; u < m.units.size(); ++u) {
      if (m.stored[u].segments.empty()) continue;
      m.stored[u].slot = -1;
      m.gather_into(u);
    }
    for (size_t u = 0; u < m.units.size(); ++u) m.finish_unit(u);
    m.held = true;
    return;
  }
  for (Impl::Shard& s : m.shards) m.start(s);
  for (Impl::Shard& s : m.shards) m.finish(s);
  m.held = true;
}

void FsdpParameters::hold(bool keep) {
  Impl& m = *impl_;
  m.held = keep;
  if (!keep && m.sharded && m.everything.data()) m.release_everything();
}

void FsdpParameters::await_all() {
  Impl& m = *impl_;
  if (m.sharded) {
    for (size_t u = 0; u < m.units.size(); ++u) m.finish_unit(u);
    return;
  }
  for (Impl::Shard& s : m.shards) m.finish(s);
}

int64_t FsdpParameters::units() const {
  return std::count_if(impl_->units.begin(), impl_->units.end(), [](const Impl::Unit& u) { return !u.shards.empty(); });
}

bool FsdpParameters::released(int64_t offset, int64_t count) const {
  const Impl& m = *impl_;
  if (m.sharded) {
    for (size_t u = 0; u < m.units.size(); ++u) {
      const Impl::Unit& unit = m.units[u];
      const bool touches = unit.offset < offset + count && offset < unit.offset + unit.count;
      if (touches && !m.stored[u].segments.empty() && m.stored[u].state != Impl::State::released) return false;
    }
    return true;
  }
  return std::all_of(m.shards.begin(), m.shards.end(), [&](const Impl::Shard& s) {
    return !m.overlaps(s, offset, count) || s.state == Impl::State::released;
  });
}

int64_t FsdpParameters::peak_gathered_bytes() const { return impl_->peak_bytes; }

FsdpGatherTraffic FsdpParameters::gather_traffic() const { return impl_->traffic; }

int64_t FsdpParameters::fp8_units() const {
  return std::count_if(impl_->stored.begin(), impl_->stored.end(),
                       [](const Impl::UnitStorage& us) { return us.dtype == DType::f8e4m3; });
}

}  // namespace flashlm
