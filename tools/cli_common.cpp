#include "cli_common.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <utility>

#include "flashlm/device.h"
#include "flashlm/ddp.h"
#include "flashlm/memory.h"
#include "flashlm/dist.h"

using flashlm::InvalidArgument;

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  if (out.empty()) throw InvalidArgument(fmt::format("empty list '{}'", s));
  return out;
}

namespace {

// A positive integer (T = int64_t) or number (T = double) up to max: the whole string.
template <class T>
T parse_positive(const std::string& s, T max) {
  size_t used = 0;
  T v = 0;
  try {
    if constexpr (std::is_integral_v<T>) v = std::stoll(s, &used);
    else v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || !(v > 0)) {
    throw std::invalid_argument(
        fmt::format("'{}' is not a positive {}", s, std::is_integral_v<T> ? "integer" : "number"));
  }
  if (!(v <= max)) throw std::invalid_argument(fmt::format("'{}' is above the largest accepted, {}", s, max));
  return v;
}

}  // namespace

std::function<int64_t(const std::string&)> positive_up_to(int64_t max) {
  return [max](const std::string& s) { return parse_positive<int64_t>(s, max); };
}

double parse_positive_number(const std::string& s, double max) { return parse_positive<double>(s, max); }

bool parse_bool(const std::string& s) {
  if (s == "1" || s == "true" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "no") return false;
  throw std::invalid_argument(fmt::format("'{}' is not 0 or 1", s));
}

OutputFile::OutputFile(std::string path)
    : path_(std::move(path)), temporary_(fmt::format("{}.tmp.{}", path_, getpid())) {
  file_ = std::fopen(temporary_.c_str(), "wbx");  // x: never through a file or link someone left at that name
  if (file_ == nullptr) {
    throw flashlm::Error(fmt::format("cannot open '{}' for writing: {}", temporary_, std::strerror(errno)));
  }
}

OutputFile::~OutputFile() {
  if (file_ == nullptr) return;
  std::fclose(file_);
  std::remove(temporary_.c_str());
}

void OutputFile::write(const void* data, size_t bytes) {
  if (std::fwrite(data, 1, bytes, file_) != bytes) {
    throw flashlm::Error(fmt::format("failed writing '{}': {}", temporary_, std::strerror(errno)));
  }
}

void OutputFile::commit() {
  std::FILE* f = std::exchange(file_, nullptr);
  const bool written = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  const int err = errno;
  if (std::fclose(f) != 0 || !written || std::rename(temporary_.c_str(), path_.c_str()) != 0) {
    const int why = written ? errno : err;
    std::remove(temporary_.c_str());
    throw flashlm::Error(fmt::format("failed writing '{}': {}", path_, std::strerror(why)));
  }
}

