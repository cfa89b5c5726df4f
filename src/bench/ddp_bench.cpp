// ddp-bench: the LM's train step under each DDP variant across the ranks of a job, against the same step
// without communication, timed in one run.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <span>

#include "bench/report.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/ddp_model.h"
#include "flashlm/dist.h"
#include "flashlm/memory.h"

namespace flashlm {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Times `steps` calls of step() after `warmup` untimed ones; per step the slowest rank's time (ms).
std::vector<double> time_steps(Communicator& comm, const DdpBenchConfig& cfg, const std::function<void()>& step) {
  for (int i = 0; i < cfg.warmup; ++i) step();
  std::vector<double> ms;
  for (int i = 0; i < cfg.steps; ++i) {
    comm.barrier();  // start together; the barrier is not timed
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(ms_since(t0));
  }
  comm.all_reduce(std::span<double>(ms), ReduceOp::max);
  return ms;
}

// The largest rank's peak of tracked allocations on `device` since the last reset, MiB.
double peak_mib(Communicator& comm, Device device) {
  double peak = double(memory_stats(device).peak_bytes) / kMiB;
  comm.all_reduce(std::span<double>(&peak, 1), ReduceOp::max);
  return peak;
}

// The benchmark's model options (DdpBenchConfig), with FSDP's sharded storage for an fsdp row and a sharded
// optimizer's share of the moments for the rows that shard them.
ModelOptions model_options(const DdpBenchConfig& cfg, const Communicator& comm, bool fsdp, int64_t optimizer_shards) {
  ModelOptions o = cfg.options;
  o.attention = AttentionImpl::flash;
  o.optimizer_shards = optimizer_shards;
  if (fsdp) {
    o.external_parameters = true;
    o.fsdp_world = comm.world_size();
    o.fsdp_prefetch = cfg.fsdp_prefetch;
  }
  return o;
}

// The model's memory plan against this rank's free device memory, its recomputation resolved there. "" when
// it fits (or on the CPU, which has no limit here); otherwise the shortfall, as check_memory_plan words it.
std::string plan_fits(const ModelConfig& mc, const DdpBenchConfig& cfg, ModelOptions& o) {
  int64_t available = -1;
  const MemoryPlan plan = resolve_model_memory(mc, cfg.batch, cfg.context, cfg.device, cfg.precision, o, available);
  try {
    check_memory_plan(plan, available, "the GPU");
  } catch (const OutOfMemory& e) {
    return e.what();
  }
  return "";
}

// One row: a DdpModel with the row's variant over the shared model (nullptr: it could not be built, `why`
// says why), warm-up, then timed steps. Errors that some ranks see while setting up (out of memory for
// ZeRO-1's moments) become the row's status on every rank.
void measure(Communicator& comm, const DdpBenchConfig& cfg, LanguageModel* shared, const std::string& why,
             std::span<const int32_t> tokens, std::span<const int32_t> targets,
             std::optional<double> local_tokens_per_s, DdpBenchRecord& rec) {
  // FSDP's row runs a model of its own with sharded storage (ModelOptions::external_parameters), so that its
  // memory columns are what a rank allocates under FSDP; its peak is counted above what the shared model of
  // the other rows holds, idle meanwhile.
  const bool fsdp = rec.variant == ddp_variant_name(DdpVariant::fsdp);
  const int64_t held_before = fsdp ? memory_stats(cfg.device).current_bytes : 0;
  std::unique_ptr<LanguageModel> own;
  DdpOptions opt;
  opt.variant = parse_ddp_variant(rec.variant);
  if (rec.bucket_mb) opt.bucket_mb = *rec.bucket_mb;
  opt.reduce_dtype = parse_reduce_dtype(rec.reduce_dtype);
  opt.gemm_sm_reserve = cfg.gemm_sm_reserve;
  opt.fsdp_prefetch = cfg.fsdp_prefetch;
  std::unique_ptr<DdpModel> dp;
  std::string error;
  bool oom = false;
  const ModelConfig mc = ModelConfig::named(cfg.model, cfg.context, cfg.vocab);
  try {
    if (fsdp) {
      ModelOptions options = model_options(cfg, comm, true, comm.world_size());
      if (std::string shortfall = plan_fits(mc, cfg, options); !shortfall.empty()) throw OutOfMemory(shortfall);
      rec.recompute = options.recompute.name();
      own = make_model(mc, cfg.batch, cfg.context, cfg.device, cfg.precision, options);
    } else if (!shared) {
      throw OutOfMemory(fmt::format("not run: each rank would hold the whole model ({})", why));
    }
    dp = std::make_unique<DdpModel>(comm, own ? *own : *shared, int64_t(tokens.size()), opt, rec.zero1);
    if (own) dp->init_parameters(1);
  } catch (const OutOfMemory& e) {
    error = e.what(), oom = true;
  } catch (const Error& e) {
    error = e.what();
  }
  double any_oom = oom ? 1 : 0;
  comm.all_reduce(std::span<double>(&any_oom, 1), ReduceOp::max);
  if (const std::string first = comm.first_error(error); !first.empty()) {
    rec.status = any_oom > 0 ? "oom" : "error";
    rec.message = first;
    return;
  }
  LanguageModel& model = own ? *own : *shared;
  dp->broadcast_parameters();
  AdamWConfig adamw;
  std::vector<double> exposed;
  model.synchronize();
  memory_reset_peak(model.device());
  const std::vector<double> ms = time_steps(comm, cfg, [&] {
    dp->train_step(tokens, targets, adamw, 1e-4);
    model.synchronize();
    exposed.push_back(dp->data_parallel().last_stats().exposed_ms);
  });
  exposed.erase(exposed.begin(), exposed.begin() + cfg.warmup);
  double exposed_mean = moments(exposed).mean;
  comm.all_reduce(std::span<double>(&exposed_mean, 1), ReduceOp::max);
  const Moments m = moments(ms);
  rec.buckets = int64_t(dp->data_parallel().buckets().size());
  rec.gradient_sync = std::string(dp->gradient_sync());
  rec.mean_ms = m.mean;
  rec.median_ms = m.median;
  rec.exposed_comm_ms = exposed_mean;
  rec.tokens_per_s = double(rec.world_size) * double(tokens.size()) / (m.median / 1e3);
  if (local_tokens_per_s) rec.scaling_efficiency = *rec.tokens_per_s / (double(rec.world_size) * *local_tokens_per_s);
  const DdpMemory mem = dp->memory();
  rec.optimizer_state_mib = double(mem.optimizer_state) / kMiB;
  rec.parameters_mib = double(mem.parameters) / kMiB;
  rec.gradients_mib = double(mem.gradients) / kMiB;
  if (dp->fsdp()) rec.gathered_mib = double(mem.gathered) / kMiB;
  rec.peak_mib = peak_mib(comm, model.device()) - double(held_before) / kMiB;
  rec.staging_mib = double(dp->data_parallel().staging_bytes()) / kMiB;
}

// Every setting of the benchmark: the ranks must agree on all (Communicator::agree_settings). The report's
// destination and the CPU threads are the CLI's and rank-local.
std::vector<RunSetting> run_settings(const DdpBenchConfig& cfg) {
  auto list = [](const auto& items, auto&& name) {
    std::string text;
    for (const auto& item : items) text += fmt::format("{}{}", text.empty() ? "" : ",", name(item));
    return text;
  };
  return {{"model", cfg.model},
          {"context", fmt::format("{}", cfg.context)},
          {"batch", fmt::format("{}", cfg.batch)},
          {"vocab", fmt::format("{}", cfg.vocab)},
          {"device", std::string(device_name(cfg.device))},
          {"precision", precision_name(cfg.precision, cfg.options.bf16_pure)},
          {"recompute", cfg.options.recompute.name()},
          {"head_chunk", fmt::format("{}", cfg.options.head_chunk)},
          {"deterministic", fmt::format("{}", cfg.options.deterministic)},
          {"variants", list(cfg.variants, ddp_variant_name)},
          {"bucket_mb", list(cfg.bucket_mb, [](double mb) { return mb; })},
          {"reduce_dtypes", list(cfg.reduce_dtypes, dtype_name)},
          {"zero1", list(cfg.zero1, [](bool on) { return on ? 1 : 0; })},
          {"nccl_max_ctas", fmt::format("{}", cfg.nccl_max_ctas)},
          {"gemm_sm_reserve", fmt::format("{}", cfg.gemm_sm_reserve)},
          {"fsdp_prefetch", fmt::format("{}", cfg.fsdp_prefetch)},
          {"warmup", fmt::format("{}", cfg.warmup)},
          {"steps", fmt::format("{}", cfg.steps)}};
}

}  // namespace

