#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "flashlm/error.h"
#include "flashlm/tensor.h"

using namespace flashlm;

TEST(Tensor, ContiguousViewHasRowMajorStrides) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::f32);
  EXPECT_EQ(t.view().stride(0), 12);
  EXPECT_EQ(t.view().stride(1), 4);
  EXPECT_EQ(t.view().stride(2), 1);
  EXPECT_TRUE(t.view().is_contiguous());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.bytes(), 96u);
}

TEST(Tensor, PermuteAndSliceShareMemory) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::f64);
  for (int i = 0; i < 24; ++i) t.view().ptr<double>()[i] = i;
  const TensorView p = t.view().permute({2, 0, 1});  // [4, 2, 3]
  EXPECT_EQ(p.size(0), 4);
  EXPECT_EQ(p.stride(0), 1);
  EXPECT_FALSE(p.is_contiguous());
  const TensorView s = t.view().slice(1, 1, 3);  // [2, 2, 4], starts at element 4
  EXPECT_EQ(s.ptr<double>()[0], 4.0);
  Tensor dense = Tensor::empty({2, 2, 4}, DType::f32);
  copy_into(dense, s);
  EXPECT_EQ(dense.view().ptr<float>()[0], 4.0f);
  EXPECT_EQ(dense.view().ptr<float>()[8], 16.0f);  // batch 1, row 1 of the original
  EXPECT_THROW(t.view().slice(1, 2, 5), Error);
  EXPECT_THROW(t.view().permute({0, 0, 1}), Error);
}

TEST(Tensor, FillNormalIsReproducibleAndLayoutIndependent) {
  Tensor a = Tensor::empty({64, 32}, DType::f32);
  Tensor b = Tensor::empty({32, 64}, DType::f32);
  fill_normal(a, 7);
  fill_normal(b.view().permute({1, 0}), 7);  // same logical order through a transposed view
  double sum = 0, sum2 = 0;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 32; ++j) {
      const float x = a.view().ptr<float>()[i * 32 + j];
      EXPECT_EQ(x, b.view().ptr<float>()[j * 64 + i]);
      sum += x;
      sum2 += x * x;
    }
  EXPECT_NEAR(sum / 2048, 0.0, 0.1);
  EXPECT_NEAR(sum2 / 2048, 1.0, 0.1);
  Tensor c = Tensor::empty({64, 32}, DType::f32);
  fill_normal(c, 8);
  EXPECT_NE(a.view().ptr<float>()[0], c.view().ptr<float>()[0]);
}

// Sizes whose element count or byte size leaves int64 fail by name instead of wrapping into a small buffer.
TEST(Tensor, SizeProductsThatOverflowAreErrors) {
  const int64_t huge = (int64_t{1} << 62) + 1;
  try {
    Tensor::empty({huge, 4, 1, 4}, DType::f32);
    FAIL() << "expected flashlm::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("element count"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("overflows"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tensor::empty({int64_t{1} << 61, 2}, DType::f64), Error);  // elements fit, bytes do not
  std::vector<float> one(1);
  const int64_t sizes[] = {huge, 2};
  EXPECT_THROW(TensorView::contiguous(one.data(), DType::f32, sizes), Error);
}

TEST(Memory, TracksCurrentAndPeakBytes) {
  const MemoryStats before = memory_stats(Device::cpu);
  memory_reset_peak(Device::cpu);
  {
    Tensor t = Tensor::empty({1024, 1024}, DType::f32);
    EXPECT_EQ(memory_stats(Device::cpu).current_bytes, before.current_bytes + 4 * 1024 * 1024);
  }
  EXPECT_EQ(memory_stats(Device::cpu).current_bytes, before.current_bytes);
  EXPECT_EQ(memory_stats(Device::cpu).peak_bytes, before.current_bytes + 4 * 1024 * 1024);
}

TEST(Memory, ReusedHostBlocksGoToTheNextRequestThatFitsAndCountOnlyWhileInUse) {
  release_cached_host_memory();
  const int64_t base = memory_stats(Device::cpu).current_bytes;
  void* first = nullptr;
  {
    Buffer a = Buffer::allocate_reused(3 << 20, "reused a");
    first = a.data();
    std::memset(a.data(), 0x5a, a.bytes());  // pages touched, as a workspace's are
    EXPECT_EQ(memory_stats(Device::cpu).current_bytes, base + (3 << 20));
  }
  EXPECT_EQ(memory_stats(Device::cpu).current_bytes, base);  // the cached block is free memory
  {
    Buffer bigger = Buffer::allocate_reused((3 << 20) + 64, "reused bigger");  // does not fit the cached block
    EXPECT_NE(bigger.data(), first);
    Buffer smaller = Buffer::allocate_reused(1 << 20, "reused smaller");  // fits: takes it
    EXPECT_EQ(smaller.data(), first);
    EXPECT_EQ(memory_stats(Device::cpu).current_bytes, base + (3 << 20) + 64 + (1 << 20));
  }
  {  // both blocks cached now: the smallest that fits is taken
    Buffer again = Buffer::allocate_reused(2 << 20, "reused again");
    EXPECT_EQ(again.data(), first);
  }
  release_cached_host_memory();
  Buffer after = Buffer::allocate_reused(1 << 20, "after release");
  EXPECT_NE(after.data(), nullptr);
  EXPECT_EQ(memory_stats(Device::cpu).current_bytes, base + (1 << 20));
}

TEST(Memory, ImpossibleHostAllocationIsOutOfMemoryNotACrash) {
  try {
    Buffer::allocate(size_t{1} << 52, Device::cpu, "too big");
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("too big"), std::string::npos) << e.what();
  }
}

TEST(Memory, CudaAllocationWithoutCudaIsAClearError) {
#ifdef FLASHLM_WITH_CUDA
  GTEST_SKIP() << "built with CUDA: covered by the GPU tests";
#else
  EXPECT_THROW(Buffer::allocate(16, Device::cuda, "x"), Error);
#endif
}
