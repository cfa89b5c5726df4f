#include "flashlm/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "core/check.h"
#include "core/cuda_runtime.h"
#include "core/random.h"

namespace flashlm {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n = checked_mul(n, size(d), "TensorView: element count");
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (size(d) != 1 && stride(d) != expected) return false;
    expected *= size(d);
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::vector<int64_t> s(sizes.begin(), sizes.begin() + ndim);
  return fmt::format("[{}] {} {}", fmt::join(s, ", "), dtype_name(dtype), device_name(device));
}

TensorView TensorView::permute(std::initializer_list<int> order) const {
  FLASHLM_CHECK(static_cast<int>(order.size()) == ndim, "TensorView::permute: {} indices for a {}-dim view",
                order.size(), ndim);
  TensorView out = *this;
  int i = 0;
  unsigned seen = 0;
  for (int d : order) {
    FLASHLM_CHECK(d >= 0 && d < ndim && !(seen & (1u << d)), "TensorView::permute: bad dimension {}", d);
    seen |= 1u << d;
    out.sizes[static_cast<size_t>(i)] = size(d);
    out.strides[static_cast<size_t>(i)] = stride(d);
    ++i;
  }
  return out;
}

TensorView TensorView::slice(int dim, int64_t begin, int64_t end) const {
  FLASHLM_CHECK(dim >= 0 && dim < ndim, "TensorView::slice: dimension {} of a {}-dim view", dim, ndim);
  FLASHLM_CHECK(0 <= begin && begin <= end && end <= size(dim), "TensorView::slice: range [{}, {}) outside [0, {})",
                begin, end, size(dim));
  TensorView out = *this;
  out.data = static_cast<char*>(data) + begin * stride(dim) * static_cast<int64_t>(dtype_size(dtype));
  out.sizes[static_cast<size_t>(dim)] = end - begin;
  return out;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::span<const int64_t> sizes, Device device) {
  FLASHLM_CHECK(sizes.size() <= static_cast<size_t>(kMaxDims), "TensorView: {} dimensions, at most {} supported",
                sizes.size(), kMaxDims);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(sizes.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    FLASHLM_CHECK(sizes[static_cast<size_t>(d)] >= 0, "TensorView: negative size {} in dimension {}",
                  sizes[static_cast<size_t>(d)], d);
    v.sizes[static_cast<size_t>(d)] = sizes[static_cast<size_t>(d)];
    v.strides[static_cast<size_t>(d)] = stride;
    stride = checked_mul(stride, sizes[static_cast<size_t>(d)], "TensorView: element count");
  }
  return v;
}

Tensor Tensor::empty(std::initializer_list<int64_t> sizes, DType dtype, Device device, std::string_view tag) {
  return empty(std::span<const int64_t>(sizes.begin(), sizes.size()), dtype, device, tag);
}

Tensor Tensor::empty(std::span<const int64_t> sizes, DType dtype, Device device, std::string_view tag) {
  Tensor t;
  t.view_ = TensorView::contiguous(nullptr, dtype, sizes, device);
  const int64_t bytes = checked_mul(t.view_.numel(), static_cast<int64_t>(dtype_size(dtype)), "Tensor::empty: bytes");
  t.buffer_ = Buffer::allocate(static_cast<size_t>(bytes), device, tag);
  t.view_.data = t.buffer_.data();
  return t;
}

namespace {

double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

void require_cpu(const TensorView& t, std::string_view fn) {
  FLASHLM_CHECK(t.device == Device::cpu, "{}: expected a cpu tensor, got {}", fn, t.shape_string());
  FLASHLM_CHECK(t.data != nullptr || t.numel() == 0, "{}: null data pointer for {}", fn, t.shape_string());
}

// CUDA views are filled through a host copy (tests and benchmarks only: not a hot path).
template <class Fill>
bool fill_through_host(const TensorView& t, std::string_view fn, Fill&& fill) {
  if (t.device != Device::cuda) return false;
  FLASHLM_CHECK(t.is_contiguous(), "{}: a cuda view must be contiguous, got strides of {}", fn, t.shape_string());
  Tensor host = Tensor::empty(std::span<const int64_t>(t.sizes.data(), static_cast<size_t>(t.ndim)), t.dtype);
  fill(host.view());
  cuda_copy(t.data, host.data(), host.bytes());
  return true;
}

}  // namespace

