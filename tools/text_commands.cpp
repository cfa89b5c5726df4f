#include "text_commands.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "cli_common.h"
#include "python_helper.h"
#include "flashlm/device.h"
#include "flashlm/error.h"
#include "flashlm/generate.h"
#include "flashlm/safetensors.h"
#include "flashlm/text.h"
#include "flashlm/train.h"

namespace {

void add_prepare(CLI::App& app, TextCommandArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "prepare", "Turn text files into the token files train --data reads: OUT/train.bin, OUT/val.bin and "
                 "OUT/tokenizer.json (byte-level tokens, vocabulary 256; or a BPE trained on the text)");
  cmd->add_option("inputs", a.inputs, "Text files, concatenated in order")->required();
  cmd->add_option("--out", a.out_dir, "Output directory (created with its parents if missing)")->required();
  cmd->add_option("--val-fraction", a.val_fraction, "The last part of the tokens held out for validation, in (0, 0.5]")
      ->capture_default_str()
      ->check(in_range(1e-9, 0.5));
  cmd->add_option("--tokenizer", a.tokenizer_kind,
                  "byte: one token per byte, nothing to install; bpe: a byte-level BPE of --vocab-size tokens trained "
                  "on the text by scripts/prepare_data.py (the `tokenizers` package: FLASHLM_PYTHON=$(scripts/"
                  "setup-tokenizers.sh))")
      ->capture_default_str()
      ->check(CLI::IsMember({"byte", "bpe"}));
  cmd->add_option("--vocab-size", a.vocab_size,
                  "BPE vocabulary size (ids above 65535 are stored as uint32, in llm.c's LLaMA-3 token format)")
      ->check(in_range(int64_t{256}, int64_t{1} << 20));
}

void add_generate(CLI::App& app, TextCommandArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "generate", "Sample text from a trained model (a train checkpoint or an exported .safetensors) on the CPU "
                  "or CUDA (--device), with a KV cache");
  cmd->add_option("--checkpoint", a.weights, "train --checkpoint file or flashlm export's .safetensors")->required();
  cmd->add_option("--prompt", a.prompts,
                  "Text the sample continues (at least one token); repeat it for a batch of different prompts")
      ->required()
      ->allow_extra_args(false);
  cmd->add_option("--max-tokens", a.max_tokens,
                  "Tokens to generate (past the model's context, each is drawn from the last context tokens)")
      ->capture_default_str()
      ->check(in_range(int64_t{0}, int64_t{1} << 24));
  cmd->add_option("--temperature", a.temperature, "Softmax temperature; 0: greedy")
      ->capture_default_str()
      ->check(in_range(0.0, 100.0));
  cmd->add_option("--top-k", a.top_k, "Sample among the K most likely tokens; 0: all")
      ->capture_default_str()
      ->check(in_range(int64_t{0}, int64_t{1} << 31));
  cmd->add_option("--seed", a.seed, "Seed of the draws: the same seed gives the same text")
      ->capture_default_str()
      ->check(in_range(uint64_t{0}, uint64_t{INT64_MAX}));
  cmd->add_option("--tokenizer", a.tokenizer,
                  "tokenizer.json that prepare wrote beside the data (default: byte-level, for a vocabulary of 256)");
  cmd->add_option("--device", a.device,
                  "cpu (default) or cuda: where the decoder runs (see --kv-cache)");
  cmd->add_option("--batch", a.batch,
                  "Sequences decoded together, a multiple of the prompts given: N / prompts samples of each, sequence b "
                  "drawing with seed + b (default: one per prompt)")
      ->check(in_range(int64_t{1}, int64_t{65535}));
  cmd->add_option("--kv-cache", a.kv_cache,
                  "paged: one pool of KV-cache pages for the batch (bf16 on cuda, fp32 on cpu); contiguous: the "
                  "one-sequence fp32 decoder; auto: paged for a batch or on cuda where the model fits it, else contiguous")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "paged", "contiguous"}));
  cmd->add_option("--page-size", a.page_size,
                  "Positions per page of the paged KV cache: a multiple of 16 in [16, 256] (not with the contiguous "
                  "decoder)")
      ->default_str("256")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            int64_t n = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
            if (ec != std::errc() || end != v.data() + v.size() || n < 16 || n > 256 || n % 16 != 0) {
              return "'" + v + "': expected a multiple of 16 in [16, 256]";
            }
            return {};
          },
          "multiple of 16 in [16, 256]"));
  cmd->add_option("--cuda-graph", a.cuda_graph,
                  "cuda, paged KV cache: on: each decoding step is one CUDA graph per number of sequences stepped "
                  "(captured after that number's first step, then replayed); off: every kernel launched from the "
                  "host. The tokens and logits are bit-identical")
      ->default_str("on")
      ->check(CLI::IsMember({"on", "off"}));
  add_threads_option(cmd, a.threads);
  cmd->add_option("--logits-out", a.logits_out,
                  "Also write the logits each new token was drawn from: max-tokens x batch x vocab fp32, "
                  "little-endian");
}

