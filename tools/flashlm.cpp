// flashlm: the command-line tool. Each subcommand parses its arguments, calls the library and prints.
// Exit codes: 0 success, 2 usage error (bad arguments), 1 runtime error.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "flashlm/bench.h"
#include "flashlm/device.h"
#include "flashlm/error.h"

namespace {

// Thrown for arguments that parse but make no sense: reported as a usage error (exit 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  if (out.empty()) throw UsageError(fmt::format("empty list '{}'", s));
  return out;
}

// Parses "a,b,c" with `parse` for each item; a bad item is a usage error naming the option.
template <class T, class Parse>
std::vector<T> parse_list(const std::string& option, const std::string& s, Parse&& parse) {
  std::vector<T> out;
  for (const auto& item : split_list(s)) {
    try {
      out.push_back(parse(item));
    } catch (const std::exception& e) {
      throw UsageError(fmt::format("{}: {}", option, e.what()));
    }
  }
  return out;
}

int64_t parse_positive(const std::string& s) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || v < 1) throw std::invalid_argument(fmt::format("'{}' is not a positive integer", s));
  return v;
}

bool parse_bool(const std::string& s) {
  if (s == "1" || s == "true" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "no") return false;
  throw std::invalid_argument(fmt::format("'{}' is not 0 or 1", s));
}

void write_output(const std::string& text, const std::string& path) {
  if (path.empty() || path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  std::ofstream f(path);
  if (!f) throw flashlm::Error(fmt::format("cannot open '{}' for writing", path));
  f << text;
  if (!f) throw flashlm::Error(fmt::format("failed writing '{}'", path));
}

struct AttentionBenchArgs {
  std::string impl = "naive,flash", dtype = "fp32", d = "64", seq = "1024,2048,4096", batch = "1", heads = "1";
  std::string causal = "0", align = "top-left", device = "cpu", format = "md", out, grid;
  int warmup = 1, reps = 3, threads = 0;
  bool forward_only = false, quiet = false, deterministic = false;
};

void add_attention_bench(CLI::App& app, AttentionBenchArgs& a) {
  CLI::App* cmd = app.add_subcommand("attention-bench", "Time attention forward and backward over a grid of shapes");
  cmd->add_option("--impl", a.impl, "Implementations, comma list of naive,flash")->capture_default_str();
  cmd->add_option("--dtype", a.dtype, "Element types, comma list of fp32,fp64,fp16,bf16")->capture_default_str();
  auto* d = cmd->add_option("--d", a.d, "Head dimensions, comma list")->capture_default_str();
  auto* seq = cmd->add_option("--seq", a.seq, "Sequence lengths (queries = keys), comma list")->capture_default_str();
  auto* batch = cmd->add_option("--batch", a.batch, "Batch sizes, comma list")->capture_default_str();
  auto* heads = cmd->add_option("--heads", a.heads, "Head counts, comma list")->capture_default_str();
  auto* causal = cmd->add_flag("--causal{1}", a.causal,
                               "Causal mask: bare --causal means causal only; --causal=0,1 runs both")
                     ->capture_default_str();
  cmd->add_option("--grid", a.grid,
                  "A named set of shapes instead of --d/--seq/--batch/--heads/--causal: 'fa' (16k tokens per batch, "
                  "heads*d = 2048, d 64,128, seq 512..16384, causal and not) or 'seed' (batch 8, one head, "
                  "d 16..128, seq 256..32768, causal)")
      ->excludes(d)
      ->excludes(seq)
      ->excludes(batch)
      ->excludes(heads)
      ->excludes(causal);
  cmd->add_flag("--deterministic", a.deterministic, "CUDA backward without atomics (bit-reproducible dQ)");
  cmd->add_option("--causal-align", a.align, "top-left (PyTorch is_causal) or bottom-right")->capture_default_str();
  cmd->add_option("--device", a.device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--warmup", a.warmup, "Untimed runs before timing")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--reps", a.reps, "Timed runs; the median is reported")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--threads", a.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--forward-only", a.forward_only, "Skip the backward pass");
  cmd->add_option("--format", a.format, "md, csv or json")->capture_default_str();
  cmd->add_option("--out", a.out, "Write the report here (stdout then shows the markdown table)");
  cmd->add_flag("--quiet", a.quiet, "No progress lines on stderr");
}

int run_attention_bench_command(const AttentionBenchArgs& a) {
  using namespace flashlm;
  AttentionBenchConfig cfg;
  ReportFormat format;
  try {
    cfg.impls = parse_list<AttentionImpl>("--impl", a.impl, [](const std::string& s) { return parse_attention_impl(s); });
    cfg.dtypes = parse_list<DType>("--dtype", a.dtype, [](const std::string& s) { return parse_dtype(s); });
    if (!a.grid.empty()) {
      cfg.shapes = attention_named_grid(a.grid);
    } else {
      cfg.shapes = attention_shape_grid(parse_list<int64_t>("--d", a.d, parse_positive),
                                        parse_list<int64_t>("--seq", a.seq, parse_positive),
                                        parse_list<int64_t>("--batch", a.batch, parse_positive),
                                        parse_list<int64_t>("--heads", a.heads, parse_positive),
                                        parse_list<bool>("--causal", a.causal, parse_bool));
    }
    cfg.align = parse_causal_align(a.align);
    cfg.device = parse_device(a.device);
    format = parse_report_format(a.format);
  } catch (const flashlm::Error& e) {
    throw UsageError(e.what());
  }
  if (cfg.device == Device::cuda && cuda_device_count() == 0) {
    throw UsageError(cuda_built() ? "--device cuda: no CUDA device is visible"
                                  : "--device cuda: flashlm was built without CUDA");
  }
  if (a.threads > 0) set_cpu_threads(a.threads);
  cfg.deterministic = a.deterministic;
  cfg.warmup = a.warmup;
  cfg.reps = a.reps;
  cfg.backward = !a.forward_only;
  if (!a.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };

  const auto records = run_attention_bench(cfg);
  if (!a.out.empty()) {
    write_output(format_attention_bench(records, format, cfg), a.out);
    write_output(format_attention_bench(records, ReportFormat::md, cfg), "");
  } else {
    write_output(format_attention_bench(records, format, cfg), "");
  }
  return 0;
}

void add_info(CLI::App& app) {
  app.add_subcommand("info", "Print the build and the devices flashlm sees")->callback([] {
    fmt::print("flashlm {}\n", FLASHLM_VERSION);
    fmt::print("cpu:  {}, {} OpenMP threads\n", flashlm::describe_device(flashlm::Device::cpu), flashlm::cpu_threads());
    if (!flashlm::cuda_built()) fmt::print("cuda: not built (nvcc was not found at configure time)\n");
    else if (flashlm::cuda_device_count() == 0) fmt::print("cuda: built, no device visible\n");
    else fmt::print("cuda: {} device(s); current: {}\n", flashlm::cuda_device_count(),
                    flashlm::describe_device(flashlm::Device::cuda));
  });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flashlm: FlashAttention-2, a Transformer LM and data-parallel training, with the tools to measure them"};
  app.require_subcommand(1);
  app.set_version_flag("--version", FLASHLM_VERSION);
  AttentionBenchArgs bench_args;
  add_attention_bench(app, bench_args);
  add_info(app);

  try {
    app.parse(argc, argv);
    if (app.got_subcommand("attention-bench")) return run_attention_bench_command(bench_args);
    return 0;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "error: {}\nRun with --help for usage.\n", e.what());
    return 2;
  } catch (const UsageError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
