// Every bad argument to attention_forward / attention_backward is a flashlm::Error naming the argument.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "attention/attention_testing.h"
#include "flashlm/attention.h"
#include "flashlm/flashlm.h"

using namespace flashlm;
using flashlm::testing::c_tensor;
using flashlm::testing::expect_error;

namespace {

struct Args {
  Tensor q = Tensor::empty({2, 8, 4, 16}, DType::f32);
  Tensor k = Tensor::empty({2, 6, 2, 16}, DType::f32);
  Tensor v = Tensor::empty({2, 6, 2, 16}, DType::f32);
  Tensor o = Tensor::empty({2, 8, 4, 16}, DType::f32);
  Tensor lse = Tensor::empty({2, 4, 8}, DType::f32);
  Tensor dout = Tensor::empty({2, 8, 4, 16}, DType::f32);
  Tensor dq = Tensor::empty({2, 8, 4, 16}, DType::f32);
  Tensor dk = Tensor::empty({2, 6, 2, 16}, DType::f32);
  Tensor dv = Tensor::empty({2, 6, 2, 16}, DType::f32);
  TensorView Q = q, K = k, V = v, O = o, L = lse, dO = dout, dQ = dq, dK = dk, dV = dv;
  Args() {
    for (const Tensor* t : {&q, &k, &v, &dout}) fill_normal(*t, 1);
  }
  void forward() { attention_forward(Q, K, V, O, L); }
  void backward() { attention_backward(Q, K, V, O, L, dO, dQ, dK, dV); }
};

TEST(AttentionErrors, ValidArgumentsRun) {
  Args a;
  EXPECT_NO_THROW(a.forward());
  EXPECT_NO_THROW(a.backward());
}

// An output sharing memory with an input (the same buffer, or an overlapping slice) is an error at the
// C++ entry point (and so through the C ABI and Python, which call it).
TEST(AttentionErrors, OutputsOverlappingInputs) {
  {
    Args a;
    a.O = a.Q;
    expect_error([&] { a.forward(); }, {"attention_forward", "o: the output overlaps the input q"});
  }
  {
    Args a;
    // o starts inside v; both live in one allocation, so o overlaps v and nothing else whatever the
    // allocator put next to it (o is larger than v: an o reaching past v's own allocation could overlap q).
    Tensor both = Tensor::empty({3, 8, 4, 16}, DType::f32);
    fill_normal(both, 2);
    a.V = TensorView::contiguous(both.data(), DType::f32, {2, 6, 2, 16});
    a.O = TensorView::contiguous(static_cast<char*>(both.data()) + 64, DType::f32, {2, 8, 4, 16});
    expect_error([&] { a.forward(); }, {"o: the output overlaps the input v"});
  }
  {
    Args a;
    a.L = TensorView::contiguous(a.o.data(), DType::f32, {2, 4, 8});
    expect_error([&] { a.forward(); }, {"lse: the output overlaps the input o"});
  }
  for (const char* name : {"dq", "dk", "dv"}) {
    Args a;
    a.forward();
    TensorView& grad = std::string(name) == "dq" ? a.dQ : std::string(name) == "dk" ? a.dK : a.dV;
    grad = std::string(name) == "dq" ? a.dO : a.K;
    expect_error([&] { a.backward(); },
                 {"attention_backward", std::string(name) + ": the output overlaps the input " +
                                            (std::string(name) == "dq" ? "dout" : "k")});
  }
  {
    Args a;  // disjoint slices of one buffer are fine
    Tensor both = Tensor::empty({4, 8, 4, 16}, DType::f32);
    fill_normal(both, 3);
    a.Q = both.view().slice(0, 0, 2);
    a.O = both.view().slice(0, 2, 4);
    EXPECT_NO_THROW(a.forward());
  }
}

// An output whose strides send distinct elements to the same memory (a zero stride on a dimension longer
// than 1, or strides too small for the sizes below them) is an error: its rows would race, and the result
// would be whichever write landed last. Inputs may still be broadcast that way.
TEST(AttentionErrors, OutputsOverlappingThemselves) {
  {
    Args a;
    a.O.strides[1] = 0;  // every query row of o writes the same memory
    expect_error([&] { a.forward(); }, {"attention_forward", "o: the output overlaps itself", "dimension 1"});
  }
  {
    Args a;
    a.L.strides[2] = 0;
    expect_error([&] { a.forward(); }, {"attention_forward", "lse: the output overlaps itself", "dimension 2"});
  }
  {
    Args a;
    a.O.strides[2] = 8;  // heads 8 elements apart, rows of 16: each head's second half is the next one's first
    expect_error([&] { a.forward(); }, {"attention_forward", "o: the output overlaps itself", "dimension 2"});
  }
  for (const char* name : {"dq", "dk", "dv"}) {
    Args a;
    a.forward();
    TensorView& grad = std::string(name) == "dq" ? a.dQ : std::string(name) == "dk" ? a.dK : a.dV;
    grad.strides[0] = 0;  // both batches write one batch's memory
    expect_error([&] { a.backward(); },
                 {"attention_backward", std::string(name) + ": the output overlaps itself", "dimension 0"});
  }
  {
    Args a;  // broadcast inputs stay fine: k and v read by both batches from one batch's memory
    a.K.strides[0] = 0;
    a.V.strides[0] = 0;
    EXPECT_NO_THROW(a.forward());
  }
  {
    Args a;  // o as a [batch, heads, seq, head_dim] buffer seen as BSHD: permuted strides, no overlap
    Tensor bhsd = Tensor::empty({2, 4, 8, 16}, DType::f32);
    a.O = bhsd.view();
    a.O.sizes = {2, 8, 4, 16};
    a.O.strides = {4 * 8 * 16, 16, 8 * 16, 1};
    EXPECT_NO_THROW(a.forward());
    Tensor padded = Tensor::empty({2, 8, 4, 32}, DType::f32);  // rows with a gap after them: no overlap either
    a.O = padded.view().slice(3, 0, 16);
    EXPECT_NO_THROW(a.forward());
  }
}

// The C ABI's tensors reach the same check (flashlm_c.cpp calls attention_forward / attention_backward).
TEST(AttentionErrors, CAbiRefusesOutputsOverlappingThemselves) {
  Args a;
  const flashlm_tensor q = c_tensor(a.Q), k = c_tensor(a.K), v = c_tensor(a.V), lse = c_tensor(a.L);
  flashlm_tensor o = c_tensor(a.O);
  ASSERT_EQ(flashlm_attention_forward(&q, &k, &v, &o, &lse, nullptr), FLASHLM_OK) << flashlm_last_error();
  o.strides[1] = 0;
  EXPECT_EQ(flashlm_attention_forward(&q, &k, &v, &o, &lse, nullptr), FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("o: the output overlaps itself"), std::string::npos)
      << flashlm_last_error();
  o.strides[1] = a.O.stride(1);
  const flashlm_tensor dout = c_tensor(a.dO), dq = c_tensor(a.dQ), dv = c_tensor(a.dV);
  flashlm_tensor dk = c_tensor(a.dK);
  ASSERT_EQ(flashlm_attention_forward(&q, &k, &v, &o, &lse, nullptr), FLASHLM_OK) << flashlm_last_error();
  ASSERT_EQ(flashlm_attention_backward(&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv, nullptr), FLASHLM_OK)
      << flashlm_last_error();
  dk.strides[1] = 0;
  EXPECT_EQ(flashlm_attention_backward(&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv, nullptr),
            FLASHLM_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashlm_last_error()).find("dk: the output overlaps itself"), std::string::npos)
      << flashlm_last_error();
}

