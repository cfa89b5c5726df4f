#include "dist/run_settings.h"

#include <fmt/format.h>

#include <algorithm>

namespace flashlm::dist {

std::string serialise_settings(std::span<const RunSetting> settings) {
  std::string text;
  for (const RunSetting& s : settings) (text += s.name) += '\0', (text += s.value) += '\0';
  return text;
}

uint64_t fnv1a_64(std::string_view text) {
  uint64_t h = 14695981039346656037ull;
  for (char c : text) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::vector<RunSetting> parse_settings(const std::string& text) {
  std::vector<RunSetting> out;
  for (size_t at = 0; at < text.size();) {
    const size_t name_end = text.find('\0', at);
    const size_t value_end = name_end == std::string::npos ? std::string::npos : text.find('\0', name_end + 1);
    if (value_end == std::string::npos) break;
    out.push_back({text.substr(at, name_end - at), text.substr(name_end + 1, value_end - name_end - 1)});
    at = value_end + 1;
  }
  return out;
}

std::string settings_difference(std::span<const RunSetting> root, std::span<const RunSetting> mine, int rank) {
  std::string out;
  const size_t common = std::min(root.size(), mine.size());
  for (size_t i = 0; i < common; ++i) {
    if (root[i].name != mine[i].name) {
      // Another list of settings altogether (another build of flashlm on that rank): stop comparing.
      return fmt::format("{}{}the list of settings (setting {} is {} on rank 0, {} on rank {})", out,
                         out.empty() ? "" : ", ", i + 1, root[i].name, mine[i].name, rank);
    }
    if (root[i].value != mine[i].value) {
      out += fmt::format("{}{} (rank 0: {}, rank {}: {})", out.empty() ? "" : ", ", root[i].name, root[i].value, rank,
                         mine[i].value);
    }
  }
  if (root.size() != mine.size()) {
    out += fmt::format("{}the number of settings (rank 0: {}, rank {}: {})", out.empty() ? "" : ", ", root.size(),
                       rank, mine.size());
  }
  return out;
}

}  // namespace flashlm::dist
