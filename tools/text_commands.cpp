#include "text_commands.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <span>

#include "cli_options.h"
#include "flashlm/device.h"
#include "flashlm/error.h"
#include "flashlm/generate.h"
#include "flashlm/safetensors.h"
#include "flashlm/text.h"
#include "flashlm/train.h"

namespace {

void add_prepare(CLI::App& app, TextCommandArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "prepare", "Turn text files into the token files train --data reads (byte-level tokens, vocabulary 256): "
                 "OUT/train.bin, OUT/val.bin and OUT/tokenizer.json");
  cmd->add_option("inputs", a.inputs, "Text files, concatenated in order")->required();
  cmd->add_option("--out", a.out_dir, "Output directory (must exist)")->required();
  cmd->add_option("--val-fraction", a.val_fraction, "The last part of the tokens held out for validation, in (0, 0.5]")
      ->capture_default_str()
      ->check(in_range(1e-9, 0.5));
}

void add_generate(CLI::App& app, TextCommandArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "generate", "Sample text from a trained model (a train checkpoint or an exported .safetensors) on the CPU, "
                  "with a KV cache");
  cmd->add_option("--checkpoint", a.weights, "train --checkpoint file or flashlm export's .safetensors")->required();
  cmd->add_option("--prompt", a.prompt, "Text the sample continues (at least one token)")->required();
  cmd->add_option("--max-tokens", a.max_tokens, "Tokens to generate")->capture_default_str()->check(in_range(int64_t{0}, int64_t{1} << 24));
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
  cmd->add_option("--device", a.device, "cpu (the decoder runs on the CPU)");
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

int run_prepare(const TextCommandArgs& a) {
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

void write_floats(std::FILE* f, const std::string& path, std::span<const float> values) {
  if (std::fwrite(values.data(), sizeof(float), values.size(), f) != values.size()) {
    throw flashlm::Error(fmt::format("generate: failed writing '{}'", path));
  }
}

int run_generate(const TextCommandArgs& a) {
  using namespace flashlm;
  if (!a.device.empty() && a.device != "cpu") {
    throw CLI::ValidationError("--device", fmt::format("'{}': generate runs on the CPU only (its KV-cache decoder has "
                                                       "no CUDA kernels yet); use --device cpu",
                                                       a.device));
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
  const std::vector<int32_t> prompt = tokenizer.encode(a.prompt);
  if (prompt.empty()) throw CLI::ValidationError("--prompt", "the prompt is empty: give at least one character");
  const int64_t room = weights.config.context - static_cast<int64_t>(prompt.size());
  if (a.max_tokens > room) {
    throw CLI::ValidationError("--max-tokens", fmt::format("{} after a prompt of {} tokens exceeds the model's context "
                                                           "of {}: at most {}",
                                                           a.max_tokens, prompt.size(), weights.config.context,
                                                           std::max<int64_t>(room, 0)));
  }
  std::FILE* logits_file = nullptr;
  if (!a.logits_out.empty()) {
    logits_file = std::fopen(a.logits_out.c_str(), "wb");
    if (!logits_file) throw Error(fmt::format("generate: cannot open '{}' for writing", a.logits_out));
  }
  fmt::print(stderr, "generate: {} parameters ({} layers, d_model {}, context {}) from {}; temperature {}, top-k {}, "
             "seed {}\n",
             weights.params.size(), weights.config.layers, weights.config.d_model, weights.config.context, a.weights,
             a.temperature, a.top_k, a.seed);
  KvCacheDecoder decoder(weights.config, weights.params);
  SamplingOptions sampling;
  sampling.temperature = a.temperature;
  sampling.top_k = a.top_k;
  sampling.seed = a.seed;
  std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
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
