// What the subcommands of tools/cmd_*.cpp share: list parsing, the report options, the device and precision,
// the model options (add_model_options), running on every rank of a job. A usage error is a
// flashlm::InvalidArgument, the library's own or one thrown here; main reports it with exit 2.
#pragma once
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flashlm/bench.h"
#include "flashlm/error.h"
#include "flashlm/model.h"
#include "cli_options.h"

namespace flashlm {
class Communicator;
}

// One subcommand: its add_*_command declares the options (bound to the library's config) and returns what
// runs it once the command line is parsed (its exit code).
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};
Command add_attention_bench_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_train_command(CLI::App& app);
Command add_allreduce_bench_command(CLI::App& app);
Command add_ddp_bench_command(CLI::App& app);
void add_info_command(CLI::App& app);

// Upper bounds of the sizes the commands take. Generous (far past what fits in memory) yet far from
// int64's end, so that a product of a few of them cannot overflow before the library checks it.
constexpr int64_t kMaxBatch = int64_t{1} << 20;
constexpr int64_t kMaxSeq = int64_t{1} << 24;                       // attention-bench sequence lengths
constexpr int64_t kMaxContext = flashlm::ModelConfig::kMaxContext;  // LM contexts
constexpr int64_t kMaxHeadDim = 4096;
constexpr int64_t kMaxHeads = int64_t{1} << 16;
constexpr int64_t kMaxWidth = int64_t{1} << 20;        // d_model, d_ff
constexpr int64_t kMaxVocab = (int64_t{1} << 31) - 1;  // token ids are int32
constexpr int64_t kMaxSteps = int64_t{1} << 40;
constexpr int kMaxReps = 1'000'000;
constexpr double kMaxBucketMb = 1e6;

std::vector<std::string> split_list(const std::string& s);

// Parses "a,b,c" with `parse` for each item; a bad item is a usage error naming the option.
template <class T, class Parse>
std::vector<T> parse_list(const std::string& option, const std::string& s, Parse&& parse) {
  std::vector<T> out;
  for (const auto& item : split_list(s)) {
    try {
      out.push_back(parse(item));
    } catch (const std::exception& e) {
      throw flashlm::InvalidArgument(fmt::format("{}: {}", option, e.what()));
    }
  }
  return out;
}

// A positive integer up to max, for a comma-list option.
std::function<int64_t(const std::string&)> positive_up_to(int64_t max);
double parse_positive_number(const std::string& s, double max);
bool parse_bool(const std::string& s);

