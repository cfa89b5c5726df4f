// FSDP's parameter lifetime (include/flashlm/ddp.h, FsdpParameters): per sharded bucket, whether the other
// ranks' parts are whole on this rank, arriving, or released; the model's parts (fsdp_unit_name) in the
// order the forward reads them, for the prefetch. The reduce-scatter of the gradients is DataParallel's and
// the sharded update ZeroOptimizer's; this file only gathers and frees.
#include <algorithm>
#include <limits>

#include "core/check.h"
#include "flashlm/ddp.h"
#include "flashlm/dist.h"

#ifdef FLASHLM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/array_ops.h"
#include "core/cuda_check.h"
#endif

namespace flashlm {

struct FsdpParameters::Impl {
  enum class State : uint8_t { released, arriving, whole };
  // One sharded bucket: rank r owns [offset + r·part, offset + (r + 1)·part) of it.
  struct Shard {
    Communicator::Segment segment;
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
  std::vector<int64_t> recording;  // the current pass's
  size_t cursor = 0;               // where in pass_order[backward] the last needed() part was found
  int64_t live_bytes = 0, peak_bytes = 0;

  Impl(Communicator& c, DdpParameters p) : comm(c), params(std::move(p)) {}
  ~Impl() {
#ifdef FLASHLM_WITH_CUDA
    for (Shard& s : shards) {
      if (s.gathered) cudaEventDestroy(s.gathered);
    }
#endif
  }

  bool cuda() const { return params.device == Device::cuda; }
  bool in_master(const Shard& s) const { return working == nullptr || s.reads_master; }
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

  // The unit whose elements are exactly these (a model part's needed/done call), or -1.
  int64_t unit_of(int64_t offset, int64_t count) const {
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].offset == offset && units[u].count == count) return int64_t(u);
    }
    return -1;
  }
};

FsdpParameters::FsdpParameters(Communicator& comm, DdpParameters params, std::span<const DdpBucket> buckets,
                               int prefetch, bool poison_freed)
    : impl_(std::make_unique<Impl>(comm, std::move(params))) {
  Impl& m = *impl_;
  m.params.validate();
  FLASHLM_CHECK(prefetch >= 0 && prefetch <= 2, "FsdpParameters: prefetch = {}, expected 0, 1 or 2 parts ahead",
                prefetch);
  comm.agree(prefetch, "the FSDP prefetch depth");
  m.prefetch = prefetch;
  m.poison = poison_freed;
  const std::vector<DdpRange> reads = m.params.read_as_master_ranges();
  const ZeroBucketLayout layout = zero_bucket_layout(buckets, comm.world_size(), comm.rank());
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ZeroBucketShard& z = layout.buckets[b];
    // Nothing to gather: a replicated bucket, or a world of one.
    if (z.part == 0 || comm.world_size() == 1) continue;
    Impl::Shard s;
    s.segment = {z.offset, z.part};
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

void FsdpParameters::begin_pass(bool backward) {
  Impl& m = *impl_;
  if (!m.recording.empty()) m.pass_order[m.backward] = std::move(m.recording);
  m.recording.clear();
  m.backward = backward;
  m.cursor = 0;
}

void FsdpParameters::needed(int64_t offset, int64_t count) {
  Impl& m = *impl_;
  // Held whole (evaluation, which runs on one rank alone): nothing to gather, and nothing to record, since
  // the other ranks do not see these calls.
  if (m.held) return;
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
  for (Impl::Shard& s : m.shards) {
    if (m.overlaps(s, offset, count)) m.release(s);
  }
}

void FsdpParameters::release_all() {
  Impl& m = *impl_;
  m.held = false;
  for (Impl::Shard& s : m.shards) m.release(s);
}

void FsdpParameters::mark_whole() {
  Impl& m = *impl_;
  for (Impl::Shard& s : m.shards) {
    m.finish(s);
    if (s.state == Impl::State::released) m.live_bytes += m.foreign_bytes(s);
    s.state = Impl::State::whole;
  }
}

void FsdpParameters::gather_all() {
  Impl& m = *impl_;
  for (Impl::Shard& s : m.shards) m.start(s);
  for (Impl::Shard& s : m.shards) m.finish(s);
  m.held = true;
}

void FsdpParameters::hold(bool keep) { impl_->held = keep; }

void FsdpParameters::await_all() {
  Impl& m = *impl_;
  for (Impl::Shard& s : m.shards) m.finish(s);
}

int64_t FsdpParameters::units() const {
  return std::count_if(impl_->units.begin(), impl_->units.end(), [](const Impl::Unit& u) { return !u.shards.empty(); });
}

bool FsdpParameters::released(int64_t offset, int64_t count) const {
  const Impl& m = *impl_;
  return std::all_of(m.shards.begin(), m.shards.end(), [&](const Impl::Shard& s) {
    return !m.overlaps(s, offset, count) || s.state == Impl::State::released;
  });
}

int64_t FsdpParameters::peak_gathered_bytes() const { return impl_->peak_bytes; }

}  // namespace flashlm