void fill_normal(const TensorView& t, uint64_t seed, double stddev) {
  if (fill_through_host(t, "fill_normal", [&](const TensorView& h) { fill_normal(h, seed, stddev); })) return;
  require_cpu(t, "fill_normal");
  dispatch_dtype(t.dtype, [&](auto zero) {
    using T = decltype(zero);
    T* base = t.ptr<T>();
    auto draw = [&](int64_t n) {
      const uint64_t key = counter_draw(seed, static_cast<uint64_t>(n));  // element n depends only on (seed, n)
      const double u1 = uniform01(key), u2 = uniform01(splitmix64(key));
      const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);  // Box-Muller
      return convert<T>(z * stddev);
    };
    if (t.is_contiguous()) {
      // The benchmarks fill hundreds of millions of elements per shape: in parallel (same values).
      const int64_t count = t.numel();
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < count; ++n) base[n] = draw(n);
    } else {
      for_each_offset(t, [&](int64_t offset, int64_t n) { base[offset] = draw(n); });
    }
  });
}

void fill_value(const TensorView& t, double value) {
  if (fill_through_host(t, "fill_value", [&](const TensorView& h) { fill_value(h, value); })) return;
  require_cpu(t, "fill_value");
  dispatch_dtype(t.dtype, [&](auto zero) {
    using T = decltype(zero);
    const T x = convert<T>(value);
    T* base = t.ptr<T>();
    for_each_offset(t, [&](int64_t offset, int64_t) { base[offset] = x; });
  });
}

void copy_into(const TensorView& dst, const TensorView& src) {
  if (dst.device == Device::cuda || src.device == Device::cuda) {
    // Between devices: a byte copy of contiguous views of one size; a change of dtype (or layout on the host
    // side) goes through a host copy in the device view's dtype.
    const TensorView& device_side = src.device == Device::cuda ? src : dst;
    const TensorView& other = src.device == Device::cuda ? dst : src;
    FLASHLM_CHECK(dst.numel() == src.numel() && device_side.is_contiguous() &&
                      (other.device == Device::cpu || other.is_contiguous()),
                  "copy_into: across devices both views must have one size and the cuda ones be contiguous: dst {}, "
                  "src {}",
                  dst.shape_string(), src.shape_string());
    if (dst.dtype != src.dtype || !other.is_contiguous()) {
      FLASHLM_CHECK(other.device == Device::cpu,
                    "copy_into: between two cuda views the dtypes must match: dst {}, src {}", dst.shape_string(),
                    src.shape_string());
      Tensor host = Tensor::empty(std::span<const int64_t>(other.sizes.data(), static_cast<size_t>(other.ndim)),
                                  device_side.dtype);
      if (src.device == Device::cuda) {
        cuda_copy(host.data(), src.data, host.bytes());
        copy_into(dst, host.view());
      } else {
        copy_into(host.view(), src);
        cuda_copy(dst.data, host.data(), host.bytes());
      }
      return;
    }
    cuda_copy(dst.data, src.data, static_cast<size_t>(src.numel()) * dtype_size(src.dtype));
    return;
  }
  require_cpu(dst, "copy_into: dst");
  require_cpu(src, "copy_into: src");
  bool same = dst.ndim == src.ndim;
  for (int d = 0; same && d < dst.ndim; ++d) same = dst.size(d) == src.size(d);
  FLASHLM_CHECK(same, "copy_into: dst {} and src {} differ in shape", dst.shape_string(), src.shape_string());
  // Gather the source in row-major order as fp64, then scatter: simple, and exact for every dtype here.
  std::vector<double> values(static_cast<size_t>(src.numel()));
  dispatch_dtype(src.dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* base = src.ptr<T>();
    for_each_offset(src, [&](int64_t offset, int64_t n) { values[static_cast<size_t>(n)] = convert<double>(base[offset]); });
  });
  dispatch_dtype(dst.dtype, [&](auto zero) {
    using T = decltype(zero);
    T* base = dst.ptr<T>();
    for_each_offset(dst, [&](int64_t offset, int64_t n) { base[offset] = convert<T>(values[static_cast<size_t>(n)]); });
  });
}

}  // namespace flashlm
