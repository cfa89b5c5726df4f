// flashlm ddp-bench: the LM's train step data-parallel across the ranks of a job for every DDP variant
// (run_ddp_bench), against the step without communication.
#include "cli_common.h"
#include "flashlm/ddp.h"
#include "flashlm/device.h"
#include "flashlm/dist.h"

namespace {

struct DdpBenchArgs {
  flashlm::DdpBenchConfig cfg;
  std::string ddp = "per-param,flat,async,bucketed", bucket_mb = "1,10,100,1000", zero = "0";
  std::string reduce_dtype = "fp32", device, precision;
  int threads = 0;
  double collective_timeout_s = -1;
  ReportOptions report;
};

int run(DdpBenchArgs& a) {
  using namespace flashlm;
  DdpBenchConfig& cfg = a.cfg;
  resolve_device_and_precision(a.device, a.precision, cfg.device, cfg.precision, &cfg.options.bf16_pure);
  cfg.options.check_optimizer_state();
  ModelConfig::named(cfg.model);  // an unknown size is a usage error
  cfg.variants = parse_list<DdpVariant>("--ddp", a.ddp, [](const std::string& s) { return parse_ddp_variant(s); });
  cfg.bucket_mb = parse_list<double>("--bucket-mb", a.bucket_mb,
                                     [](const std::string& s) { return parse_positive_number(s, kMaxBucketMb); });
  cfg.zero1 = parse_list<bool>("--zero", a.zero, parse_bool);
  report_format(a.report);  // a bad --format is refused before the sweep
  cfg.reduce_dtypes = parse_reduce_dtypes(a.reduce_dtype, cfg.device, cfg.nccl_max_ctas, cfg.gemm_sm_reserve);
  if (cfg.device == Device::cuda && !Communicator::nccl_built()) {
    throw InvalidArgument("--device cuda: flashlm was built without NCCL");
  }
  if (a.threads > 0) set_cpu_threads(a.threads);
  return run_on_every_rank(a.collective_timeout_s, [&](Communicator& comm) {
    if (!a.report.quiet && comm.is_root()) {
      cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
      fmt::print(stderr, "ddp-bench: {} rank(s), {} ctx {} x {} sequences per rank, {} on {}, recompute {}\n",
                 comm.world_size(), cfg.model, cfg.context, cfg.batch,
                 precision_name(cfg.precision, cfg.options.bf16_pure), device_name(cfg.device),
                 cfg.options.recompute.name());
    }
    const auto records = run_ddp_bench(comm, cfg);
    if (comm.is_root()) {
      emit_report([&](ReportFormat f) { return format_ddp_bench(records, f, cfg, comm); }, a.report);
    }
  });
}

}  // namespace

Command add_ddp_bench_command(CLI::App& app) {
  auto a = std::make_shared<DdpBenchArgs>();
  flashlm::DdpBenchConfig& cfg = a->cfg;
  cfg.vocab = 0;  // the size's own
  CLI::App* cmd = app.add_subcommand(
      "ddp-bench",
      "Time the LM's train step data-parallel across the ranks of a job (mpirun -np N flashlm ddp-bench) for "
      "every DDP variant, bucket size and gradient reduction type, against the step without communication");
  cmd->add_option("--model", cfg.model, "Size: tiny, small, medium, large, xl, 2.7B, cs336-8b")->capture_default_str();
  cmd->add_option("--context", cfg.context, "Tokens per sequence")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxContext));
  cmd->add_option("--batch", cfg.batch, "Sequences per rank")
      ->capture_default_str()
      ->check(in_range(int64_t{1}, kMaxBatch));
  cmd->add_option("--vocab", cfg.vocab, "Vocabulary size (default: the size's own: 151936 for cs336-8b, else 10000)")
      ->check(in_range(int64_t{2}, kMaxVocab));
  cmd->add_option("--ddp", a->ddp, "DDP variants, comma list of per-param,flat,async,bucketed,fsdp")
      ->capture_default_str();
  cmd->add_option("--fsdp-prefetch", cfg.fsdp_prefetch, "fsdp: model parts ahead whose gather starts early")
      ->capture_default_str()
      ->check(CLI::Range(0, 2));
  cmd->add_option("--bucket-mb", a->bucket_mb, "Bucket sizes of the bucketed variant, MB, comma list")
      ->capture_default_str();
  cmd->add_option("--zero", a->zero, "ZeRO-1 off and/or on: comma list of 0,1")->capture_default_str();
  add_gradient_sync_options(cmd, a->reduce_dtype, cfg.nccl_max_ctas, cfg.gemm_sm_reserve,
                            "Element types of the gradient all-reduce, comma list (a row each)");
  cmd->add_option("--device", a->device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--precision", a->precision,
                  "fp32, bf16 (fp32 masters), fp16 or bf16-pure (bf16 parameters, gradients and moments: the fsdp "
                  "rows; DDP and ZeRO-1 refuse it) (default: bf16 on cuda, fp32 on cpu)");
  add_model_options(cmd, cfg.options, {});
  cmd->add_option("--warmup", cfg.warmup, "Untimed steps first")->capture_default_str()->check(in_range(0, kMaxReps));
  cmd->add_option("--steps", cfg.steps, "Timed steps")->capture_default_str()->check(in_range(1, kMaxReps));
  add_threads_option(cmd, a->threads);
  add_collective_timeout_option(cmd, a->collective_timeout_s);
  add_report_options(cmd, a->report);
  return {cmd, [a] { return run(*a); }};
}
