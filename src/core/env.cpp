#include "core/env.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/check.h"

namespace flashlm {

std::string_view env_choice(const EnvChoice& setting) {
  const char* env = std::getenv(setting.name);
  const std::string_view value = env == nullptr ? "" : env;
  if (value.empty()) return setting.default_value;
  for (std::string_view v : setting.values) {
    if (value == v) return v;
  }
  std::string expected;
  for (size_t i = 0; i < setting.values.size(); ++i) {
    if (i > 0) expected += i + 1 == setting.values.size() ? " or " : ", ";
    expected += setting.values[i];
  }
  fail_argument("{}: unknown value '{}': expected {} (unset or empty: {})", setting.name, value, expected,
                setting.default_value);
}

std::optional<double> env_number(const EnvNumber& setting) {
  const char* env = std::getenv(setting.name);
  const std::string_view value = env == nullptr ? "" : env;
  if (value.empty()) return std::nullopt;
  double x = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
  if (ec != std::errc() || end != value.data() + value.size() || !std::isfinite(x) || x < setting.lo ||
      x > setting.hi) {
    fail_argument("{}: '{}' is not a number of {} in [{}, {}]", setting.name, value, setting.unit, setting.lo,
                  setting.hi);
  }
  return x;
}

}  // namespace flashlm
