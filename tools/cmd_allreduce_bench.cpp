// flashlm allreduce-bench: in-place all-reduce across the ranks of a job (run_allreduce_bench), MPI on CPU
// buffers, NCCL on GPUs.
#include "cli_common.h"
#include "flashlm/device.h"
#include "flashlm/dist.h"

namespace {

struct AllReduceBenchArgs {
  flashlm::AllReduceBenchConfig cfg;
  std::string sizes = "1MB,10MB,100MB,1GB", dtype = "fp32", device;
  double collective_timeout_s = -1;
  ReportOptions report;
};

int run(AllReduceBenchArgs& a) {
  using namespace flashlm;
  AllReduceBenchConfig& cfg = a.cfg;
  cfg.sizes = parse_list<int64_t>("--sizes", a.sizes, [](const std::string& s) { return parse_byte_size(s); });
  cfg.dtypes = parse_list<DType>("--dtype", a.dtype, [](const std::string& s) { return parse_dtype(s); });
  // Default: the GPUs when there are any and NCCL was built, else the CPU (MPI).
  cfg.device = a.device.empty() && !Communicator::nccl_built() ? Device::cpu : device_or_default(a.device);
  report_format(a.report);  // a bad --format is refused before the sweep
  cfg.validate();            // and a dtype the device's collectives do not carry
  if (cfg.device == Device::cuda && !Communicator::nccl_built()) {
    throw InvalidArgument(cuda_built() ? "--device cuda: flashlm was built without NCCL"
                                       : "--device cuda: flashlm was built without CUDA");
  }
  require_usable_device(cfg.device);
  return run_on_every_rank(a.collective_timeout_s, [&](Communicator& comm) {
    if (!a.report.quiet && comm.is_root()) {
      cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
      fmt::print(stderr, "allreduce-bench: {} rank(s), {} on this node, {}\n", comm.world_size(), comm.local_size(),
                 cfg.device == Device::cuda ? "NCCL on GPUs" : "MPI on CPU buffers");
    }
    const auto records = run_allreduce_bench(comm, cfg);
    if (comm.is_root()) {
      emit_report([&](ReportFormat f) { return format_allreduce_bench(records, f, cfg, comm); }, a.report);
    }
  });
}

}  // namespace

Command add_allreduce_bench_command(CLI::App& app) {
  auto a = std::make_shared<AllReduceBenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "allreduce-bench",
      "Time all-reduce across the ranks of a job (mpirun -np N flashlm allreduce-bench): MPI on CPU buffers, NCCL "
      "on GPUs; algbw and busbw as nccl-tests");
  cmd->add_option("--sizes", a->sizes,
                  "Bytes per rank, comma list; KB, MB, GB are powers of 1000, KiB, MiB, GiB powers of 1024")
      ->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "Comma list: fp32, fp64 on cpu; fp32, bf16, fp16, fp64 on cuda")
      ->capture_default_str();
  cmd->add_option("--device", a->device,
                  "cpu (MPI) or cuda (NCCL, one GPU per rank); default: cuda if a GPU is visible and NCCL was built");
  cmd->add_option("--warmup", a->cfg.warmup, "Untimed all-reduces per size")
      ->capture_default_str()
      ->check(in_range(0, kMaxReps));
  cmd->add_option("--iters", a->cfg.iters, "Timed all-reduces per size")
      ->capture_default_str()
      ->check(in_range(1, kMaxReps));
  add_collective_timeout_option(cmd, a->collective_timeout_s);
  add_report_options(cmd, a->report);
  return {cmd, [a] { return run(*a); }};
}
