// The commands that take a user from text to a model and back: `prepare` (text files -> token files and
// tokenizer), `generate` (a sample from a checkpoint) and `export` (a checkpoint -> safetensors).
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

struct TextCommandArgs {
  // prepare
  std::vector<std::string> inputs;
  std::string out_dir;
  double val_fraction = 0.1;
  std::string tokenizer_kind = "byte";  // byte or bpe
  int64_t vocab_size = 0;               // bpe only
  // generate
  std::string weights, tokenizer, device, logits_out;
  std::vector<std::string> prompts;  // --prompt, repeatable
  int64_t max_tokens = 200, top_k = 0;
  int64_t batch = 0;        // sequences decoded together; 0: one per prompt
  int64_t page_size = 0;    // positions per page of the paged KV cache; 0: not given, 256
  std::string kv_cache = "auto";  // auto | paged | contiguous
  std::string cuda_graph;         // --cuda-graph on|off (the paged decoder on cuda); "": not given, on
  int threads = 0;
  double temperature = 0.8;
  uint64_t seed = 0;
  // export
  std::string export_from, export_to;
};

void add_text_commands(CLI::App& app, TextCommandArgs& a);

// Runs the text command that was parsed and returns its exit code, or -1 when none of them was. Usage
// errors are CLI::ValidationError (exit 2 in main), runtime errors flashlm::Error.
int run_text_command(const CLI::App& app, const TextCommandArgs& a);