// A file the command writes at `path`, under a temporary name beside it (path.tmp.<pid>) until commit() renames
// it over `path`: a run that fails first, or a write that fails, leaves what `path` held as it was and removes
// the temporary. Nothing is left half-written under `path`.
class OutputFile {
 public:
  explicit OutputFile(std::string path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  void write(const void* data, size_t bytes);
  void commit();

 private:
  std::string path_, temporary_;
  std::FILE* file_ = nullptr;
};

// `text` to stdout (path empty or "-") or to the file `path` (an OutputFile).
void write_output(const std::string& text, const std::string& path);

// --format, --out and --quiet, the same for every benchmark command.
struct ReportOptions {
  std::string format = "md", out;
  bool quiet = false;
};
void add_report_options(CLI::App* cmd, ReportOptions& r);
flashlm::ReportFormat report_format(const ReportOptions& r);
// The report in `format` to --out, with the markdown table on stdout; or the report on stdout.
void emit_report(const std::function<std::string(flashlm::ReportFormat)>& render, const ReportOptions& r);

// --device cuda without a CUDA build or without a visible GPU is a usage error, said the same way by
// every command.
void require_usable_device(flashlm::Device device);
// --device: cpu or cuda; left out, cuda when a GPU is visible (every command that runs on either).
flashlm::Device device_or_default(const std::string& device);
// --device as above; --precision default: bf16 on cuda, fp32 on the CPU. The CPU runs fp32 only; a device
// that cannot be used is a usage error.
void resolve_device_and_precision(const std::string& device, const std::string& precision, flashlm::Device& dev,
                                  flashlm::DType& dtype, bool* bf16_pure = nullptr, bool* fp8 = nullptr);

// Which of the model options a command declares beside --recompute, --head-chunk, --atomic-attention-backward
// and --optimizer-state.
struct ModelOptionFlags {
  bool attention = false;          // --attention flash|naive (bench takes a list of its own)
  bool cuda_graph = false;         // --cuda-graph on|off
  bool overlap_grad_norm = false;  // --overlap-grad-norm
  bool fp8 = false;                // --fp8-gradients e4m3|e5m2 (the commands that take --precision fp8)
  bool grad_dtype = false;         // --grad-dtype fp32|bf16 (train and bench)
};
// The model options that only some runs use, as declared (null where the command has none), for
// refuse_unused_model_options.
struct ConditionalModelOptions {
  const CLI::Option *fp8_gradients = nullptr, *fp8_recipe = nullptr, *cuda_graph = nullptr;
};
// The model options (flashlm::ModelOptions) on the command line, bound to `options`; declared once here for
// train, bench and ddp-bench.
ConditionalModelOptions add_model_options(CLI::App* cmd, flashlm::ModelOptions& options, ModelOptionFlags flags);
// A usage error for a model option given where the run would ignore it: --fp8-gradients or --fp8-recipe without
// an fp8 precision (`fp8`: the run, or one of a bench's precisions, is fp8), --cuda-graph on with --device cpu.
void refuse_unused_model_options(const ConditionalModelOptions& given, const flashlm::ModelOptions& options,
                                 flashlm::Device device, bool fp8);

// --reduce-dtype, --nccl-max-ctas and --gemm-sm-reserve, the same for train and ddp-bench (a comma list there).
void add_gradient_sync_options(CLI::App* cmd, std::string& reduce_dtype, int& nccl_max_ctas, int& gemm_sm_reserve,
                               const char* dtype_help);
// --reduce-dtype (a comma list) with --nccl-max-ctas and --gemm-sm-reserve: all concern NCCL on GPUs: a
// 16-bit gradient all-reduce, a CTA limit or an SM reserve asked for on the CPU (MPI reduces fp32) is a usage
// error.
std::vector<flashlm::DType> parse_reduce_dtypes(const std::string& list, flashlm::Device device, int nccl_max_ctas,
                                                int gemm_sm_reserve);

// --collective-timeout-s, the same for every command that runs under mpirun. Unset (-1): the
// communicator's default ($FLASHLM_DIST_TIMEOUT_S, else 600 s).
void add_collective_timeout_option(CLI::App* cmd, double& seconds);
// Runs fn(comm) on every rank of the job (a world of one without mpirun), with the collective timeout
// `timeout_s` (< 0: the communicator's default). A failure on one rank ends the whole job (MPI_Abort)
// instead of leaving its peers waiting in a collective; MPI is finalized on success, and when every rank
// found the same usage error together (ranks started with different settings: exit 2 on every rank). A
// flashlm::InvalidArgument on one rank of several aborts the job with code 2 (a usage error), any other
// failure with 1.
int run_on_every_rank(double timeout_s, const std::function<void(flashlm::Communicator&)>& fn);
// Whether a launcher started this process as one of several ranks (mpirun, srun), before MPI is started.
bool launched_with_peers();
// torchrun (and torch.distributed.launch) start N copies with RANK / WORLD_SIZE / LOCAL_RANK and no MPI:
// each copy would run alone, N identical runs writing the same files. Refused before anything runs.
void refuse_torchrun();

// --vocab or --context beside --model-config: the file's value (`key` among the keys it gives) holds unless
// the flag was given; given both, the flag wins and a line on stderr says so. Returns the value that won.
int64_t model_config_value(const std::string& key, const std::vector<std::string>& file_keys, int64_t file_value,
                           const CLI::Option* flag, int64_t flag_value);