std::vector<DdpBenchRecord> run_ddp_bench(Communicator& comm, const DdpBenchConfig& cfg) {
  FLASHLM_CHECK(cfg.steps >= 1, "ddp-bench: steps must be at least 1, got {}", cfg.steps);
  FLASHLM_CHECK(cfg.warmup >= 0, "ddp-bench: warmup must be >= 0, got {}", cfg.warmup);
  FLASHLM_CHECK(cfg.batch >= 1, "ddp-bench: batch must be at least 1, got {}", cfg.batch);
  FLASHLM_CHECK(!cfg.variants.empty() && !cfg.zero1.empty(), "ddp-bench: no variant to measure");
  for (double mb : cfg.bucket_mb) FLASHLM_CHECK(mb > 0, "ddp-bench: bucket size {} MB, expected > 0", mb);
  FLASHLM_CHECK(!cfg.reduce_dtypes.empty(), "ddp-bench: no gradient reduction type to measure");
  FLASHLM_CHECK(cfg.nccl_max_ctas >= 0, "ddp-bench: nccl_max_ctas = {}, expected >= 0", cfg.nccl_max_ctas);
  FLASHLM_CHECK(cfg.options.head_chunk >= 0, "ddp-bench: head_chunk = {}, expected >= 0", cfg.options.head_chunk);
  resolve_gemm_sm_reserve(cfg.gemm_sm_reserve, comm);  // checks it before any rank builds a model
  comm.agree_settings(run_settings(cfg));
  if (cfg.device == Device::cuda) {
    comm.set_nccl_max_ctas(cfg.nccl_max_ctas);
    comm.setup_cuda();  // this rank's GPU, before the model is placed
  }

  const ModelConfig mc = ModelConfig::named(cfg.model, cfg.context, cfg.vocab);
  // Each rank its own tokens, as each would read its own slice of the data.
  std::vector<int32_t> tokens(size_t(checked_mul(cfg.batch, cfg.context, "ddp-bench: tokens per step"))),
      targets(tokens.size());
  std::mt19937 rng(7 + uint32_t(comm.rank()));
  std::uniform_int_distribution<int32_t> token(0, int32_t(mc.vocab - 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = token(rng), targets[i] = token(rng);

  std::vector<DdpBenchRecord> records;
  auto row = [&](std::string variant, std::optional<double> bucket_mb, std::string reduce_dtype, bool zero1,
                 int world) {
    DdpBenchRecord r;
    r.variant = std::move(variant);
    r.bucket_mb = bucket_mb;
    r.reduce_dtype = std::move(reduce_dtype);
    r.zero1 = zero1;
    r.world_size = world;
    records.push_back(std::move(r));
  };
  row("none", std::nullopt, "", false, 1);
  for (bool zero1 : cfg.zero1) {
    for (DdpVariant v : cfg.variants) {
      // FSDP shards the optimizer state itself: one row, whatever the ZeRO-1 settings.
      if (v == DdpVariant::fsdp && zero1 != cfg.zero1.front()) continue;
      std::vector<std::optional<double>> sizes{std::nullopt};
      if (v == DdpVariant::bucketed) sizes.assign(cfg.bucket_mb.begin(), cfg.bucket_mb.end());
      for (const std::optional<double>& mb : sizes) {
        for (DType t : cfg.reduce_dtypes) {
          row(std::string(ddp_variant_name(v)), mb, std::string(dtype_name(t)), zero1 && v != DdpVariant::fsdp,
              comm.world_size());
        }
      }
    }
  }
  const auto is_fsdp = [](const DdpBenchRecord& r) { return r.variant == ddp_variant_name(DdpVariant::fsdp); };
  auto report = [&](size_t i) {
    if (!cfg.progress || !comm.is_root()) return;
    const DdpBenchRecord& r = records[i];
    const std::string what =
        fmt::format("{}{}{}{}{}", r.variant, r.bucket_mb ? fmt::format(" {} MB", *r.bucket_mb) : "",
                    r.reduce_dtype.empty() || r.reduce_dtype == "fp32" ? "" : ", " + r.reduce_dtype + " all-reduce",
                    r.zero1 ? " + ZeRO-1" : "", r.gradient_sync == "reduce-scatter" ? " (reduce-scatter)" : "");
    const std::string result =
        r.status != "ok" ? r.status + " (" + r.message + ")"
        : r.scaling_efficiency
            ? fmt::format("median {:.2f} ms, comm not hidden {:.2f} ms, scaling efficiency {:.3f}", *r.median_ms,
                          *r.exposed_comm_ms, *r.scaling_efficiency)
            : fmt::format("median {:.2f} ms", *r.median_ms);
    cfg.progress(fmt::format("[{}/{}] {} x {} rank(s), recompute {}: {}", i + 1, records.size(), what, r.world_size,
                             r.recompute.empty() ? "-" : r.recompute, result));
  };

  // The model the step without communication and the DDP / ZeRO-1 rows share, whole on every rank: built
  // when its plan fits with its own moments (the plain step allocates them); otherwise, for ZeRO-1 rows, with
  // this rank's share of them (the plain step is then not timed); otherwise not at all, and those rows say
  // why. Not built when every row after the plain one is FSDP's and the plain step does not fit. Every rank
  // decides alike (the first rank's shortfall).
  std::unique_ptr<LanguageModel> shared;
  std::string shared_why, shared_recompute;
  bool plain_fits = false;
  const bool any_zero1 = std::any_of(records.begin(), records.end(), [](const DdpBenchRecord& r) { return r.zero1; });
  for (const int64_t shards : {int64_t{1}, int64_t(comm.world_size())}) {
    if (shards > 1 && (!any_zero1 || comm.world_size() == 1)) break;
    ModelOptions o = model_options(cfg, comm, false, shards);
    const std::string why = comm.first_error(plan_fits(mc, cfg, o));
    if (why.empty()) {
      shared = make_model(mc, cfg.batch, cfg.context, cfg.device, cfg.precision, o);
      shared->init_parameters(1);
      plain_fits = shards == 1;
      shared_recompute = o.recompute.name();
      break;
    }
    if (shared_why.empty()) shared_why = why;
  }

  // The step without communication: what one GPU (or one CPU process) does alone; not timed (said in its
  // row, not an error) when its memory plan does not fit.
  std::optional<double> local_tokens_per_s;
  if (plain_fits) {
    LanguageModel& model = *shared;
    AdamWConfig adamw;
    model.synchronize();
    memory_reset_peak(model.device());
    const Moments local = moments(time_steps(comm, cfg, [&] {
      model.zero_grad();
      model.forward(tokens.data(), targets.data());
      model.backward();
      optimizer_step(model, adamw, 1e-4);
      model.synchronize();
    }));
    local_tokens_per_s = double(tokens.size()) / (local.median / 1e3);
    records[0].mean_ms = local.mean;
    records[0].median_ms = local.median;
    records[0].tokens_per_s = local_tokens_per_s;
    const bool bf16_moments = cfg.options.bf16_pure || cfg.options.optimizer_state != OptimizerState::fp32;
    const int64_t moment_bytes = bf16_moments ? int64_t(sizeof(bf16_t)) : int64_t(sizeof(float));
    records[0].optimizer_state_mib = double(2 * model.parameter_count() * moment_bytes) / kMiB;
    records[0].peak_mib = peak_mib(comm, model.device());
    records[0].recompute = shared_recompute;
  } else {
    records[0].status = "not timed";
    records[0].message = "its memory plan does not fit: " + shared_why;
  }
  report(0);
  for (size_t i = 1; i < records.size(); ++i) {
    // The FSDP model gets the memory the shared one held once no later row needs it.
    if (shared && std::all_of(records.begin() + std::ptrdiff_t(i), records.end(), is_fsdp)) {
      shared->synchronize();
      shared.reset();
      cuda_release_pooled_memory();  // the FSDP row's plan checks the device's free memory
      shared_why = "freed before the FSDP rows";
    }
    // A model built with only a ZeRO-1 share of the moments serves the ZeRO-1 rows alone (DDP would
    // allocate the whole moments in its first step).
    LanguageModel* serves = shared && (plain_fits || records[i].zero1) ? shared.get() : nullptr;
    if (!is_fsdp(records[i]) && serves) records[i].recompute = shared_recompute;
    measure(comm, cfg, serves, shared_why, tokens, targets, local_tokens_per_s, records[i]);
    report(i);
  }
  return records;
}

std::string format_ddp_bench(const std::vector<DdpBenchRecord>& records, ReportFormat format,
                             const DdpBenchConfig& cfg, const Communicator& comm) {
  std::vector<nlohmann::json> rows;
  auto opt = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
  for (const auto& r : records) {
    nlohmann::json j = {{"variant", r.variant},
                        {"bucket_mb", opt(r.bucket_mb)},
                        {"reduce_dtype", r.reduce_dtype.empty() ? nlohmann::json() : nlohmann::json(r.reduce_dtype)},
                        {"gradient_sync", r.gradient_sync.empty() ? nlohmann::json() : nlohmann::json(r.gradient_sync)},
                        {"zero1", r.zero1},
                        {"world_size", r.world_size},
                        {"buckets", r.buckets},
                        {"mean_ms", opt(r.mean_ms)},
                        {"median_ms", opt(r.median_ms)},
                        {"exposed_comm_ms", opt(r.exposed_comm_ms)},
                        {"tokens_per_s", opt(r.tokens_per_s)},
                        {"scaling_efficiency", opt(r.scaling_efficiency)},
                        {"optimizer_state_mib", opt(r.optimizer_state_mib)},
                        {"staging_mib", opt(r.staging_mib)},
                        {"parameters_mib", opt(r.parameters_mib)},
                        {"gradients_mib", opt(r.gradients_mib)},
                        {"gathered_mib", opt(r.gathered_mib)},
                        {"peak_mib", opt(r.peak_mib)},
                        {"recompute", r.recompute.empty() ? nlohmann::json() : nlohmann::json(r.recompute)},
                        {"status", r.status}};
    if (!r.message.empty()) j["message"] = r.message;
    rows.push_back(std::move(j));
  }
  const std::vector<ReportColumn> columns = {
      {"variant", "variant"},          {"bucket_mb", "bucket MB", 2},      {"reduce_dtype", "all-reduce in"},
      {"gradient_sync", "grad sync"},  {"zero1", "ZeRO-1"},                {"world_size", "ranks"},
      {"buckets", "buckets"},
      {"mean_ms", "step mean ms", 2},  {"median_ms", "step median ms", 2}, {"exposed_comm_ms", "comm not hidden ms", 2},
      {"tokens_per_s", "tokens/s", 0}, {"scaling_efficiency", "scaling eff.", 3},
      {"optimizer_state_mib", "AdamW state MiB/rank", 1}, {"staging_mib", "DDP staging MiB/rank", 1},
      {"parameters_mib", "params MiB/rank", 1}, {"gradients_mib", "grads MiB/rank", 1},
      {"gathered_mib", "FSDP gathered MiB/rank", 1}, {"peak_mib", "peak MiB/rank", 1},
      {"recompute", "recompute"},      {"status", "status"}};
  const nlohmann::json meta = {
      {"tool", "flashlm ddp-bench"},
      {"device", describe_device(cfg.device)},
      {"world_size", comm.world_size()},
      {"ranks_per_node", comm.local_size()},
      {"date", utc_date()},
      {"model", cfg.model},
      {"context", cfg.context},
      {"batch_per_rank", cfg.batch},
      {"precision", precision_name(cfg.precision, cfg.options.bf16_pure)},
      {"recompute_requested", cfg.options.recompute.name()},
      {"head_chunk", cfg.options.head_chunk},
      {"deterministic_attention_backward", cfg.options.deterministic},
      {"warmup", cfg.warmup},
      {"steps", cfg.steps},
      {"nccl_max_ctas", cfg.nccl_max_ctas > 0 ? nlohmann::json(cfg.nccl_max_ctas) : nlohmann::json()},
      {"gemm_sm_reserve", resolve_gemm_sm_reserve(cfg.gemm_sm_reserve, comm)},
      {"fsdp_prefetch", cfg.fsdp_prefetch},
      {"timing", "per step the slowest rank's time (forward, backward, gradient sync, optimizer); mean and median "
                 "over steps"},
      {"scaling_efficiency", "tokens/s at world N / (N x tokens/s of the step without communication, 'none')"},
      {"comm_not_hidden", "from the end of the backward's computation until the gradients are synchronised"},
      {"gradient_sync", "all-reduce: every rank gets every averaged gradient; reduce-scatter (ZeRO-1 on CUDA, fp32, "
                        "bucketed): each bucket reduce-scattered into the ranks' ZeRO-1 shards, half the bytes during "
                        "the backward, the updated parameters all-gathered after the optimizer"},
      {"reduce_dtype", "the element type of the gradient all-reduce: fp32, or bf16/fp16 (each bucket rounded "
                       "from the fp32 gradients into a staging area, averaged by NCCL in that type, widened back)"}};
  return render_report(rows, columns, format, meta);
}

}  // namespace flashlm
