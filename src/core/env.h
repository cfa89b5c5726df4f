// The FLASHLM_* environment settings that choose how the library runs, read in one way: unset or empty is the
// default; any other value must be one of the accepted ones exactly (no other case, no trailing characters),
// else a flashlm::InvalidArgument naming the variable and what it accepts. Never a silent fallback. The
// variables that name a path (FLASHLM_PYTHON, FLASHLM_CUPTI_LIBRARY, ...) are checked where they are used, and
// the CLI's own (FLASHLM_PREPARE_DATA_TIMEOUT) in tools/.
#pragma once
#include <optional>
#include <span>
#include <string_view>

#include "flashlm/device.h"  // kMaxTimeoutSeconds

namespace flashlm {

// A setting that picks one of a few words.
struct EnvChoice {
  const char* name;
  std::string_view default_value;              // what unset or empty means; one of `values`
  std::span<const std::string_view> values;  // every accepted value
};

namespace env {
inline constexpr std::string_view kAutoOrMma[] = {"auto", "mma"};
inline constexpr std::string_view kSm90BwdSchedules[] = {"auto", "grid", "persistent"};
inline constexpr std::string_view kSm90FwdD64Tiles[] = {"auto", "128x128", "192x128", "128x192"};
inline constexpr std::string_view kFp8KeyBlocks[] = {"auto", "128", "192"};
inline constexpr std::string_view kSwitch[] = {"0", "1"};
inline constexpr std::string_view kFp8WeightCasts[] = {"optimizer", "optimizer-bf16", "pass"};
}  // namespace env

// Which CUDA flash kernels run: auto (the Hopper ones where they cover the problem) or mma (mma.sync always).
inline constexpr EnvChoice kAttentionKernel{"FLASHLM_ATTENTION_KERNEL", "auto", env::kAutoOrMma};
// The Hopper backward's launch: auto (by head dim), grid or persistent.
inline constexpr EnvChoice kSm90BackwardSchedule{"FLASHLM_SM90_BWD_SCHEDULE", "auto", env::kSm90BwdSchedules};
// The Hopper forward's tile at head dim 64: auto (by shape) or rows x keys.
inline constexpr EnvChoice kSm90ForwardD64Tile{"FLASHLM_SM90_FWD_D64_TILE", "auto", env::kSm90FwdD64Tiles};
// The FP8 forward's keys per key block: auto (by head dim and length), 128 or 192.
inline constexpr EnvChoice kFp8KeyBlock{"FLASHLM_FP8_KEY_BLOCK", "auto", env::kFp8KeyBlocks};
// ALiBi and sinks on the Hopper kernels (1) or on mma.sync only (0).
inline constexpr EnvChoice kHopperAlibiSink{"FLASHLM_HOPPER_ALIBI_SINK", "1", env::kSwitch};
// Programmatic dependent launches on sm_90 (1) or plain launches (0).
inline constexpr EnvChoice kProgrammaticLaunch{"FLASHLM_PROGRAMMATIC_LAUNCH", "1", env::kSwitch};

// Who casts FP8 training's block weights: the AdamW step as it stores them (optimizer, where
// ModelOptions::fp8_optimizer_weight_cast allows; optimizer-bf16: writing their bf16 copy too, as before the copy
// was restored only where read) or each pass (pass).
inline constexpr EnvChoice kFp8WeightCast{"FLASHLM_FP8_WEIGHT_CAST", "optimizer", env::kFp8WeightCasts};
inline constexpr EnvChoice kEnvChoices[] = {kAttentionKernel,    kSm90BackwardSchedule, kSm90ForwardD64Tile,
                                            kFp8KeyBlock,        kHopperAlibiSink,      kProgrammaticLaunch,
                                            kFp8WeightCast};

// A setting that is a number in [lo, hi] (`unit` names it in the error).
struct EnvNumber {
  const char* name;
  double lo, hi;
  std::string_view unit;
};

// The collective timeout of every communicator (0: none), unless the program sets one.
inline constexpr EnvNumber kDistTimeout{"FLASHLM_DIST_TIMEOUT_S", 0.0, kMaxTimeoutSeconds, "seconds"};

inline constexpr EnvNumber kEnvNumbers[] = {kDistTimeout};

// The value of `setting` now: one of its values (a view of the table's string), its default when unset or empty.
std::string_view env_choice(const EnvChoice& setting);

// The value of `setting` now, or nullopt when unset or empty. The whole value must be a finite decimal number:
// "5s", " 5", "0x10", "nan", "inf" and a value out of range are each an InvalidArgument naming the variable and
// the range.
std::optional<double> env_number(const EnvNumber& setting);

// check_environment() (flashlm/device.h) reads every setting of kEnvChoices and kEnvNumbers, and FLASHLM_CPU_ISA.

}  // namespace flashlm