void add_export(CLI::App& app, TextCommandArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "export", "Write a checkpoint's weights as safetensors with the CS336 PyTorch model's state_dict names "
                "(torch: model.load_state_dict(safetensors.torch.load_file(OUT)))");
  cmd->add_option("checkpoint", a.export_from, "train --checkpoint file")->required();
  cmd->add_option("out", a.export_to, "The .safetensors file to write")->required();
}

// How long scripts/prepare_data.py may take: generous for a slow machine, and growing with the corpus that
// it trains and encodes, so that only a helper that hangs meets it.
double prepare_timeout_s(uint64_t input_bytes) { return 600.0 + 60.0 * static_cast<double>(input_bytes) / 10e6; }
constexpr double kEncodeTimeoutS = 600;  // loading a tokenizer.json and encoding one prompt

int run_prepare_bpe(const TextCommandArgs& a) {
  // The byte path's rule, checked here before the script opens anything.
  const uint64_t input_bytes = flashlm::check_prepare_inputs(a.inputs);
  std::vector<std::string> args = {"prepare", "--out", a.out_dir, "--vocab-size", std::to_string(a.vocab_size),
                                   "--val-fraction", fmt::format("{}", a.val_fraction)};
  args.insert(args.end(), a.inputs.begin(), a.inputs.end());
  const std::string reply = run_prepare_data_script(args, prepare_timeout_s(input_bytes));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(reply);
    fmt::print("{}: {} tokens\n{}: {} tokens\n{}: byte-level BPE, vocabulary {} ({} token files)\n",
               j.at("train").get<std::string>(), j.at("train_tokens").get<int64_t>(), j.at("val").get<std::string>(),
               j.at("val_tokens").get<int64_t>(), j.at("tokenizer").get<std::string>(),
               j.at("vocab_size").get<int64_t>(), j.at("token_dtype").get<std::string>());
    fmt::print("train with: flashlm train --data {} --val-data {} --vocab {}\n", j.at("train").get<std::string>(),
               j.at("val").get<std::string>(), j.at("vocab_size").get<int64_t>());
  } catch (const nlohmann::json::exception&) {
    throw flashlm::Error(fmt::format("prepare: scripts/prepare_data.py replied '{}', expected one JSON line", reply));
  }
  return 0;
}

int run_prepare(const TextCommandArgs& a) {
  if (a.tokenizer_kind == "bpe") {
    if (a.vocab_size == 0) throw CLI::ValidationError("--vocab-size", "--tokenizer bpe needs a vocabulary size");
    return run_prepare_bpe(a);
  }
  if (a.vocab_size != 0) {
    throw CLI::ValidationError("--vocab-size", "the byte-level tokenizer's vocabulary is 256: --vocab-size is for "
                                               "--tokenizer bpe");
  }
  flashlm::PrepareConfig cfg;
  cfg.inputs = a.inputs;
  cfg.out_dir = a.out_dir;
  cfg.val_fraction = a.val_fraction;
  const flashlm::PreparedData d = flashlm::prepare_text_data(cfg);
  fmt::print("{}: {} tokens\n{}: {} tokens\n{}: byte-level, vocabulary {}\n", d.train_path, d.train_tokens,
             d.val_path, d.val_tokens, d.tokenizer_path, flashlm::Tokenizer::kByteVocab);
  fmt::print("train with: flashlm train --data {} --val-data {} --vocab {}\n", d.train_path, d.val_path,
             flashlm::Tokenizer::kByteVocab);
  return 0;
}

