// Rendering of benchmark records (one JSON object per row) as markdown, CSV or JSON — shared by every
// benchmark command so that all of them speak the same three formats.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flashlm/bench.h"

namespace flashlm {

struct ReportColumn {
  std::string key;     // field of the record
  std::string header;  // markdown header
  int decimals = 2;    // for floating-point values
};

std::string render_report(const std::vector<nlohmann::json>& records, const std::vector<ReportColumn>& columns,
                          ReportFormat format, const nlohmann::json& meta);

}  // namespace flashlm
