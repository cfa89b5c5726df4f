// flashlm attention-bench: attention forward and backward timed over a grid of shapes (run_attention_bench).
#include <charconv>

#include "cli_common.h"
#include "flashlm/attention.h"
#include "flashlm/device.h"

namespace {

struct AttentionBenchArgs {
  flashlm::AttentionBenchConfig cfg;
  std::string impl = "naive,flash", dtype = "fp32", d = "64", seq = "1024,2048,4096", batch = "1", heads = "1";
  std::string causal = "0", align = "top-left", device, grid, window;
  int threads = 0;
  int64_t kv_heads = 0;
  bool forward_only = false;
  ReportOptions report;
  CLI::Option* grid_option = nullptr;
  // --decode: flash_attention_with_kvcache over a paged cache (run_decode_bench), with its own defaults for the
  // shape options it shares (given ones replace them).
  bool decode = false;
  std::string cache = "4096,16384,65536,131072";
  int64_t page_size = 256, nq = 1;
  double peak_gbps = 4800;
  CLI::Option *dtype_option = nullptr, *d_option = nullptr, *batch_option = nullptr, *heads_option = nullptr,
              *kv_heads_option = nullptr, *causal_option = nullptr;
};

int run_decode(AttentionBenchArgs& a) {
  using namespace flashlm;
  DecodeBenchConfig cfg;
  const auto given = [](const CLI::Option* o) { return o->count() > 0; };
  const auto single = [](const char* name, const std::vector<int64_t>& v) {
    if (v.size() != 1) throw InvalidArgument(fmt::format("{}: --decode takes one value, got {}", name, v.size()));
    return v[0];
  };
  if (given(a.dtype_option)) cfg.dtype = parse_dtype(a.dtype);
  if (given(a.d_option)) cfg.head_dim = single("--d", parse_list<int64_t>("--d", a.d, positive_up_to(kMaxHeadDim)));
  if (given(a.batch_option)) cfg.batches = parse_list<int64_t>("--batch", a.batch, positive_up_to(kMaxBatch));
  if (given(a.heads_option)) cfg.heads = single("--heads", parse_list<int64_t>("--heads", a.heads, positive_up_to(kMaxHeads)));
  if (given(a.kv_heads_option)) cfg.kv_heads = a.kv_heads;
  else if (given(a.heads_option)) cfg.kv_heads = cfg.heads;
  if (given(a.causal_option)) cfg.causal = single("--causal", parse_list<int64_t>("--causal", a.causal, [](const std::string& s) {
                                                    return int64_t{parse_bool(s)};
                                                  })) != 0;
  cfg.cache_lens = parse_list<int64_t>("--cache", a.cache, positive_up_to(kMaxSeq));
  cfg.page_size = a.page_size;
  cfg.nq = a.nq;
  cfg.peak_gbps = a.peak_gbps;
  cfg.warmup = a.cfg.warmup;
  cfg.reps = a.cfg.reps;
  cfg.device = device_or_default(a.device);
  report_format(a.report);
  require_usable_device(cfg.device);
  if (a.threads > 0) set_cpu_threads(a.threads);
  if (!a.report.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  const auto records = run_decode_bench(cfg);
  emit_report([&](ReportFormat f) { return format_decode_bench(records, f, cfg); }, a.report);
  return 0;
}

int run(AttentionBenchArgs& a) {
  using namespace flashlm;
  if (a.decode) return run_decode(a);
  AttentionBenchConfig& cfg = a.cfg;
  cfg.impls = parse_list<AttentionImpl>("--impl", a.impl, [](const std::string& s) { return parse_attention_impl(s); });
  cfg.dtypes = parse_list<DType>("--dtype", a.dtype, [](const std::string& s) { return parse_dtype(s); });
  if (a.grid_option->count() > 0) {
    cfg.shapes = attention_named_grid(a.grid);
  } else {
    cfg.shapes = attention_shape_grid(parse_list<int64_t>("--d", a.d, positive_up_to(kMaxHeadDim)),
                                      parse_list<int64_t>("--seq", a.seq, positive_up_to(kMaxSeq)),
                                      parse_list<int64_t>("--batch", a.batch, positive_up_to(kMaxBatch)),
                                      parse_list<int64_t>("--heads", a.heads, positive_up_to(kMaxHeads)),
                                      parse_list<bool>("--causal", a.causal, parse_bool));
  }
  for (AttentionShape& shape : cfg.shapes) {
    if (a.kv_heads != 0 && shape.heads % a.kv_heads != 0) {
      throw InvalidArgument(fmt::format("--kv-heads: {} does not divide the head count {}", a.kv_heads, shape.heads));
    }
    shape.kv_heads = a.kv_heads;
  }
  cfg.align = parse_causal_align(a.align);
  if (!a.window.empty()) {
    // L,R: flash-attn's window_size, -1 leaving a side unbounded.
    const auto sides = parse_list<int64_t>("--window", a.window, [](const std::string& x) {
      int64_t w = 0;
      const auto [end, ec] = std::from_chars(x.data(), x.data() + x.size(), w);
      if (ec != std::errc() || end != x.data() + x.size() || w < -1 || w > kMaxSeq) {
        throw InvalidArgument(fmt::format("'{}' is not -1 or a number of keys from 0 to {}", x, kMaxSeq));
      }
      return w;
    });
    if (sides.size() != 2) throw InvalidArgument(fmt::format("--window: expected L,R (two numbers), got '{}'", a.window));
    cfg.window_left = sides[0];
    cfg.window_right = sides[1];
  }
  cfg.device = device_or_default(a.device);
  report_format(a.report);  // a bad --format is refused before the sweep
  require_usable_device(cfg.device);
  if (a.threads > 0) set_cpu_threads(a.threads);
  cfg.backward = !a.forward_only;
  if (!a.report.quiet) cfg.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };

  const auto records = run_attention_bench(cfg);
  emit_report([&](ReportFormat f) { return format_attention_bench(records, f, cfg); }, a.report);
  // The tables follow the md table on stdout (json and csv keep them in their records).
  const bool md_on_stdout = !a.report.out.empty() || report_format(a.report) == ReportFormat::md;
  for (const auto& r : records) {
    if (!md_on_stdout) break;
    for (const auto& [pass, table] : {std::pair{"forward", &r.fwd_kernel_table}, {"backward", &r.bwd_kernel_table}}) {
      if (table->empty()) continue;
      fmt::print("\n** CUDA GPU kernel summary (cuda_gpu_kern_sum): {} {} b={} h={}/{} n={} d={}/{} causal={}, {} {} "
                 "calls\n{}",
                 r.impl, r.dtype, r.batch, r.heads, r.kv_heads, r.seq_q, r.head_dim, r.head_dim_v, int(r.causal),
                 cfg.reps, pass, *table);
    }
  }
  return 0;
}

}  // namespace

