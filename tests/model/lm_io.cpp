// Test harness for the PyTorch comparison (tests/python/test_lm_vs_torch.py): reads a model, weights and
// a batch from a binary file, runs forward + backward and a few AdamW steps on the CPU, writes logits,
// loss, gradients and the losses of the steps. All little-endian, see the Python test for the layout.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <vector>

#include "flashlm/model.h"

namespace {

template <class T>
T read(std::ifstream& in) {
  T x{};
  in.read(reinterpret_cast<char*>(&x), sizeof x);
  return x;
}

template <class T>
void read_into(std::ifstream& in, T* dst, size_t n) {
  in.read(reinterpret_cast<char*>(dst), std::streamsize(n * sizeof(T)));
}

template <class T>
void write(std::ofstream& out, const T* src, size_t n) {
  out.write(reinterpret_cast<const char*>(src), std::streamsize(n * sizeof(T)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: lm_io INPUT OUTPUT\n";
    return 2;
  }
  try {
    std::ifstream in(argv[1], std::ios::binary);
    flashlm::ModelConfig c;
    c.vocab = read<int64_t>(in);
    c.context = read<int64_t>(in);
    c.d_model = read<int64_t>(in);
    c.d_ff = read<int64_t>(in);
    c.layers = read<int64_t>(in);
    c.heads = read<int64_t>(in);
    const int64_t batch = read<int64_t>(in), seq = read<int64_t>(in), steps = read<int64_t>(in);
    c.rope_theta = read<double>(in);
    c.norm_eps = read<double>(in);
    flashlm::AdamWConfig opt;
    const double lr = read<double>(in);
    opt.beta1 = read<double>(in);
    opt.beta2 = read<double>(in);
    opt.eps = read<double>(in);
    opt.weight_decay = read<double>(in);
    opt.max_grad_norm = read<double>(in);
    std::vector<int32_t> tokens(size_t(batch * seq)), targets(size_t(batch * seq));
    read_into(in, tokens.data(), tokens.size());
    read_into(in, targets.data(), targets.size());
    flashlm::CpuModel model(c, batch, seq);
    read_into(in, model.parameters(), size_t(model.parameter_count()));
    if (!in) throw flashlm::Error("lm_io: input file is truncated");

    std::ofstream out(argv[2], std::ios::binary);
    const double loss = model.forward(tokens.data(), targets.data());
    std::vector<float> logits(size_t(batch * seq * c.vocab));
    model.copy_logits_to(logits.data());
    write(out, logits.data(), logits.size());
    write(out, &loss, 1);
    model.zero_grad();
    model.backward();
    write(out, model.gradients(), size_t(model.parameter_count()));
    for (int64_t s = 0; s < steps; ++s) {
      if (s > 0) {
        const double l = model.forward(tokens.data(), targets.data());
        write(out, &l, 1);
        model.zero_grad();
        model.backward();
      } else {
        write(out, &loss, 1);
      }
      model.clip_gradients(opt.max_grad_norm);
      model.adamw_step(opt, lr);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
