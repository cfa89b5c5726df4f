// TensorView: a non-owning strided view (sizes and element strides, dtype, device) — the type every
// public function takes. Tensor: an owning, tracked allocation plus its contiguous view.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "flashlm/dtype.h"
#include "flashlm/memory.h"

namespace flashlm {

constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> sizes{};
  std::array<int64_t, kMaxDims> strides{};  // in elements, not bytes

  int64_t size(int d) const { return sizes[static_cast<size_t>(d)]; }
  int64_t stride(int d) const { return strides[static_cast<size_t>(d)]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[2, 128, 8, 64] fp32 cpu"

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }

  // Views of the same memory.
  TensorView permute(std::initializer_list<int> order) const;   // order[i] = old dimension of new i
  TensorView slice(int dim, int64_t begin, int64_t end) const;  // [begin, end) along dim

  static TensorView contiguous(void* data, DType dtype, std::span<const int64_t> sizes, Device device = Device::cpu);
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                               Device device = Device::cpu) {
    return contiguous(data, dtype, std::span<const int64_t>(sizes.begin(), sizes.size()), device);
  }
};

// Owns its memory (through the tracked allocator) and exposes a contiguous view of it.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(std::initializer_list<int64_t> sizes, DType dtype, Device device = Device::cpu,
                      std::string_view tag = "tensor");
  static Tensor empty(std::span<const int64_t> sizes, DType dtype, Device device = Device::cpu,
                      std::string_view tag = "tensor");

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable wherever a view is
  void* data() const { return view_.data; }
  int64_t numel() const { return view_.numel(); }
  size_t bytes() const { return buffer_.bytes(); }

 private:
  Buffer buffer_;
  TensorView view_;
};

// Fills a CPU view with independent N(0, stddev²) draws (a counter-based stream: the same seed gives the
// same values whatever the strides). Any dtype.
void fill_normal(const TensorView& t, uint64_t seed, double stddev = 1.0);

// Fills a CPU view with one value (NaN poisons an output so that unwritten elements show).
void fill_value(const TensorView& t, double value);

// Element-wise copy between two CPU views of the same shape, converting dtypes.
void copy_into(const TensorView& dst, const TensorView& src);

// Calls fn(offset_in_elements, linear_index) for every element of a view in row-major order.
template <class Fn>
void for_each_offset(const TensorView& t, Fn&& fn) {
  if (t.numel() == 0) return;
  std::array<int64_t, kMaxDims> idx{};
  int64_t offset = 0;
  for (int64_t n = 0, total = t.numel(); n < total; ++n) {
    fn(offset, n);
    for (int d = t.ndim - 1; d >= 0; --d) {
      const auto u = static_cast<size_t>(d);
      if (++idx[u] < t.sizes[u]) { offset += t.strides[u]; break; }
      offset -= (t.sizes[u] - 1) * t.strides[u];
      idx[u] = 0;
    }
  }
}

}  // namespace flashlm