Command add_attention_bench_command(CLI::App& app) {
  auto a = std::make_shared<AttentionBenchArgs>();
  CLI::App* cmd = app.add_subcommand("attention-bench", "Time attention forward and backward over a grid of shapes");
  auto* impl = cmd->add_option("--impl", a->impl, "Implementations, comma list of naive,flash")->capture_default_str();
  a->dtype_option = cmd->add_option("--dtype", a->dtype,
                  "Element types, comma list of fp32,fp64,fp16,bf16,fp8 (fp8: e4m3 inputs, bf16 output, forward only, "
                  "sm_90 GPUs)")
      ->capture_default_str();
  auto* d = cmd->add_option("--d", a->d, "Head dimensions, comma list")->capture_default_str();
  auto* seq = cmd->add_option("--seq", a->seq, "Sequence lengths (queries = keys), comma list")->capture_default_str();
  auto* batch = cmd->add_option("--batch", a->batch, "Batch sizes, comma list")->capture_default_str();
  auto* heads = cmd->add_option("--heads", a->heads, "Head counts, comma list")->capture_default_str();
  auto* causal = cmd->add_flag("--causal{1}", a->causal,
                               "Causal mask: bare --causal means causal only; --causal=0,1 runs both")
                     ->capture_default_str();
  a->grid_option = cmd->add_option("--grid", a->grid,
                                   "A named set of shapes instead of --d/--seq/--batch/--heads/--causal: 'fa' (16k "
                                   "tokens per batch, heads*d = 2048, d 64,128, seq 512..16384, causal and not) or "
                                   "'seed' (batch 8, one head, d 16..128, seq 256..32768, causal)")
                       ->excludes(d)
                       ->excludes(seq)
                       ->excludes(batch)
                       ->excludes(heads)
                       ->excludes(causal);
  a->kv_heads_option = cmd->add_option("--kv-heads", a->kv_heads,
                                       "Key/value heads for GQA/MQA, dividing every head count (default: the head "
                                       "count)")
                           ->check(CLI::PositiveNumber);
  a->d_option = d, a->batch_option = batch, a->heads_option = heads, a->causal_option = causal;
  auto* decode = cmd->add_flag("--decode", a->decode,
                               "Time decoding over a paged KV cache (flash_attention_with_kvcache, no append): batch x "
                               "--cache, with the defaults --batch 1,16,64 --heads 32 --kv-heads 8 --d 128 --dtype "
                               "bf16 --causal, printing ms, GB/s of K and V read and % of --peak-gbps");
  cmd->add_option("--cache", a->cache, "With --decode: cache lengths (keys per sequence), comma list")
      ->capture_default_str()
      ->needs(decode);
  cmd->add_option("--page-size", a->page_size, "With --decode: rows per page (a multiple of 16 in [16, 256])")
      ->capture_default_str()
      ->check(in_range<int64_t>(16, 256))
      ->needs(decode);
  cmd->add_option("--nq", a->nq, "With --decode: queries per sequence")
      ->capture_default_str()
      ->check(in_range<int64_t>(1, 1024))
      ->needs(decode);
  cmd->add_option("--peak-gbps", a->peak_gbps, "With --decode: the bandwidth limit the % column divides by (GB/s)")
      ->capture_default_str()
      ->check(in_range(1.0, 1e7))
      ->needs(decode);
  decode->excludes(a->grid_option);
  auto* deterministic = cmd->add_flag("--deterministic", a->cfg.deterministic,
                                      "Backward without atomics, bit-reproducible (CUDA: a separate dQ pass instead "
                                      "of fp32 atomics in the dK/dV kernel)");
  auto* align = cmd->add_option("--causal-align", a->align, "top-left (PyTorch is_causal) or bottom-right")
                    ->capture_default_str();
  auto* window = cmd->add_option("--window", a->window,
                                 "Sliding window L,R (flash-attn's window_size: query i sees keys i-L..i+R, -1 "
                                 "unbounded; causal makes R 0); TFLOP/s then count the visible pairs");
  cmd->add_option("--d-v", a->cfg.head_dim_v,
                  "v's and o's head dim for every row (head_dim_v: e.g. --d 192 --d-v 128, DeepSeek's MLA shape); 0: "
                  "each row's --d")
      ->capture_default_str()
      ->check(in_range<int64_t>(0, kMaxHeadDim))
      ->excludes(decode);
  auto* softcap = cmd->add_option("--softcap", a->cfg.softcap,
                                   "Soft-capping of the scores, softcap * tanh(s / softcap) (0: off)")
                       ->capture_default_str()
                       ->check(in_range(0.0, 1e30));
  cmd->add_option("--device", a->device, "cpu or cuda (default: cuda if a GPU is visible)");
  cmd->add_option("--warmup", a->cfg.warmup, "Untimed runs before timing")
      ->capture_default_str()
      ->check(in_range(0, kMaxReps));
  cmd->add_option("--reps", a->cfg.reps, "Timed runs; the median is reported")
      ->capture_default_str()
      ->check(in_range(1, kMaxReps));
  add_threads_option(cmd, a->threads);
  auto* cpu_max_flops =
      cmd->add_option("--cpu-max-flops", a->cfg.cpu_max_flops,
                      "On the CPU, skip (status 'skipped') a row whose runs would compute more FLOPs than this")
          ->capture_default_str()
          ->check(in_range(1.0, 1e30));
  auto* forward_only = cmd->add_flag("--forward-only", a->forward_only, "Skip the backward pass");
  cmd->add_flag("--profile-kernels", a->cfg.profile_kernels,
                "After the table, each row's cuda_gpu_kern_sum table (nsys stats format, from CUPTI) of --reps more "
                "calls of each pass, run after the timed ones (--device cuda)")
      ->excludes(decode);
  // What --decode does not use is refused beside it rather than ignored (its cache lengths are --cache).
  for (CLI::Option* o : {impl, seq, deterministic, align, window, softcap, cpu_max_flops, forward_only}) {
    decode->excludes(o);
  }
  add_report_options(cmd, a->report);
  return {cmd, [a] { return run(*a); }};
}
