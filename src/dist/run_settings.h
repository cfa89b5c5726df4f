// A run's settings (RunSetting, include/flashlm/dist.h) as text: what Communicator::agree_settings sends
// between ranks and compares.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flashlm/dist.h"

namespace flashlm::dist {

// The settings as one text: each name and value followed by a NUL (so that no two lists serialise alike).
std::string serialise_settings(std::span<const RunSetting> settings);
// serialise_settings' inverse (an unterminated last entry is dropped).
std::vector<RunSetting> parse_settings(const std::string& text);
// FNV-1a, 64 bits: the one number the ranks exchange before any text.
uint64_t fnv1a_64(std::string_view text);
// What differs between rank 0's settings and rank `rank`'s: "steps (rank 0: 3, rank 1: 4), ...".
std::string settings_difference(std::span<const RunSetting> root, std::span<const RunSetting> mine, int rank);

}  // namespace flashlm::dist
