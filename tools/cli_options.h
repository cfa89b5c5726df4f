// Option checks every subcommand shares (flashlm.cpp's and text_commands.cpp's).
#pragma once
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <string>

#include "flashlm/device.h"

// The value of a numeric option in [lo, hi]. CLI11 reads integers with strtoll/strtoull, which saturate an
// out-of-range number (99999999999999999999 becomes INT64_MAX) and wrap a negative one into an unsigned:
// every bound here lies below those values, so such input fails the range. NaN fails every range (both
// comparisons are false), and a finite hi keeps inf out.
template <class T>
inline CLI::Validator in_range(T lo, T hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        T v{};
        if (!CLI::detail::lexical_cast(text, v) || !(v >= lo && v <= hi)) {
          return fmt::format("'{}' is not a number in [{}, {}]", text, lo, hi);
        }
        return {};
      },
      fmt::format("in [{}, {}]", lo, hi));
}

// --threads for every command that runs on the CPU (default: all; -1 or 0 is an error, not the default).
inline CLI::Option* add_threads_option(CLI::App* cmd, int& threads) {
  return cmd->add_option("--threads", threads, "CPU threads (default: all)")
      ->check(in_range(1, flashlm::kMaxCpuThreads));
}

