// Environment variables set for a scope, for the tests of settings the library reads from the environment.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace flashlm::testing {

// The environment variable `name` set to `value` for the object's lifetime, then restored (unset, or its old
// value), on every way out of the scope, a failed ASSERT included; no value leaves the environment alone.
// Scopes nest: an inner one restores the outer one's value. The library reads its FLASHLM_* choices at
// each call, so a test may change one between calls.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, std::optional<std::string> value) : name_(name), active_(value.has_value()) {
    if (!active_) return;
    const char* was = std::getenv(name);
    had_ = was != nullptr;
    if (had_) saved_ = was;
    EXPECT_EQ(setenv(name, value->c_str(), 1), 0) << "setenv " << name << "=" << *value;
  }
  ~ScopedEnvironment() {
    if (!active_) return;
    if (had_) setenv(name_, saved_.c_str(), 1);
    else unsetenv(name_);
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

 private:
  const char* name_;
  bool active_, had_ = false;
  std::string saved_;
};

}  // namespace flashlm::testing
