// Kernel experiment, not part of the library: the LM head + cross-entropy on one GPU, unfused (all
// [tokens, vocab] logits at once, as the models ran it) beside the fused head (model/lm_head.h) at several
// chunk sizes. For each: the forward (loss alone) and the backward (the fused pass recomputes the logits;
// the unfused one reuses the forward's), in ms (median of --reps), and the memory each needed beyond its
// inputs and outputs (the tracked allocator's peak: logits or workspace, row losses). A variant that does
// not fit reports oom. Defaults: the CS336 leaderboard's head (65536 tokens, d 4096, vocab 151936, bf16).
//   lm_head_bench [--tokens N] [--d D] [--vocab V] [--chunks 1024,4096,...] [--reps R] [--format md|csv|json]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/report.h"
#include "core/array_ops.h"
#include "core/cuda_runtime.h"
#include "flashlm/dtype.h"
#include "flashlm/error.h"
#include "flashlm/memory.h"
#include "model/cuda/gemm.h"
#include "model/lm_head.h"
#include "model/cuda/ops.h"

using namespace flashlm;

namespace {

using T = bf16_t;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Inputs {
  int64_t n, d, vocab;
  Buffer h, w, targets, dh, dw;
};

void fill_random_bf16(Buffer& b, int64_t count, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<T> host(static_cast<size_t>(count));
  for (T& x : host) x = T(normal(rng));
  cuda_copy(b.data(), host.data(), size_t(count) * sizeof(T));
}

nlohmann::json run_variant(Inputs& in, int64_t chunk, int reps) {
  const int64_t n = in.n, d = in.d, V = in.vocab;
  nlohmann::json r{{"variant", chunk == 0 ? "unfused" : "fused"}, {"chunk", chunk == 0 ? n : chunk}};
  const T* h = static_cast<const T*>(in.h.data());
  const T* w = static_cast<const T*>(in.w.data());
  const auto* targets = static_cast<const int32_t*>(in.targets.data());
  T* dh = static_cast<T*>(in.dh.data());
  float* dw = static_cast<float*>(in.dw.data());
  const float scale = 1.0f / float(n);
  cuda_synchronize();
  const int64_t base = memory_stats(Device::cuda).current_bytes;
  memory_reset_peak(Device::cuda);
  try {
    Buffer row_loss = Buffer::allocate(size_t(n) * sizeof(float), Device::cuda, "row losses");
    Buffer logits = Buffer::allocate(size_t((chunk == 0 ? n : std::min(chunk, n)) * V) * sizeof(T), Device::cuda,
                                     chunk == 0 ? "logits" : "logits of one chunk");
    T* z = static_cast<T*>(logits.data());
    float* loss = static_cast<float*>(row_loss.data());
    std::function<void()> forward, backward;
    if (chunk == 0) {
      forward = [&] {
        linear_forward_cuda(h, w, z, n, d, V, DType::bf16, nullptr);
        gpu::cross_entropy_forward<T>(z, targets, loss, n, V, nullptr);
      };
      backward = [&] {  // reads the forward's logits: each timed repetition runs the forward first, untimed
        gpu::cross_entropy_backward<T>(z, targets, n, V, scale, nullptr);
        linear_backward_cuda(z, h, w, dh, dw, n, d, V, DType::bf16, false, nullptr);
      };
    } else {
      forward = [&] {
        gpu::lm_head_loss_forward_backward<T>(h, w, targets, n, d, V, chunk, scale, loss, nullptr, nullptr, z, nullptr);
      };
      backward = [&] {
        gpu::lm_head_loss_forward_backward<T>(h, w, targets, n, d, V, chunk, scale, nullptr, dh, dw, z, nullptr);
      };
    }
    forward();  // warm-up: plans, workspaces
    backward();
    r["forward_ms"] = median(cuda_time_each_ms(forward, reps));
    std::vector<double> bwd;
    for (int i = 0; i < reps; ++i) {
      forward();
      bwd.push_back(cuda_time_each_ms(backward, 1)[0]);
    }
    r["backward_ms"] = median(bwd);
    r["total_ms"] = r["forward_ms"].get<double>() + r["backward_ms"].get<double>();
    cuda_synchronize();
    r["extra_gib"] = double(memory_stats(Device::cuda).peak_bytes - base) / double(int64_t{1} << 30);
  } catch (const OutOfMemory&) {
    r["forward_ms"] = "oom";
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The LM head + cross-entropy, unfused beside fused chunk sizes (bf16, one GPU)"};
  int64_t tokens = 65536, d = 4096, vocab = 151936;
  int reps = 5;
  std::vector<int64_t> chunks = {1024, 4096, 8192, 16384};
  std::string format = "md";
  app.add_option("--tokens", tokens, "tokens (batch x sequence)")->check(CLI::Range(int64_t{1}, int64_t{1} << 22));
  app.add_option("--d", d, "d_model (a multiple of 8)")->check(CLI::Range(int64_t{8}, int64_t{65536}));
  app.add_option("--vocab", vocab, "vocabulary (a multiple of 8)")->check(CLI::Range(int64_t{8}, int64_t{1} << 24));
  app.add_option("--chunks", chunks, "fused chunk sizes in tokens")->delimiter(',')->check(CLI::Range(int64_t{1}, int64_t{1} << 22));
  app.add_option("--reps", reps, "timed repetitions")->check(CLI::Range(1, 1000));
  app.add_option("--format", format, "md, csv or json");
  try {
    app.parse(argc, argv);
    if (d % 8 != 0 || vocab % 8 != 0) throw CLI::ValidationError("--d/--vocab", "must be multiples of 8 (bf16 GEMMs)");
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  try {
    const ReportFormat fmt = parse_report_format(format);
    if (cuda_device_count_or_zero() == 0) throw Error("lm_head_bench: no CUDA device visible");
    Inputs in{tokens, d, vocab,
              Buffer::allocate(size_t(tokens * d) * sizeof(T), Device::cuda, "h"),
              Buffer::allocate(size_t(vocab * d) * sizeof(T), Device::cuda, "w"),
              Buffer::allocate(size_t(tokens) * sizeof(int32_t), Device::cuda, "targets"),
              Buffer::allocate(size_t(tokens * d) * sizeof(T), Device::cuda, "dh"),
              Buffer::allocate(size_t(vocab * d) * sizeof(float), Device::cuda, "dw")};
    fill_random_bf16(in.h, tokens * d, 1.0f, 1);
    fill_random_bf16(in.w, vocab * d, 0.02f, 2);
    std::mt19937_64 rng(3);
    std::uniform_int_distribution<int32_t> pick(0, int32_t(vocab - 1));
    std::vector<int32_t> t(static_cast<size_t>(tokens));
    for (int32_t& x : t) x = pick(rng);
    cuda_copy(in.targets.data(), t.data(), t.size() * sizeof(int32_t));
    gpu::memset_async(in.dw.data(), 0, size_t(vocab * d) * sizeof(float), nullptr);

    std::vector<nlohmann::json> rows;
    rows.push_back(run_variant(in, 0, reps));
    for (int64_t c : chunks) rows.push_back(run_variant(in, c, reps));
    const std::vector<ReportColumn> columns = {{"variant", "variant"},       {"chunk", "chunk (tokens)"},
                                               {"forward_ms", "forward ms"}, {"backward_ms", "backward ms"},
                                               {"total_ms", "total ms"},     {"extra_gib", "extra GiB"}};
    const nlohmann::json meta{{"date", utc_date()},  {"device", cuda_device_description()}, {"tokens", tokens},
                              {"d", d},              {"vocab", vocab},                      {"dtype", "bf16"},
                              {"reps", reps}};
    std::fputs(render_report(rows, columns, fmt, meta).c_str(), stdout);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
