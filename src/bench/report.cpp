#include "bench/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <new>
#include <thread>

#include "core/array_ops.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/memory.h"

namespace flashlm {

ReportFormat parse_report_format(std::string_view name) {
  if (name == "md" || name == "markdown") return ReportFormat::md;
  if (name == "csv") return ReportFormat::csv;
  if (name == "json") return ReportFormat::json;
  fail_argument("unknown format '{}': expected md, csv or json", name);
}

namespace {

std::string cell(const nlohmann::json& v, int decimals) {
  if (v.is_null()) return "-";
  if (v.is_boolean()) return v.get<bool>() ? "1" : "0";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number_float()) return fmt::format("{:.{}f}", v.get<double>(), decimals);
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

std::string csv_escape(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::vector<std::string>& report_command_line() {
  static std::vector<std::string> words;
  return words;
}

// "2026-12-01T10:42:23Z"
std::string utc_time() {
  char text[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

}  // namespace

void set_report_command_line(int argc, const char* const* argv) {
  report_command_line().assign(argv, argv + argc);
}

std::string render_report(const std::vector<nlohmann::json>& records, const std::vector<ReportColumn>& columns,
                          ReportFormat format, const nlohmann::json& meta) {
  std::string out;
  switch (format) {
    case ReportFormat::json: {
      nlohmann::json doc = meta;
      doc["flashlm"] = {{"version", FLASHLM_VERSION},
                        {"git_commit", FLASHLM_GIT_COMMIT},
                        {"command", report_command_line()},
                        {"time_utc", utc_time()}};
      doc["records"] = records;
      return doc.dump(1) + "\n";
    }
    case ReportFormat::csv: {
      for (size_t c = 0; c < columns.size(); ++c) out += (c ? "," : "") + columns[c].key;
      out += "\n";
      for (const auto& r : records) {
        for (size_t c = 0; c < columns.size(); ++c) {
          const auto& v = r.contains(columns[c].key) ? r[columns[c].key] : nlohmann::json();
          // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "," + string here.
          if (c) out += ',';
          out += csv_escape(v.is_null() ? "" : v.is_number_float() ? fmt::format("{}", v.get<double>()) : cell(v, 0));
        }
        out += "\n";
      }
      return out;
    }
    case ReportFormat::md: {
      std::vector<std::vector<std::string>> rows;
      std::vector<size_t> width(columns.size());
      for (size_t c = 0; c < columns.size(); ++c) width[c] = columns[c].header.size();
      for (const auto& r : records) {
        std::vector<std::string> row;
        for (size_t c = 0; c < columns.size(); ++c) {
          row.push_back(cell(r.contains(columns[c].key) ? r[columns[c].key] : nlohmann::json(), columns[c].decimals));
          width[c] = std::max(width[c], row.back().size());
        }
        rows.push_back(std::move(row));
      }
      auto line = [&](const std::vector<std::string>& cells) {
        std::string s = "|";
        for (size_t c = 0; c < cells.size(); ++c) s += fmt::format(" {:>{}} |", cells[c], width[c]);
        return s + "\n";
      };
      std::vector<std::string> headers;
      for (const auto& col : columns) headers.push_back(col.header);
      out += line(headers);
      out += "|";
      for (size_t c = 0; c < columns.size(); ++c) out += std::string(width[c] + 1, '-') + ":|";
      out += "\n";
      for (const auto& row : rows) out += line(row);
      return out;
    }
  }
  return out;
}

Moments moments(std::vector<double> v) {
  FLASHLM_CHECK(!v.empty(), "moments: no samples");
  Moments m;
  for (double x : v) m.mean += x;
  m.mean /= double(v.size());
  for (double x : v) m.stddev += (x - m.mean) * (x - m.mean);
  m.stddev = v.size() > 1 ? std::sqrt(m.stddev / double(v.size() - 1)) : 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  m.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return m;
}

double median_call_ms(Device device, int warmup, int reps, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  if (device == Device::cuda) {
    cuda_synchronize();
    return moments(cuda_time_each_ms(fn, reps)).median;
  }
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(ms_since(t0));
  }
  return moments(ms).median;
}

double median_cold_l2_ms(int reps, const std::function<void()>& fn) {
#ifdef FLASHLM_WITH_CUDA
  // Any kernel that reads the whole buffer and writes next to nothing does: count_nonfinite's.
  const Buffer flush = Buffer::allocate(kL2FlushBytes, Device::cuda, "L2 flush");
  const Buffer count = Buffer::allocate(sizeof(int), Device::cuda, "L2 flush count");
  cuda_memset_async(flush.data(), 0, kL2FlushBytes, nullptr);
  const auto flush_l2 = [&] {
    gpu::count_nonfinite(static_cast<const bf16_t*>(flush.data()), static_cast<int64_t>(kL2FlushBytes / 2),
                         static_cast<int*>(count.data()), nullptr);
  };
  return moments(cuda_time_each_ms(fn, reps, flush_l2)).median;
#else
  (void)reps, (void)fn;
  fail("median_cold_l2_ms: flashlm was built without CUDA");
#endif
}

std::string utc_date() {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  return date;
}

std::string describe_device(Device device) {
  if (device == Device::cuda) return cuda_device_description();
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return fmt::format("{} ({} hardware threads)", model, std::thread::hardware_concurrency());
}

void run_row(const std::function<void()>& row,
             const std::function<void(const std::string& status, const std::string& message)>& mark) {
  try {
    row();
  } catch (const OutOfMemory& e) {
    mark("oom", e.what());
  } catch (const std::bad_alloc&) {
    mark("oom", "std::bad_alloc");
  } catch (const Error& e) {
    mark("error", e.what());
  }
}

}  // namespace flashlm
