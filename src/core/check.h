// Internal helpers to throw flashlm::Error with a formatted message.
#pragma once
#include <fmt/format.h>

#include <utility>

#include "flashlm/error.h"

namespace flashlm {

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace flashlm

// FLASHLM_CHECK(cond, "fmt", args...): throw flashlm::Error with the message unless cond holds.
#define FLASHLM_CHECK(cond, ...)                     \
  do {                                               \
    if (!(cond)) ::flashlm::fail(__VA_ARGS__);       \
  } while (0)
