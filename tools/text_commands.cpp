#include "text_commands.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>

#include "cli_options.h"
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
  cmd->add_option("--prompt", a.prompt, "Text the sample continues (at least one token)")->required();
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
  cmd->add_option("--device", a.device, "cpu (default) or cuda: where the KV-cache decoder runs (fp32 on both)");
  add_threads_option(cmd, a.threads);
  cmd->add_option("--logits-out", a.logits_out,
                  "Also write the logits each new token was drawn from: max-tokens x vocab fp32, little-endian");
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

void write_floats(std::FILE* f, const std::string& path, std::span<const float> values) {
  if (std::fwrite(values.data(), sizeof(float), values.size(), f) != values.size()) {
    throw flashlm::Error(fmt::format("generate: failed writing '{}'", path));
  }
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
  if (a.threads > 0) set_cpu_threads(a.threads);
  const Tokenizer tokenizer = a.tokenizer.empty() ? Tokenizer::bytes() : Tokenizer::load(a.tokenizer);
  const ModelWeights weights = load_model_weights(a.weights);
  if (weights.config.vocab != tokenizer.vocab_size()) {
    throw CLI::ValidationError(
        "--tokenizer", fmt::format("the model's vocabulary is {}, the {} tokenizer's {}: give the tokenizer.json of "
                                   "the data it was trained on",
                                   weights.config.vocab, tokenizer.name(), tokenizer.vocab_size()));
  }
  const std::vector<int32_t> prompt = encode_prompt(tokenizer, a.tokenizer, a.prompt);
  if (prompt.empty()) throw CLI::ValidationError("--prompt", "the prompt is empty: give at least one character");
  std::FILE* logits_file = nullptr;
  if (!a.logits_out.empty()) {
    logits_file = std::fopen(a.logits_out.c_str(), "wb");
    if (!logits_file) throw Error(fmt::format("generate: cannot open '{}' for writing", a.logits_out));
  }
  fmt::print(stderr, "generate: {} parameters ({} layers, d_model {}, context {}) from {} on {}; temperature {}, "
             "top-k {}, seed {}\n",
             weights.params.size(), weights.config.layers, weights.config.d_model, weights.config.context, a.weights,
             device_name(device), a.temperature, a.top_k, a.seed);
  KvCacheDecoder decoder(weights.config, weights.params, device);
  SamplingOptions sampling;
  sampling.temperature = a.temperature;
  sampling.top_k = a.top_k;
  sampling.seed = a.seed;
  // The prompt as its tokens decode: for a BPE, proof that the encoding round-trips (byte-level BPEs are
  // lossless), for the byte-level tokenizer the prompt itself.
  const std::string echoed = tokenizer.decode(prompt);
  std::fwrite(echoed.data(), 1, echoed.size(), stdout);
  try {
    generate_tokens(decoder, prompt, a.max_tokens, sampling, [&](int32_t token, std::span<const float> logits) {
      const std::string text = tokenizer.decode(std::span(&token, 1));
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      if (logits_file) write_floats(logits_file, a.logits_out, logits);
    });
  } catch (...) {
    if (logits_file) std::fclose(logits_file);
    throw;
  }
  std::fputc('\n', stdout);
  if (logits_file && std::fclose(logits_file) != 0) {
    throw Error(fmt::format("generate: failed writing '{}'", a.logits_out));
  }
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
