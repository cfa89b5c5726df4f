// The FLASHLM_* settings (core/env.h): unset or empty is the default, an accepted value exactly, anything else an
// InvalidArgument naming the variable and what it accepts; numbers whole, finite and in range.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/env.h"
#include "env_testing.h"
#include "flashlm/device.h"
#include "flashlm/error.h"

using namespace flashlm;
using flashlm::testing::ScopedEnvironment;

namespace {

// The InvalidArgument message of `fn`, or "" when it returned.
template <class Fn>
std::string argument_error(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(EnvChoice, UnsetOrEmptyIsTheDefault) {
  for (const EnvChoice& c : kEnvChoices) {
    const ScopedEnvironment empty(c.name, std::string{});
    EXPECT_EQ(env_choice(c), c.default_value) << c.name;
    unsetenv(c.name);  // the scope puts back whatever was set before
    EXPECT_EQ(env_choice(c), c.default_value) << c.name;
  }
}

TEST(EnvChoice, EveryAcceptedValueReadsAsItself) {
  for (const EnvChoice& c : kEnvChoices) {
    for (std::string_view v : c.values) {
      const ScopedEnvironment set(c.name, std::string(v));
      EXPECT_EQ(env_choice(c), v) << c.name;
    }
  }
}

TEST(EnvChoice, AnythingElseNamesTheVariableAndTheValues) {
  {
    const ScopedEnvironment set("FLASHLM_FP8_KEY_BLOCK", "128x");
    EXPECT_EQ(argument_error([] { env_choice(kFp8KeyBlock); }),
              "FLASHLM_FP8_KEY_BLOCK: unknown value '128x': expected auto, 128 or 192 (unset or empty: auto)");
  }
  {
    const ScopedEnvironment set("FLASHLM_PROGRAMMATIC_LAUNCH", "true");
    EXPECT_EQ(argument_error([] { env_choice(kProgrammaticLaunch); }),
              "FLASHLM_PROGRAMMATIC_LAUNCH: unknown value 'true': expected 0 or 1 (unset or empty: 1)");
  }
  // Another case, surrounding space, trailing characters, a neighbouring number: none is a near enough match.
  for (const char* bad : {"AUTO", "Auto", " auto", "auto ", "grid\n", "persistentx", "-1", "0", "1"}) {
    const ScopedEnvironment set("FLASHLM_SM90_BWD_SCHEDULE", bad);
    EXPECT_NE(argument_error([] { env_choice(kSm90BackwardSchedule); })
                  .find("FLASHLM_SM90_BWD_SCHEDULE: unknown value '"),
              std::string::npos)
        << "'" << bad << "'";
  }
  for (const char* bad : {"128 ", "0128", "192.0", "2", "mma"}) {
    const ScopedEnvironment set("FLASHLM_FP8_KEY_BLOCK", bad);
    EXPECT_FALSE(argument_error([] { env_choice(kFp8KeyBlock); }).empty()) << "'" << bad << "'";
  }
}

TEST(EnvChoice, TheTableNamesEachVariableOnceWithItsDefaultAmongItsValues) {
  std::set<std::string> names;
  for (const EnvChoice& c : kEnvChoices) {
    EXPECT_TRUE(names.insert(c.name).second) << c.name;
    EXPECT_NE(std::find(c.values.begin(), c.values.end(), c.default_value), c.values.end()) << c.name;
  }
}

TEST(EnvNumber, WholeFiniteNumbersInRange) {
  {
    const ScopedEnvironment unset("FLASHLM_DIST_TIMEOUT_S", "");
    EXPECT_FALSE(env_number(kDistTimeout).has_value());
  }
  for (const auto& [text, value] : {std::pair{"0", 0.0}, {"600", 600.0}, {"0.5", 0.5}, {"1e3", 1000.0},
                                    {"604800", 604800.0}}) {
    const ScopedEnvironment set("FLASHLM_DIST_TIMEOUT_S", text);
    EXPECT_EQ(env_number(kDistTimeout), value) << text;
  }
  for (const char* bad : {"1e300", "604801", "-1", "nan", "inf", "-inf", "10s", " 10", "10 ", "+10", "0x10", "ten",
                          "1,5"}) {
    const ScopedEnvironment set("FLASHLM_DIST_TIMEOUT_S", bad);
    EXPECT_EQ(argument_error([] { env_number(kDistTimeout); }),
              std::string("FLASHLM_DIST_TIMEOUT_S: '") + bad + "' is not a number of seconds in [0, 604800]");
  }
}

TEST(CheckEnvironment, RefusesTheFirstBadSetting) {
  for (const EnvChoice& c : kEnvChoices) {
    const ScopedEnvironment set(c.name, "not-a-value");
    EXPECT_NE(argument_error([] { check_environment(); }).find(c.name), std::string::npos) << c.name;
  }
  {
    const ScopedEnvironment set("FLASHLM_DIST_TIMEOUT_S", "forever");
    EXPECT_NE(argument_error([] { check_environment(); }).find("FLASHLM_DIST_TIMEOUT_S"), std::string::npos);
  }
  std::vector<std::unique_ptr<ScopedEnvironment>> defaults;
  for (const EnvChoice& c : kEnvChoices) defaults.push_back(std::make_unique<ScopedEnvironment>(c.name, ""));
  const ScopedEnvironment timeout("FLASHLM_DIST_TIMEOUT_S", "");
  EXPECT_NO_THROW(check_environment());
}
