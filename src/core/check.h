// Internal helpers to throw flashlm::Error with a formatted message: fail("k: got {}", n) and
// FLASHLM_CHECK(cond, "...", args...); checked_mul / checked_add / checked_product for every size and
// element count computed from user-given dimensions.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "flashlm/error.h"

namespace flashlm::detail {
// Replaces each "{}" of format with the next argument (no format specs). Used by .cu files, for
// nvcc cannot compile fmt 9 in C++20 mode.
std::string format_braces(std::string_view format, std::initializer_list<std::string> args);
}  // namespace flashlm::detail

#ifdef __CUDACC__
namespace flashlm {
namespace detail {
inline std::string arg_string(std::string_view s) { return std::string(s); }
inline std::string arg_string(const char* s) { return s; }
inline std::string arg_string(const std::string& s) { return s; }
template <class T>
  requires std::is_arithmetic_v<T>
std::string arg_string(T v) {
  if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
  else return std::to_string(v);
}
}  // namespace detail

template <class... Args>
[[noreturn]] void fail(std::string_view format, const Args&... args) {
  throw Error(detail::format_braces(format, {detail::arg_string(args)...}));
}
template <class... Args>
[[noreturn]] void fail_argument(std::string_view format, const Args&... args) {
  throw InvalidArgument(detail::format_braces(format, {detail::arg_string(args)...}));
}
}  // namespace flashlm
#else
#include <fmt/format.h>

namespace flashlm {
template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}
// As fail, for the caller's own input (flashlm::InvalidArgument: a usage error at the CLI).
template <class... Args>
[[noreturn]] void fail_argument(fmt::format_string<Args...> format, Args&&... args) {
  throw InvalidArgument(fmt::format(format, std::forward<Args>(args)...));
}
}  // namespace flashlm
#endif

namespace flashlm {
// a * b, a + b and the product of `factors` as int64_t, or flashlm::Error naming `what` (the quantity being
// computed, e.g. "q: element count") when the result does not fit: a size built from hostile dimensions
// must fail here, not wrap around into a small allocation that the kernels then overrun.
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) fail("{}: {} * {} overflows a 64-bit size", what, a, b);
  return out;
}
inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) fail("{}: {} + {} overflows a 64-bit size", what, a, b);
  return out;
}
inline int64_t checked_product(std::initializer_list<int64_t> factors, std::string_view what) {
  int64_t out = 1;
  for (int64_t f : factors) out = checked_mul(out, f, what);
  return out;
}
// checked_product as a byte count, compiled once (check.cpp): for code built once per instruction set (the CPU
// attention kernels), which must not instantiate inline functions that other code shares.
size_t checked_size(std::initializer_list<int64_t> factors, std::string_view what);
}  // namespace flashlm

// FLASHLM_CHECK(cond, "fmt", args...): throw flashlm::Error with the message unless cond holds.
#define FLASHLM_CHECK(cond, ...)               \
  do {                                         \
    if (!(cond)) ::flashlm::fail(__VA_ARGS__); \
  } while (0)
// FLASHLM_CHECK_ARG(cond, "fmt", args...): the same for the caller's input (flashlm::InvalidArgument).
#define FLASHLM_CHECK_ARG(cond, ...)                    \
  do {                                                  \
    if (!(cond)) ::flashlm::fail_argument(__VA_ARGS__); \
  } while (0)