void write_output(const std::string& text, const std::string& path) {
  if (path.empty() || path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  OutputFile f(path);
  f.write(text.data(), text.size());
  f.commit();
}

void add_report_options(CLI::App* cmd, ReportOptions& r) {
  cmd->add_option("--format", r.format, "md, csv or json")->capture_default_str();
  cmd->add_option("--out", r.out, "Write the report here (stdout then shows the markdown table)");
  cmd->add_flag("--quiet", r.quiet, "No progress lines on stderr");
}

flashlm::ReportFormat report_format(const ReportOptions& r) { return flashlm::parse_report_format(r.format); }

void emit_report(const std::function<std::string(flashlm::ReportFormat)>& render, const ReportOptions& r) {
  const flashlm::ReportFormat format = report_format(r);
  if (!r.out.empty()) {
    // The table first: a file that cannot be written then loses nothing the run measured.
    write_output(render(flashlm::ReportFormat::md), "");
    std::fflush(stdout);
    write_output(render(format), r.out);
  } else {
    write_output(render(format), "");
  }
}

void require_usable_device(flashlm::Device device) {
  if (device == flashlm::Device::cuda && flashlm::cuda_device_count() == 0) {
    throw InvalidArgument(flashlm::cuda_built() ? "--device cuda: no CUDA device is visible"
                                                : "--device cuda: flashlm was built without CUDA");
  }
}

flashlm::Device device_or_default(const std::string& device) {
  using namespace flashlm;
  return device.empty() ? (cuda_device_count() > 0 ? Device::cuda : Device::cpu) : parse_device(device);
}

void resolve_device_and_precision(const std::string& device, const std::string& precision, flashlm::Device& dev,
                                  flashlm::DType& dtype, bool* bf16_pure, bool* fp8) {
  using namespace flashlm;
  bool pure = false, eight = false;
  dev = device_or_default(device);
  dtype = dev == Device::cuda ? DType::bf16 : DType::f32;
  if (!precision.empty()) parse_precision(precision, dtype, pure, eight);
  if (pure && !bf16_pure) throw InvalidArgument("--precision bf16-pure: this command takes fp32, bf16 or fp16");
  if (eight && !fp8) {
    throw InvalidArgument(fmt::format("--precision {}: this command takes fp32, bf16 or fp16", precision));
  }
  if (bf16_pure) *bf16_pure = pure;
  if (fp8) *fp8 = eight;
  require_usable_device(dev);
  if (dev == Device::cpu && eight) dtype = DType::f32;  // fp8 on the CPU: emulated over fp32 (ModelOptions::fp8)
  if (dev == Device::cpu && (dtype != DType::f32 || pure)) {
    throw InvalidArgument(fmt::format("--precision {}: the CPU engine runs fp32 (and fp8, emulated)",
                                      precision_name(dtype, pure, eight)));
  }
}

ConditionalModelOptions add_model_options(CLI::App* cmd, flashlm::ModelOptions& o, ModelOptionFlags flags) {
  using namespace flashlm;
  ConditionalModelOptions given;
  if (flags.attention) {
    cmd->add_option_function<std::string>(
           "--attention", [&o](const std::string& s) { o.attention = parse_attention_impl(s); }, "flash or naive")
        ->default_str(std::string(attention_impl_name(o.attention)));
  }
  cmd->add_flag_callback(
      "--atomic-attention-backward", [&o] { o.deterministic = false; },
      "cuda: the attention backward's dQ by fp32 atomics (faster at long contexts) instead of the "
      "deterministic separate pass; steps are then no longer bit-reproducible");
  cmd->add_option_function<std::string>(
         "--recompute", [&o](const std::string& s) { o.recompute = RecomputePlan::parse(s); },
         "Activation recomputation: none, blocks[:K] (keep every K-th block's input, recompute the rest in the "
         "backward), selective (keep attention output and logsumexp, recompute the rest) or auto (the fastest plan "
         "that fits the free memory)")
      ->default_str(o.recompute.name());
  cmd->add_option("--head-chunk", o.head_chunk,
                  "Tokens per chunk of the LM head + cross-entropy (0: about 1 GiB of logits at a time)")
      ->capture_default_str()
      ->check(in_range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option_function<std::string>(
         "--optimizer-state", [&o](const std::string& s) { o.optimizer_state = parse_optimizer_state(s); },
         "The AdamW moments beside fp32 master weights: fp32; bf16 (widened to fp32 for the update, rounded back to "
         "nearest: 22 instead of 30 bytes per parameter per step with bf16 weights); bf16-sr (rounded back "
         "stochastically, seeded by the run). Not with bf16-pure, ZeRO-1 or FSDP")
      ->default_str(std::string(optimizer_state_name(o.optimizer_state)))
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-sr"}));
  if (flags.grad_dtype) {
    cmd->add_option_function<std::string>(
           "--grad-dtype", [&o](const std::string& s) { o.grad_dtype = parse_grad_dtype(s); },
           "The gradients beside fp32 master weights in fp32, or bf16 (the weight-gradient GEMMs "
           "write bf16, AdamW and the gradient norm read it: 6 bytes per parameter less per step). bf16 needs "
           "--device cuda and --precision bf16 or fp8, one process")
        ->default_str(std::string(dtype_name(o.grad_dtype)))
        ->check(CLI::IsMember({"fp32", "bf16"}));
  }
  if (flags.fp8) {
    given.fp8_gradients = cmd->add_option_function<std::string>(
         "--fp8-gradients", [&o](const std::string& s) { o.fp8_gradients = parse_fp8_format(s); },
         "--precision fp8: the FP8 format of the output gradients in the backward GEMMs: e5m2 (more range) or e4m3 "
         "(more precision); weights and activations are always e4m3")
      ->default_str(std::string(fp8_format_name(o.fp8_gradients)))
      ->check(CLI::IsMember({"e4m3", "e5m2"}));
    given.fp8_recipe = cmd->add_option_function<std::string>(
           "--fp8-recipe", [&o](const std::string& s) { o.fp8_recipe = parse_fp8_recipe(s); },
           "--precision fp8: how the FP8 GEMMs' operands are scaled: tensorwise (one scale per tensor) or rowwise "
           "(one per token, output channel or input column, whichever the product does not sum over; finer, but "
           "each operand is cast twice; cuda needs cuBLAS >= 12.9 on Hopper)")
      ->default_str(std::string(fp8_recipe_name(o.fp8_recipe)));
  }
  if (flags.cuda_graph) {
    given.cuda_graph = cmd->add_option_function<std::string>(
           "--cuda-graph", [&o](const std::string& s) { o.cuda_graph = s == "on"; },
           "cuda: on: each train step is one CUDA graph, captured after a warm-up step and replayed (eager where it "
           "cannot be: fp16, data parallelism, --profile-ranges); off: every step eager")
        ->default_str(o.cuda_graph ? "on" : "off")
        ->check(CLI::IsMember({"on", "off"}));
  }
  if (flags.overlap_grad_norm) {
    cmd->add_flag("--overlap-grad-norm", o.overlap_grad_norm,
                  "Each gradient's share of the gradient norm on a stream beside the backward as it is finalised, "
                  "instead of one pass over every gradient after the backward (--device cuda)");
  }
  return given;
}

void refuse_unused_model_options(const ConditionalModelOptions& given, const flashlm::ModelOptions& options,
                                 flashlm::Device device, bool fp8) {
  for (const CLI::Option* o : {given.fp8_gradients, given.fp8_recipe}) {
    if (o != nullptr && o->count() > 0 && !fp8) {
      throw InvalidArgument(fmt::format("{}: applies to --precision fp8 or bf16-pure-fp8 only; this run has neither",
                                        o->get_name()));
    }
  }
  if (given.cuda_graph != nullptr && given.cuda_graph->count() > 0 && options.cuda_graph &&
      device == flashlm::Device::cpu) {
    throw InvalidArgument("--cuda-graph on: needs --device cuda (the CPU runs every step eagerly)");
  }
}

void add_gradient_sync_options(CLI::App* cmd, std::string& reduce_dtype, int& nccl_max_ctas, int& gemm_sm_reserve,
                               const char* dtype_help) {
  cmd->add_option("--reduce-dtype", reduce_dtype,
                  fmt::format("{}: fp32, or on cuda bf16 or fp16, which halve the bytes NCCL moves (each bucket's fp32 "
                              "gradients rounded to 16 bits, averaged by NCCL in that type, widened back)",
                              dtype_help))
      ->capture_default_str();
  cmd->add_option("--nccl-max-ctas", nccl_max_ctas,
                  "The most CTAs (one SM each) an NCCL collective may use (ncclConfig_t maxCTAs), leaving SMs to the "
                  "backward the all-reduces overlap; default: NCCL's choice; NCCL_MAX_CTAS in the environment "
                  "overrides it")
      ->check(in_range(1, 4096));
  cmd->add_option("--gemm-sm-reserve", gemm_sm_reserve,
                  "SMs the backward's cuBLASLt GEMMs leave to the all-reduces they overlap (cuBLASLt's SM count "
                  "target; async and bucketed on cuda); default: --nccl-max-ctas if given, else 0")
      ->check(CLI::Range(0, 4096));
}

std::vector<flashlm::DType> parse_reduce_dtypes(const std::string& list, flashlm::Device device, int nccl_max_ctas,
                                                int gemm_sm_reserve) {
  using namespace flashlm;
  const auto dtypes =
      parse_list<DType>("--reduce-dtype", list, [](const std::string& s) { return parse_reduce_dtype(s); });
  if (device == Device::cpu) {
    for (DType t : dtypes) {
      if (t != DType::f32) {
        throw InvalidArgument(fmt::format("--reduce-dtype {}: {} gradient reduction needs --device cuda (NCCL); MPI "
                                          "reduces fp32 on the CPU",
                                          dtype_name(t), dtype_name(t)));
      }
    }
    if (nccl_max_ctas > 0) throw InvalidArgument("--nccl-max-ctas: needs --device cuda (NCCL)");
    if (gemm_sm_reserve >= 0) throw InvalidArgument("--gemm-sm-reserve: needs --device cuda (cuBLASLt beside NCCL)");
  }
  return dtypes;
}

void add_collective_timeout_option(CLI::App* cmd, double& seconds) {
  cmd->add_option("--collective-timeout-s", seconds,
                  "End the job with an error when a collective waits longer than this for the other ranks (a rank "
                  "stalled or died); 0: never; default $FLASHLM_DIST_TIMEOUT_S, else 600")
      ->check(in_range(0.0, flashlm::kMaxTimeoutSeconds));
}

int run_on_every_rank(double timeout_s, const std::function<void(flashlm::Communicator&)>& fn) {
  int status = 0;
  {
    flashlm::Communicator comm;  // MPI_Init
    if (timeout_s >= 0) comm.set_timeout(timeout_s);
    try {
      fn(comm);
    } catch (const flashlm::SettingsMismatch& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      status = 2;
    } catch (const std::exception& e) {
      if (comm.world_size() > 1) {
        fmt::print(stderr, "error: rank {}: {}\n", comm.rank(), e.what());
        std::fflush(stderr);
        // The library's option checks run on every rank: their usage error keeps its exit code under mpirun.
        flashlm::Communicator::abort(dynamic_cast<const InvalidArgument*>(&e) ? 2 : 1);
      }
      throw;
    }
  }
  flashlm::Communicator::finalize();
  return status;
}

bool launched_with_peers() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* v = std::getenv(var);
    if (v && std::atoi(v) > 1) return true;
  }
  return false;
}

void refuse_torchrun() {
  const char* world = std::getenv("WORLD_SIZE");
  const bool torch_launcher =
      std::getenv("TORCHELASTIC_RUN_ID") || (std::getenv("LOCAL_RANK") && world && std::atoi(world) > 1);
  if (torch_launcher && !launched_with_peers()) {
    throw InvalidArgument(fmt::format("launched by torchrun (WORLD_SIZE={}, RANK={}): flashlm's ranks come from MPI; "
                                      "run 'mpirun -np {} flashlm ...' instead (each torchrun copy would train alone)",
                                      world ? world : "?", std::getenv("RANK") ? std::getenv("RANK") : "?",
                                      world ? world : "N"));
  }
}

int64_t model_config_value(const std::string& key, const std::vector<std::string>& file_keys, int64_t file_value,
                           const CLI::Option* flag, int64_t flag_value) {
  const bool in_file = std::find(file_keys.begin(), file_keys.end(), key) != file_keys.end();
  if (in_file && flag->count() > 0) {
    fmt::print(stderr, "note: {} {} replaces the model config's \"{}\": {}\n", flag->get_name(), flag_value, key,
               file_value);
  }
  return in_file && flag->count() == 0 ? file_value : flag_value;
}