// The prompt's tokens: the byte-level tokenizer's own, or a BPE's through the package that trained it.
std::vector<int32_t> encode_prompt(const flashlm::Tokenizer& tokenizer, const std::string& tokenizer_path,
                                   const std::string& prompt) {
  if (!tokenizer.is_bpe()) return tokenizer.encode(prompt);
  // The `tokenizers` package encodes text: bytes that are not UTF-8 have no tokens there.
  if (const size_t bad = flashlm::invalid_utf8_at(prompt); bad != std::string::npos)
    throw CLI::ValidationError("--prompt", fmt::format("byte {} is not valid UTF-8: a BPE encodes text", bad));
  const std::string reply = run_prepare_data_script({"encode", "--tokenizer", tokenizer_path, prompt}, kEncodeTimeoutS);
  std::vector<int32_t> ids;
  size_t at = 0;
  while (at < reply.size()) {
    while (at < reply.size() && std::isspace(static_cast<unsigned char>(reply[at]))) ++at;
    if (at == reply.size()) break;
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(reply.data() + at, reply.data() + reply.size(), id);
    if (ec != std::errc() || id < 0 || id >= tokenizer.vocab_size()) {
      throw flashlm::Error(fmt::format("generate: scripts/prepare_data.py encode replied '{}', expected token ids in "
                                       "[0, {})",
                                       reply.substr(at, 40), tokenizer.vocab_size()));
    }
    ids.push_back(static_cast<int32_t>(id));
    at = static_cast<size_t>(end - reply.data());
  }
  return ids;
}

// The summary line of a run: tokens per second over the batch.
void print_generate_summary(int64_t sequences, int64_t new_tokens, int64_t prompt_tokens, double prefill_s,
                            double decode_s) {
  const double total = static_cast<double>(sequences * new_tokens);
  const auto rate = [](double tokens, double s) { return s > 0 ? tokens / s : 0.0; };
  std::string line = fmt::format("generate: {} sequence{} x {} new tokens in {:.3f} s: {:.1f} tokens/s", sequences,
                                 sequences == 1 ? "" : "s", new_tokens, prefill_s + decode_s,
                                 rate(total, prefill_s + decode_s));
  if (new_tokens > 1) {  // each step after the prompts' gives every sequence one token
    line += fmt::format("; decoding {:.1f} tokens/s ({} steps, {:.2f} ms/step)",
                        rate(static_cast<double>(sequences * (new_tokens - 1)), decode_s), new_tokens - 1,
                        1e3 * decode_s / static_cast<double>(new_tokens - 1));
  }
  line += fmt::format("; prompts {} tokens in {:.3f} s\n", prompt_tokens, prefill_s);
  fmt::print(stderr, "{}", line);
}