TEST(AttentionErrors, WrongRank) {
  Args a;
  a.K = TensorView::contiguous(a.k.data(), DType::f32, {2, 6, 32});
  expect_error([&] { a.forward(); }, {"attention_forward", "k:", "expected 4 dimensions"});
}

TEST(AttentionErrors, HeadDimMismatch) {
  Args a;
  a.K = TensorView::contiguous(a.k.data(), DType::f32, {2, 6, 4, 8});
  a.V = a.K;
  expect_error([&] { a.forward(); }, {"k:", "head_dim 8 differs from q's head_dim 16"});
}

TEST(AttentionErrors, BatchMismatch) {
  Args a;
  a.K = a.k.view().slice(0, 0, 1);
  a.V = a.v.view().slice(0, 0, 1);
  expect_error([&] { a.forward(); }, {"k:", "batch 1 differs from q's batch 2"});
}

TEST(AttentionErrors, ValueShapeDiffersFromKey) {
  Args a;
  a.V = a.v.view().slice(1, 0, 5);
  expect_error([&] { a.forward(); }, {"v:", "expected k's batch, seq_k and heads_k"});
}

TEST(AttentionErrors, HeadsNotAMultiple) {
  Args a;
  a.Q = a.q.view().slice(2, 0, 3);
  a.O = a.o.view().slice(2, 0, 3);
  a.L = a.lse.view().slice(1, 0, 3);
  expect_error([&] { a.forward(); }, {"heads_q = 3 is not a multiple of k's heads_k = 2"});
}

