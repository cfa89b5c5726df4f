// flashlm bench: warm-up, then timed forward / forward+backward / full train steps of the LM, with
// mean ± std and median, tokens/s, MFU and peak memory per pass.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "bench/report.h"
#include "core/check.h"
#include "core/cuda_runtime.h"
#include "flashlm/device.h"
#include "flashlm/profile.h"
#ifdef FLASHLM_WITH_CUDA
#include "model/cuda/gemm.h"
#endif

namespace flashlm {

double train_flops_per_token(const ModelConfig& c, int64_t context) {
  return 6.0 * double(c.non_embedding_parameter_count()) + 12.0 * double(c.layers * context * c.d_model);
}

double useful_train_flops_per_token(const ModelConfig& c, int64_t context) {
  return 6.0 * double(c.non_embedding_parameter_count()) + 6.0 * double(c.layers * context * c.d_model);
}

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Times every requested pass of one (model, context, precision, attention) configuration. Each timed
// step ends with a device synchronisation, so host time is the step's time on either device.
void measure(const LmBenchConfig& cfg, const ModelConfig& mc, DType precision, bool bf16_pure, bool fp8,
             AttentionImpl impl, std::vector<LmBenchRecord*>& rows) {
  const Device dev = cfg.device;
  ModelOptions options = cfg.options;
  options.attention = impl;
  options.bf16_pure = bf16_pure;
  options.fp8 = fp8;
  // bf16-pure keeps bf16 moments by itself (ModelOptions::check_optimizer_state).
  if (bf16_pure) options.optimizer_state = OptimizerState::fp32;
  options.moment_rounding_seed = 1;  // the seed of the weights below
  // The plan before anything is allocated: printed, and refused (an "oom" row) when it cannot fit.
  int64_t available = -1;
  const MemoryPlan plan = resolve_model_memory(mc, cfg.batch, mc.context, dev, precision, options, available);
  for (LmBenchRecord* rec : rows) {
    rec->recompute = plan.recompute.name();
    rec->plan_mib = double(plan.total_bytes()) / kMiB;
  }
  if (cfg.progress) {
    cfg.progress(fmt::format("memory plan: {} ctx {} batch {} {}, recompute {}\n{}", rows.front()->model, mc.context,
                             cfg.batch, precision_name(precision, bf16_pure, fp8), plan.recompute.name(), plan.format()));
  }
  check_memory_plan(plan, available, "the GPU");
  const int64_t base = memory_stats(dev).current_bytes;
  memory_reset_peak(dev);
  const std::unique_ptr<LanguageModel> model_ptr = make_model(mc, cfg.batch, mc.context, dev, precision, options);
  LanguageModel& model = *model_ptr;
  model.init_parameters(1);
  std::vector<int32_t> tokens(size_t(checked_mul(cfg.batch, mc.context, "bench: tokens per step"))),
      targets(tokens.size());
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(0, int32_t(mc.vocab - 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = token(rng), targets[i] = token(rng);
  AdamWConfig opt;

  for (LmBenchRecord* rec : rows) {
    std::function<void()> run;
    if (rec->pass == "fwd") {
      run = [&] { model.forward(tokens.data(), targets.data()); };
    } else if (rec->pass == "fwd-bwd") {
      run = [&] {
        model.zero_grad();
        model.forward(tokens.data(), targets.data());
        model.backward();
      };
    } else {
      run = [&] { model.train_step(tokens.data(), targets.data(), opt, 1e-4); };
    }
    memory_reset_peak(dev);
    for (int i = 0; i < cfg.warmup; ++i) run();
    RangeProfiler& prof = RangeProfiler::instance();
    const bool ranges_on = cfg.profile_ranges || cfg.trace_ranges;
    if (ranges_on) {
      prof.reset();
      // On the GPU the ranges time the queued work with CUDA events. The models built here run on the
      // legacy default stream (nullptr), which orders them with every event recorded on it.
      if (dev == Device::cuda) {
        prof.enable(true, nullptr);
      } else {
        prof.enable(true);
      }
    }
    KernelProfiler& kernels = KernelProfiler::instance();
    if (cfg.profile_kernels) {
      kernels.reset();
      kernels.start();
    }
    std::vector<double> ms;
    for (int i = 0; i < cfg.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      {
        ScopedRange r(rec->pass);
        run();
        model.synchronize();
      }
      ms.push_back(ms_since(t0));
    }
    if (ranges_on) {
      prof.enable(false);
      if (cfg.profile_ranges) rec->range_table = prof.nvtx_sum_table();
      if (cfg.trace_ranges) rec->ranges = prof.instances();
    }
    if (cfg.profile_kernels) {
      kernels.stop();
      rec->kernel_table = kernels.kern_sum_table();
    }
    if (rec->pass == "step") {
      rec->cuda_graph = model.cuda_graph_status();
      if (cfg.progress && !rec->cuda_graph.empty()) {
        cfg.progress(fmt::format("{} {} step: cuda graph {}", rec->model, rec->precision, rec->cuda_graph));
      }
    }
    const Moments m = moments(ms);
    rec->mean_ms = m.mean;
    rec->std_ms = m.stddev;
    rec->median_ms = m.median;
    rec->tokens_per_s = double(cfg.batch * mc.context) / (m.mean / 1e3);
    if (dev == Device::cuda) {
      // MFU counts a train step's FLOPs (forward 1/3, backward 2/3 of them) for the passes it covers.
      const double share = rec->pass == "fwd" ? 1.0 / 3.0 : 1.0;
      rec->mfu = *rec->tokens_per_s * share * train_flops_per_token(mc, mc.context) / kHopperBf16PeakFlops;
      rec->mfu_useful =
          *rec->tokens_per_s * share * useful_train_flops_per_token(mc, mc.context) / kHopperBf16PeakFlops;
    }
    rec->peak_mib = double(memory_stats(dev).peak_bytes - base) / kMiB;
  }
}

}  // namespace

std::vector<LmBenchRecord> run_lm_bench(const LmBenchConfig& cfg) {
  FLASHLM_CHECK(cfg.steps >= 1, "bench: steps must be at least 1, got {}", cfg.steps);
  FLASHLM_CHECK(cfg.warmup >= 0, "bench: warmup must be >= 0, got {}", cfg.warmup);
  FLASHLM_CHECK(cfg.batch >= 1, "bench: batch must be at least 1, got {}", cfg.batch);
  FLASHLM_CHECK_ARG(!cfg.profile_kernels || cfg.device == Device::cuda,
                    "bench: the kernel summary (CUPTI, --profile-kernels) needs --device cuda");
  FLASHLM_CHECK_ARG(cfg.gemm_autotune == 0 || cfg.device == Device::cuda,
                    "bench: gemm_autotune (--gemm-autotune) needs --device cuda");
  FLASHLM_CHECK_ARG(!cfg.options.overlap_grad_norm || cfg.device == Device::cuda,
                    "bench: the gradient norm beside the backward (--overlap-grad-norm) needs --device cuda");
  if (cfg.profile_kernels) {  // fail before any model is built when CUPTI cannot be used
    KernelProfiler::instance().start();
    KernelProfiler::instance().stop();
  }
  for (const auto& p : cfg.passes) {
    FLASHLM_CHECK_ARG(p == "fwd" || p == "fwd-bwd" || p == "step",
                      "bench: unknown pass '{}' (--pass): expected fwd, fwd-bwd or step", p);
  }
#ifdef FLASHLM_WITH_CUDA
  // Process-wide: set for this bench (plans built from here on are timed), restored when it returns.
  struct AutotuneScope {
    int previous = gemm_autotune();
    size_t reported = gemm_autotune_results().size();
    ~AutotuneScope() { set_gemm_autotune(previous); }
  } autotune;
  if (cfg.device == Device::cuda) set_gemm_autotune(cfg.gemm_autotune);
  // The choices the configuration just measured made, one line per GEMM shape.
  const auto report_tuning = [&] {
    const std::vector<GemmTuning> all = gemm_autotune_results();
    for (; autotune.reported < all.size(); ++autotune.reported) {
      const GemmTuning& t = all[autotune.reported];
      if (cfg.progress) {
        cfg.progress(fmt::format("gemm autotune: {}: candidate {} of {}, {:.1f} us (heuristic's first {:.1f} us)",
                                 t.product, t.chosen, t.candidates, t.chosen_ms * 1e3, t.first_ms * 1e3));
      }
    }
  };
#else
  FLASHLM_CHECK_ARG(cfg.gemm_autotune == 0, "bench: gemm_autotune needs a CUDA build");
  const auto report_tuning = [] {};
#endif
  std::vector<LmBenchRecord> records;
  const std::vector<std::string> models =
      cfg.model_config_file.empty() ? cfg.models : std::vector<std::string>{cfg.model_config_file};
  const size_t total = models.size() * cfg.contexts.size() * cfg.precisions.size() * cfg.attention.size();
  size_t done = 0;
  for (const auto& name : models) {
    for (int64_t ctx : cfg.contexts) {
      ModelConfig mc;
      if (cfg.model_config_file.empty()) {
        mc = ModelConfig::named(name, ctx, cfg.vocab);
      } else {
        mc = ModelConfig::from_json_file(cfg.model_config_file);
        mc.context = ctx;
        if (cfg.vocab > 0) mc.vocab = cfg.vocab;
        mc.validate();
      }
      for (const std::string& precision_text : cfg.precisions) {
        DType precision;
        bool bf16_pure, fp8;
        parse_precision(precision_text, precision, bf16_pure, fp8);
        for (AttentionImpl impl : cfg.attention) {
          const size_t first = records.size();
          for (const auto& pass : cfg.passes) {
            LmBenchRecord r;
            r.model = name;
            r.context = ctx;
            r.batch = cfg.batch;
            r.precision = precision_name(precision, bf16_pure, fp8);
            // FP8 names its gradients' format after a comma, as the moments below (compare.py matches "fp8").
            if (fp8) r.precision += fmt::format(", {} gradients", fp8_format_name(cfg.options.fp8_gradients));
            // Rowwise only: tensorwise rows keep the name earlier results were recorded under.
            if (fp8 && cfg.options.fp8_recipe != Fp8Recipe::tensorwise) {
              r.precision += fmt::format(", {}", fp8_recipe_name(cfg.options.fp8_recipe));
            }
            // fp32 masters with bf16 moments: the row says so ("bf16, bf16-sr moments").
            if (!bf16_pure && cfg.options.optimizer_state != OptimizerState::fp32) {
              r.precision += fmt::format(", {} moments", optimizer_state_name(cfg.options.optimizer_state));
            }
            if (cfg.options.grad_dtype != DType::f32) {  // --grad-dtype bf16: "fp8, ..., bf16 weight gradients"
              r.precision += fmt::format(", {} weight gradients", dtype_name(cfg.options.grad_dtype));
            }
            r.attention = std::string(attention_impl_name(impl));
            r.pass = pass;
            r.device = std::string(device_name(cfg.device));
            records.push_back(std::move(r));
          }
          std::vector<LmBenchRecord*> rows;
          for (size_t i = first; i < records.size(); ++i) rows.push_back(&records[i]);
          auto mark = [&](const std::string& status, const std::string& message) {
            for (LmBenchRecord* r : rows) r->status = status, r->message = message;
          };
          if (cfg.device == Device::cpu && (precision != DType::f32 || bf16_pure || fp8)) {
            mark("unsupported", "the CPU engine runs fp32; bf16, fp16, bf16-pure and fp8 are CUDA precisions (fp8 "
                                "on the CPU is an emulation for train, slower than fp32: not benchmarked)");
          } else {
            run_row([&] { measure(cfg, mc, precision, bf16_pure, fp8, impl, rows); }, mark);
          }
          ++done;
          report_tuning();
          if (cfg.progress) {
            std::string line = fmt::format("[{}/{}] {} ctx {} {} {} recompute {}:", done, total, name, ctx,
                                           precision_name(precision, bf16_pure, fp8), attention_impl_name(impl),
                                           rows.front()->recompute);
            for (LmBenchRecord* r : rows) {
              line += r->mean_ms ? fmt::format(" {} {:.1f} ms", r->pass, *r->mean_ms) : fmt::format(" {} {}", r->pass, r->status);
            }
            cfg.progress(line);
          }
        }
      }
    }
  }
  return records;
}

std::string format_lm_bench(const std::vector<LmBenchRecord>& records, ReportFormat format, const LmBenchConfig& cfg) {
  std::vector<nlohmann::json> rows;
  auto opt = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
  for (const auto& r : records) {
    nlohmann::json j = {{"model", r.model},          {"context", r.context},          {"batch", r.batch},
                        {"precision", r.precision},  {"attention", r.attention},      {"pass", r.pass},
                        {"device", r.device},        {"mean_ms", opt(r.mean_ms)},     {"std_ms", opt(r.std_ms)},
                        {"median_ms", opt(r.median_ms)}, {"tokens_per_s", opt(r.tokens_per_s)}, {"mfu", opt(r.mfu)},
                        {"mfu_useful", opt(r.mfu_useful)}, {"recompute", r.recompute},
                        {"plan_mib", opt(r.plan_mib)}, {"peak_mib", opt(r.peak_mib)}, {"status", r.status}};
    if (!r.message.empty()) j["message"] = r.message;
    if (!r.cuda_graph.empty()) j["cuda_graph"] = r.cuda_graph;
    rows.push_back(std::move(j));
  }
  const std::vector<ReportColumn> columns = {
      {"model", "model"},         {"context", "ctx"},       {"batch", "batch"},         {"precision", "precision"},
      {"attention", "attention"}, {"pass", "pass"},         {"mean_ms", "mean ms", 2},  {"std_ms", "± ms", 2},
      {"median_ms", "median ms", 2}, {"tokens_per_s", "tokens/s", 0}, {"mfu", "MFU", 3},
      {"mfu_useful", "useful MFU", 3}, {"recompute", "recompute"}, {"plan_mib", "plan MiB", 1},
      {"peak_mib", "peak MiB", 1}, {"status", "status"}};
  const nlohmann::json meta = {{"tool", "flashlm bench"}, {"device", describe_device(cfg.device)},
                               {"threads", cfg.device == Device::cpu ? cpu_threads() : 0}, {"date", utc_date()},
                               {"warmup", cfg.warmup}, {"steps", cfg.steps}, {"vocab", cfg.vocab}};
  return render_report(rows, columns, format, meta);
}

}  // namespace flashlm