int run_generate(const TextCommandArgs& a) {
  using namespace flashlm;
  if (!a.device.empty() && a.device != "cpu" && a.device != "cuda") {
    throw CLI::ValidationError("--device", fmt::format("'{}': expected cpu or cuda", a.device));
  }
  const Device device = a.device == "cuda" ? Device::cuda : Device::cpu;
  if (device == Device::cuda && cuda_device_count() == 0) {
    throw CLI::ValidationError("--device", cuda_built() ? "cuda: no CUDA device is visible"
                                                        : "cuda: this flashlm was built without CUDA");
  }
  const auto n_prompts = static_cast<int64_t>(a.prompts.size());
  const int64_t batch = a.batch == 0 ? n_prompts : a.batch;
  if (batch % n_prompts != 0) {
    throw CLI::ValidationError("--batch", fmt::format("{} is not a multiple of the {} prompts given: each prompt gets "
                                                      "batch / prompts sequences",
                                                      batch, n_prompts));
  }
  if (a.kv_cache == "contiguous" && batch > 1) {
    throw CLI::ValidationError("--kv-cache", fmt::format("contiguous decodes one sequence; a batch of {} needs "
                                                         "--kv-cache paged (or auto)",
                                                         batch));
  }
  if (a.threads > 0) set_cpu_threads(a.threads);
  const Tokenizer tokenizer = a.tokenizer.empty() ? Tokenizer::bytes() : Tokenizer::load(a.tokenizer);
  const ModelWeights weights = load_model_weights(a.weights);
  const ModelConfig& config = weights.config;
  if (config.vocab != tokenizer.vocab_size()) {
    throw CLI::ValidationError(
        "--tokenizer", fmt::format("the model's vocabulary is {}, the {} tokenizer's {}: give the tokenizer.json of "
                                   "the data it was trained on",
                                   config.vocab, tokenizer.name(), tokenizer.vocab_size()));
  }
  std::string why;
  const bool fits = paged_decoder_supports(config, device, &why);
  // auto: the paged decoder wherever it is the faster or the only one: for a batch, and on cuda where the model
  // fits its kernels (bf16: 1315 against the fp32 decoder's 1025 tokens/s at batch 1, small model, one H100).
  // One sequence on the cpu, or of a head_dim without a CUDA decoding kernel, keeps the contiguous decoder.
  const bool paged =
      a.kv_cache == "paged" || (a.kv_cache == "auto" && (batch > 1 || (device == Device::cuda && fits)));
  if (!a.cuda_graph.empty() && !(paged && device == Device::cuda)) {
    throw CLI::ValidationError("--cuda-graph", fmt::format("'{}': the CUDA graph is the paged decoder's on cuda; this "
                                                           "run decodes with the {} decoder on {}",
                                                           a.cuda_graph, paged ? "paged" : "contiguous",
                                                           device_name(device)));
  }
  if (a.page_size != 0 && !paged) {
    throw CLI::ValidationError("--page-size", fmt::format("{}: pages are the paged decoder's; this run decodes one "
                                                          "sequence with the contiguous decoder",
                                                          a.page_size));
  }
  const int64_t page_size = a.page_size == 0 ? 256 : a.page_size;
  if (paged && !fits) {
    throw CLI::ValidationError(a.kv_cache == "paged" ? "--kv-cache" : "--batch",
                               fmt::format("the paged decoder on {}: {}", device_name(device), why));
  }
  // The prompts' tokens, sequence b taking prompt b / (batch / prompts).
  std::vector<std::vector<int32_t>> prompt_tokens;
  for (const std::string& text : a.prompts) {
    prompt_tokens.push_back(encode_prompt(tokenizer, a.tokenizer, text));
    if (prompt_tokens.back().empty()) {
      throw CLI::ValidationError("--prompt", "the prompt is empty: give at least one character");
    }
  }
  std::vector<std::vector<int32_t>> sequences;
  for (int64_t b = 0; b < batch; ++b) sequences.push_back(prompt_tokens[size_t(b / (batch / n_prompts))]);

  // Under a temporary name until the run ends: a run that fails leaves an older file of that name as it was.
  std::optional<OutputFile> logits_file;
  if (!a.logits_out.empty()) logits_file.emplace(a.logits_out);
  const int64_t pages = paged ? paged_pool_pages(config, sequences, a.max_tokens, page_size) : 0;
  const std::string cache =
      paged ? fmt::format("paged KV cache ({}, batch {}, {} pages of {})", device == Device::cuda ? "bf16" : "fp32",
                          batch, pages, page_size)
            : std::string("contiguous KV cache (fp32)");
  fmt::print(stderr, "generate: {} parameters ({} layers, d_model {}, context {}) from {} on {}, {}; temperature {}, "
             "top-k {}, seed {}\n",
             weights.params.size(), config.layers, config.d_model, config.context, a.weights, device_name(device),
             cache, a.temperature, a.top_k, a.seed);
  SamplingOptions sampling;
  sampling.temperature = a.temperature;
  sampling.top_k = a.top_k;
  sampling.seed = a.seed;
  const auto write_text = [&](std::span<const int32_t> tokens) {
    const std::string text = tokenizer.decode(tokens);
    std::fwrite(text.data(), 1, text.size(), stdout);
  };
  if (!paged) {
    KvCacheDecoder decoder(config, weights.params, device);
    // The prompt as its tokens decode: for a BPE, proof that the encoding round-trips (byte-level BPEs are
    // lossless), for the byte-level tokenizer the prompt itself.
    write_text(prompt_tokens[0]);
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    auto t1 = t0;
    bool first = true;
    generate_tokens(decoder, prompt_tokens[0], a.max_tokens, sampling,
                    [&](int32_t token, std::span<const float> logits) {
      if (std::exchange(first, false)) t1 = clock::now();
      write_text(std::span(&token, 1));
      std::fflush(stdout);
      if (logits_file) logits_file->write(logits.data(), logits.size_bytes());
    });
    const auto t2 = clock::now();
    std::fputc('\n', stdout);
    std::fflush(stdout);
    const int64_t window = std::min<int64_t>(int64_t(prompt_tokens[0].size()), config.context);
    print_generate_summary(1, a.max_tokens, window, std::chrono::duration<double>(t1 - t0).count(),
                           std::chrono::duration<double>(t2 - t1).count());
  } else {
    PagedDecoderOptions options;
    options.batch = batch;
    options.page_size = page_size;
    options.num_pages = pages;
    options.cuda_graph = a.cuda_graph != "off";
    PagedKvDecoder decoder(config, weights.params, device, options);
    // One sequence streams its text as it comes; a batch prints each sequence once all are done.
    if (batch == 1) write_text(sequences[0]);
    const BatchGeneration out =
        generate_batch(decoder, sequences, a.max_tokens, sampling,
                       [&](int64_t, int32_t token, std::span<const float> logits) {
          if (batch == 1) {
            write_text(std::span(&token, 1));
            std::fflush(stdout);
          }
          if (logits_file) logits_file->write(logits.data(), logits.size_bytes());
        });
    for (int64_t b = 0; b < batch; ++b) {
      if (batch > 1) {
        fmt::print("--- sequence {} (prompt {}, seed {}) ---\n", b, b / (batch / n_prompts), a.seed + uint64_t(b));
        std::fflush(stdout);
        write_text(sequences[size_t(b)]);
        write_text(out.tokens[size_t(b)]);
      }
      std::fputc('\n', stdout);
      if (batch == 1) break;
    }
    std::fflush(stdout);
    print_generate_summary(batch, a.max_tokens, out.prompt_tokens, out.prefill_seconds, out.decode_seconds);
    if (device == Device::cuda) fmt::print(stderr, "generate: cuda graph {}\n", decoder.cuda_graph_status());
  }
  if (logits_file) logits_file->commit();
  return 0;
}

int run_export(const TextCommandArgs& a) {
  const flashlm::ModelWeights w = flashlm::load_model_weights(a.export_from);
  flashlm::write_safetensors(a.export_to, w.config, w.params);
  fmt::print("{}: {} tensors, {} parameters (fp32), CS336 state_dict names\n", a.export_to,
             flashlm::parameter_layout(w.config).size(), w.params.size());
  return 0;
}

}  // namespace

void add_text_commands(CLI::App& app, TextCommandArgs& a) {
  add_prepare(app, a);
  add_generate(app, a);
  add_export(app, a);
}

int run_text_command(const CLI::App& app, const TextCommandArgs& a) {
  if (app.got_subcommand("prepare")) return run_prepare(a);
  if (app.got_subcommand("generate")) return run_generate(a);
  if (app.got_subcommand("export")) return run_export(a);
  return -1;
}