TEST(AttentionErrors, NonUnitLastStride) {
  Args a;
  a.Q = a.q.view().permute({0, 1, 3, 2});  // [2, 8, 16, 4]: head_dim stride 16... and heads 16
  a.Q = TensorView::contiguous(a.q.data(), DType::f32, {2, 8, 4, 16});
  a.Q.strides = {512, 64, 1, 4};  // head_dim strided
  expect_error([&] { a.forward(); }, {"q:", "stride 1"});
}

TEST(AttentionErrors, DtypeMismatch) {
  Args a;
  Tensor k16 = Tensor::empty({2, 6, 2, 16}, DType::bf16);
  a.K = k16;
  expect_error([&] { a.forward(); }, {"k:", "dtype bf16 differs from q's fp32"});
}

TEST(AttentionErrors, LseWrongDtypeOrShape) {
  Args a;
  Tensor lse64 = Tensor::empty({2, 4, 8}, DType::f64);
  a.L = lse64;
  expect_error([&] { a.forward(); }, {"lse:", "expected dtype fp32"});
  Args b;
  b.L = b.lse.view().slice(2, 0, 7);
  expect_error([&] { b.forward(); }, {"lse:", "expected shape [2, 4, 8]"});
}

TEST(AttentionErrors, NullPointers) {
  Args a;
  a.Q.data = nullptr;
  expect_error([&] { a.forward(); }, {"q:", "null data pointer"});
  Args b;
  b.dK.data = nullptr;
  expect_error([&] { b.backward(); }, {"attention_backward", "dk:", "null data pointer"});
}

TEST(AttentionErrors, GradientShapes) {
  Args a;
  a.dV = a.dv.view().slice(1, 0, 3);
  expect_error([&] { a.backward(); }, {"dv:", "expected the shape of v"});
  Args b;
  b.dO = b.dout.view().slice(3, 0, 8);
  expect_error([&] { b.backward(); }, {"dout:", "expected the shape of o"});
}

TEST(AttentionErrors, NonFiniteScale) {
  Args a;
  AttentionOptions opt;
  opt.scale = std::numeric_limits<double>::infinity();
  expect_error([&] { attention_forward(a.Q, a.K, a.V, a.O, a.L, opt); }, {"scale:", "finite"});
}

TEST(AttentionErrors, BadNamesAreErrors) {
  expect_error([] { parse_attention_impl("fast"); }, {"unknown attention implementation 'fast'"});
  expect_error([] { parse_causal_align("middle"); }, {"unknown causal alignment 'middle'"});
}

TEST(AttentionErrors, FailedCallLeavesOutputsUntouched) {
  Args a;
  fill_value(a.o, 7.0);
  a.L = a.lse.view().slice(2, 0, 7);  // invalid: nothing may be written
  EXPECT_THROW(a.forward(), Error);
  for (int64_t i = 0; i < a.o.numel(); ++i) ASSERT_EQ(a.o.view().ptr<float>()[i], 7.0f);
}

}  // namespace
