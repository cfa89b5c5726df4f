// Checkpoints that must not be trusted (wrong sizes, types, ranges, bits, data, seed), checkpoint paths that
// cannot be written, a loss that turns NaN, and FIFOs where files belong: each a clear flashlm::Error,
// never a crash, a hang or lost work.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "flashlm/train.h"
#include "train/checkpoint.h"
#include "train/checkpoint_bytes.h"

using namespace flashlm;
using flashlm::test::CheckpointBytes;

namespace {

// Small enough that a step takes milliseconds.
TrainConfig small_run(int64_t steps) {
  TrainConfig c;
  c.model = ModelConfig::named("tiny", 16, 64);
  c.model.layers = 1;
  c.batch = 2;
  c.seq = 16;
  c.steps = steps;
  c.eval_every = 0;
  c.eval_batches = 1;
  c.log_every = 0;
  return c;
}

std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (std::filesystem::path(::testing::TempDir()) /
          (std::string("flashlm_ckpt_") + info->name() + "_" + name))
      .string();
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected flashlm::Error";
  return "";
}

void expect_error(const std::function<void()>& call, std::initializer_list<std::string> fragments) {
  const std::string what = error_of(call);
  for (const auto& f : fragments) EXPECT_NE(what.find(f), std::string::npos) << "missing '" << f << "' in: " << what;
}

// A checkpoint of small_run after two steps, and the configuration that resumes it.
struct Saved {
  std::string path;
  TrainConfig resume;
};

Saved saved_checkpoint(const std::string& name) {
  TrainConfig c = small_run(2);
  c.checkpoint = temp_path(name);
  train(c);
  c.steps = 3;
  c.resume = true;
  return {c.checkpoint, c};
}

void write_tokens(const std::string& path, int64_t count, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> t(static_cast<size_t>(count));
  for (auto& x : t) x = static_cast<uint16_t>(rng() % static_cast<uint32_t>(vocab));
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(t.data()),
                                              static_cast<std::streamsize>(t.size() * sizeof(uint16_t)));
}

// Runs `call`, which must throw flashlm::Error naming `fragment`, and must not block: on a FIFO, open()
// without O_NONBLOCK waits for a writer. If it has not returned after a while, the test fails and opens the
// FIFO for writing itself, which releases the blocked open().
void expect_fifo_refused(const std::string& fifo, const std::function<void()>& call) {
  auto done = std::async(std::launch::async, [&] { return error_of(call); });
  if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "blocked on the FIFO " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    if (fd >= 0) ::close(fd);
  }
  const std::string what = done.get();
  EXPECT_NE(what.find(fifo), std::string::npos) << what;
  EXPECT_NE(what.find("not a regular file (a FIFO)"), std::string::npos) << what;
}

}  // namespace

TEST(Checkpoint, ParameterCountMustMatchTheFileAndTheModel) {
  const Saved s = saved_checkpoint("count.ckpt");
  const CheckpointBytes good = CheckpointBytes::read(s.path);
  const int64_t n = good.header["parameter_count"].get<int64_t>();
  ASSERT_EQ(int64_t(good.payload.size()), 3 * n * 4);

  // Claims that do not fit the file: each refused before anything is allocated for them.
  for (const int64_t claim : {n - 1, n + 1, int64_t{1} << 60, int64_t{0}, int64_t{-5}}) {
    SCOPED_TRACE(claim);
    CheckpointBytes c = good;
    c.header["parameter_count"] = claim;
    c.write(s.path);
    expect_error([&] { checkpoint_parameters(s.path); }, {s.path, "'parameter_count'"});
    expect_error([&] { train(s.resume); }, {s.path, "'parameter_count'"});
  }
  // A consistent file of fewer parameters than the model has: the model must not read past its end.
  CheckpointBytes smaller = good;
  smaller.header["parameter_count"] = n - 10;
  smaller.payload.resize(size_t(3 * (n - 10) * 4));
  smaller.write(s.path);
  EXPECT_EQ(checkpoint_parameters(s.path).size(), size_t(n - 10));
  expect_error([&] { train(s.resume); },
               {s.path, "differs from this run in parameter_count", std::to_string(n - 10), std::to_string(n)});
}

TEST(Checkpoint, FieldsOfTheWrongTypeOrRangeNameTheFileAndTheField) {
  const Saved s = saved_checkpoint("fields.ckpt");
  const CheckpointBytes good = CheckpointBytes::read(s.path);
  struct Case {
    std::string pointer;  // JSON pointer of the field
    nlohmann::json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"/next_step", "2", "header field 'next_step' is \"2\", expected an integer"},
      {"/next_step", -3, "header field 'next_step' is -3, expected an integer in [0,"},
      {"/next_step", 2.5, "'next_step' is 2.5"},
      {"/optimizer_steps", 3, "header field 'optimizer_steps' is 3, expected an integer in [0, 2]"},
      {"/optimizer_steps", -1, "'optimizer_steps' is -1"},
      {"/model/d_model", 32.5, "header field 'model.d_model' is 32.5"},
      {"/model/d_model", nullptr, "'model.d_model' is null"},
      {"/model", nlohmann::json::array(), "header field 'model' is [], expected an object"},
      {"/model/rope_theta", -1.0, "'model.rope_theta' is -1.0, expected a finite positive number"},
      {"/seed", -1, "header field 'seed' is -1, expected an integer in [0,"},
      {"/seed", "1234", "'seed' is \"1234\""},
      {"/batch", 0, "'batch' is 0"},
      {"/batch", uint64_t{1} << 63, "'batch' is 9223372036854775808"},
      {"/precision", 32, "'precision' is 32, expected a string"},
      {"/precision", "fp64", "'precision' is \"fp64\", expected \"fp32\", \"bf16\", \"fp16\" or \"bf16-pure\""},
      {"/batcher_step", 5, "'batcher_step' is 5, expected next_step * grad_accum = 2 * 1"},
      {"/batcher_seed", 7, "'batcher_seed' is 7, expected the run's seed 1234"},
      {"/loss_scale", "big", "'loss_scale' is \"big\""},
      {"/train_data/tokens", "many", "'train_data.tokens' is \"many\""},
      {"/train_data/fingerprint", int64_t{1} << 40, "'train_data.fingerprint'"},
      {"/format", 3, "header field 'format' is 3, this flashlm reads format 2"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.pointer + " = " + k.value.dump());
    CheckpointBytes c = good;
    c.header[nlohmann::json::json_pointer(k.pointer)] = k.value;
    c.write(s.path);
    expect_error([&] { train(s.resume); }, {s.path, k.message});
  }
  for (const char* field : {"batch", "next_step", "model", "payload_crc32", "train_data"}) {
    SCOPED_TRACE(field);
    CheckpointBytes c = good;
    c.header.erase(field);
    c.write(s.path, /*fix_payload_crc=*/false);  // the payload's is right already, or is the field missing
    expect_error([&] { train(s.resume); }, {s.path, std::string("the header has no field '") + field + "'"});
  }
  // Sizes that pass each field's range but make no model: the file's fault, so a plain Error naming the file
  // (the CLI's exit 1), never the InvalidArgument of a user's own configuration (exit 2).
  CheckpointBytes no_model = good;
  no_model.header["model"]["heads"] = 3;  // does not divide d_model
  no_model.write(s.path);
  try {
    train(s.resume);
    ADD_FAILURE() << "a header whose model cannot be built was accepted";
  } catch (const InvalidArgument& e) {
    ADD_FAILURE() << "reported as a usage error: " << e.what();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(s.path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the header's model"), std::string::npos) << e.what();
  }
  CheckpointBytes not_object = good;
  not_object.header = nlohmann::json::array({1, 2});
  not_object.write(s.path, /*fix_payload_crc=*/false);
  expect_error([&] { train(s.resume); }, {s.path, "the header is array, expected a JSON object"});
}

// The optimizer state is part of what a checkpoint resumes: another state is refused by name (no silent
// conversion: fp32 moments rounded to bf16 would no longer be the run's), a file written before the field
// existed is fp32 moments, and a bad value names the field.
TEST(Checkpoint, ResumeRefusesAnotherOptimizerState) {
  const Saved s = saved_checkpoint("state.ckpt");  // fp32 moments
  TrainConfig bf16 = s.resume;
  bf16.options.optimizer_state = OptimizerState::bf16;
  expect_error([&] { train(bf16); },
               {s.path, "differs from this run in optimizer_state: the checkpoint has fp32, this run bf16"});
  CheckpointBytes c = CheckpointBytes::read(s.path);
  ASSERT_EQ(c.header.at("optimizer_state"), "fp32");
  CheckpointBytes old = c;
  old.header.erase("optimizer_state");
  old.write(s.path);
  EXPECT_EQ(train(s.resume).last_step, 3);  // as fp32 moments
  expect_error([&] { train(bf16); }, {s.path, "optimizer_state: the checkpoint has fp32, this run bf16"});
  CheckpointBytes bad = c;
  bad.header["optimizer_state"] = "fp8";
  bad.write(s.path);
  expect_error([&] { train(s.resume); },
               {s.path, "'optimizer_state' is \"fp8\", expected \"fp32\", \"bf16\" or \"bf16-sr\""});
  TrainConfig sr = small_run(2);
  sr.options.optimizer_state = OptimizerState::bf16_sr;
  sr.checkpoint = temp_path("sr.ckpt");
  train(sr);
  EXPECT_EQ(CheckpointBytes::read(sr.checkpoint).header.at("optimizer_state"), "bf16-sr");
  TrainConfig plain = sr;
  plain.options.optimizer_state = OptimizerState::fp32;
  plain.steps = 3;
  plain.resume = true;
  expect_error([&] { train(plain); }, {sr.checkpoint, "optimizer_state: the checkpoint has bf16-sr, this run fp32"});
}

TEST(Checkpoint, FlippedBitsAreFound) {
  const Saved s = saved_checkpoint("bits.ckpt");
  std::ifstream in(s.path, std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  // Inside the JSON (from byte 20, after the binary prefix, whose length and CRC bytes may hold a '}'):
  // the model's object closes first.
  const size_t brace = good.find('}', 20);
  ASSERT_NE(brace, std::string::npos);
  const size_t header_end = brace + 1;
  std::mt19937 rng(7);
  for (int i = 0; i < 40; ++i) {
    std::string bad = good;
    // The length field, the header and the payload: every part is covered by a checksum or a size check.
    const size_t at = i < 4 ? 8 + size_t(i) : i < 20 ? 20 + rng() % (header_end - 20) : header_end + rng() % (good.size() - header_end);
    bad[at] = char(bad[at] ^ (1 << (rng() % 8)));
    std::ofstream(s.path, std::ios::binary | std::ios::trunc).write(bad.data(), std::streamsize(bad.size()));
    SCOPED_TRACE(at);
    const std::string what = error_of([&] { train(s.resume); });
    EXPECT_NE(what.find(s.path), std::string::npos) << what;
    EXPECT_TRUE(what.find("corrupt") != std::string::npos) << what;
  }
  // The payload's checksum is checked by itself too, not only through the header's.
  std::ofstream(s.path, std::ios::binary | std::ios::trunc).write(good.data(), std::streamsize(good.size()));
  CheckpointBytes c = CheckpointBytes::read(s.path);
  c.payload[c.payload.size() / 2] ^= 0x10;
  c.write(s.path, /*fix_payload_crc=*/false);
  expect_error([&] { checkpoint_parameters(s.path); },
               {s.path, "is corrupt: the parameters and moments have CRC-32"});
}

TEST(Checkpoint, TheOldFormatIsNamed) {
  const Saved s = saved_checkpoint("old.ckpt");
  CheckpointBytes c = CheckpointBytes::read(s.path);
  c.magic = "FLMCKPT1";
  c.write(s.path);
  expect_error([&] { train(s.resume); }, {s.path, "old format 1"});
}

TEST(Checkpoint, ResumeRefusesAnotherSeedOrDataFile) {
  const std::string a = temp_path("a.bin"), b = temp_path("b.bin");
  write_tokens(a, 5000, 1, 64);
  write_tokens(b, 5000, 2, 64);  // the same size, other tokens (4500 of either train: 10% are held out)
  TrainConfig c = small_run(2);
  c.train_data = a;
  c.checkpoint = temp_path("data.ckpt");
  train(c);
  c.steps = 3;
  c.resume = true;
  TrainConfig other_seed = c;
  other_seed.seed = 99;
  expect_error([&] { train(other_seed); },
               {c.checkpoint, "differs from this run in seed: the checkpoint has 1234, this run 99"});
  TrainConfig other_data = c;
  other_data.train_data = b;
  expect_error([&] { train(other_data); }, {c.checkpoint, "differs from this run in train_data", a, b, "4500 tokens"});
  // The same tokens under another name (a moved file) continue.
  const std::string moved = temp_path("moved.bin");
  std::filesystem::copy_file(a, moved, std::filesystem::copy_options::overwrite_existing);
  TrainConfig renamed = c;
  renamed.train_data = moved;
  EXPECT_EQ(train(renamed).last_step, 3);
}

TEST(Checkpoint, AnUnwritablePathFailsBeforeTheFirstStep) {
  int steps_run = 0;
  auto counting = [&](TrainConfig c) {
    c.log_every = 1;
    c.progress = [&](const std::string& line) { steps_run += line.rfind("step ", 0) == 0; };
    return c;
  };
  TrainConfig c = counting(small_run(3));
  c.checkpoint = temp_path("missing-dir") + "/run.ckpt";
  expect_error([&] { train(c); }, {c.checkpoint, "the directory", "does not exist"});
  EXPECT_EQ(steps_run, 0);

  const std::string dir = temp_path("a-dir");
  std::filesystem::create_directories(dir);
  c.checkpoint = dir;
  expect_error([&] { train(c); }, {dir, "is a directory"});
  EXPECT_EQ(steps_run, 0);
  EXPECT_FALSE(std::filesystem::exists(dir + ".tmp")) << "a stray temporary";

  // A good path is left with the checkpoint and its lock alone.
  c.checkpoint = temp_path("fine.ckpt");
  train(c);
  EXPECT_GT(steps_run, 0);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(c.checkpoint).parent_path())) {
    if (e.path().filename().string().starts_with(std::filesystem::path(c.checkpoint).filename().string()))
      names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  const std::string base = std::filesystem::path(c.checkpoint).filename().string();
  EXPECT_EQ(names, (std::vector<std::string>{base, base + ".lock"}));
}

// Each writer has a temporary of its own: what another writer (or a killed one) left at PATH.tmp, even a
// directory, is not in the way; and a run owns its path: a second run on it is refused, naming the first.
TEST(Checkpoint, ARunOwnsItsPathAndWritesATemporaryOfItsOwn) {
  TrainConfig c = small_run(2);
  c.checkpoint = temp_path("owned.ckpt");
  std::filesystem::create_directories(c.checkpoint + ".tmp");
  train(c);
  EXPECT_TRUE(std::filesystem::is_regular_file(c.checkpoint));

  // A temporary of a writer that is gone (a child that has exited) is removed by the next run on the path;
  // one of a live process (this one) is left alone.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const std::string stale = c.checkpoint + ".tmp." + std::to_string(child) + ".0123456789abcdef";
  const std::string live = c.checkpoint + ".tmp." + std::to_string(::getpid()) + ".0123456789abcdef";
  std::ofstream(stale) << "half a checkpoint";
  std::ofstream(live) << "half a checkpoint";
  {
    const CheckpointLock held = check_checkpoint_writable(c.checkpoint);
    EXPECT_FALSE(std::filesystem::exists(stale));
    EXPECT_TRUE(std::filesystem::exists(live));
    // While it is held, another run on the path does not start.
    expect_error([&] { train(c); }, {c.checkpoint, "is in use by another run (process " + std::to_string(::getpid()),
                                     c.checkpoint + ".lock"});
    expect_error([&] { (void)check_checkpoint_writable(c.checkpoint); }, {"in use by another run"});
  }
  std::filesystem::remove(live);
  // Released, the path is free again.
  train(c);
}

TEST(Checkpoint, ANonFiniteLossStopsTheRunAndKeepsTheLastGoodCheckpoint) {
  // A learning rate this large overflows the parameters within a few steps.
  TrainConfig c = small_run(30);
  c.optimizer.lr_max = c.optimizer.lr_min = 1e4;
  c.optimizer.warmup_steps = 0;
  c.optimizer.max_grad_norm = 0;
  c.checkpoint = temp_path("nan.ckpt");
  c.checkpoint_every = 1;
  const std::string what = error_of([&] { train(c); });
  EXPECT_NE(what.find("train: the loss is"), std::string::npos) << what;
  EXPECT_NE(what.find("(fp32): stopping"), std::string::npos) << what;
  int bad_step = 0, kept_step = 0;
  ASSERT_EQ(std::sscanf(what.c_str() + what.find(" at step "), " at step %d", &bad_step), 1) << what;
  ASSERT_EQ(std::sscanf(what.c_str() + what.find("keeps the parameters after step "), "keeps the parameters after step %d",
                        &kept_step),
            1)
      << what;
  EXPECT_LT(bad_step, 30);
  EXPECT_EQ(kept_step, bad_step - 1);
  const CheckpointBytes kept = CheckpointBytes::read(c.checkpoint);
  EXPECT_EQ(kept.header["next_step"], kept_step);
  for (float p : checkpoint_parameters(c.checkpoint)) ASSERT_TRUE(std::isfinite(p));
}

TEST(Checkpoint, FifosAreRefusedWithoutBlocking) {
  const std::string fifo = temp_path("fifo");
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  TrainConfig c = small_run(1);
  c.train_data = fifo;
  expect_fifo_refused(fifo, [&] { train(c); });
  c = small_run(1);
  c.val_data = fifo;
  expect_fifo_refused(fifo, [&] { train(c); });
  c = small_run(1);
  c.checkpoint = fifo;
  c.resume = true;
  expect_fifo_refused(fifo, [&] { train(c); });
  expect_fifo_refused(fifo, [&] { checkpoint_parameters(fifo); });
  c.resume = false;  // and not written through either
  expect_error([&] { train(c); }, {fifo, "not a regular file"});
  ::unlink(fifo.c_str());
}

// A shard of a sharded checkpoint records its run's settings (train.cpp's resume_identity), which a resume
// must repeat: each rank reads its own file, and a shard of a run that differed only in, say, the learning
// rate passes every other check. The settings survive the file; another value, or one recorded on one side
// only, is refused by name, but for those a resume may change (--steps, and the cosine's length that follows
// it); files written before the field existed, and whole checkpoints, are not checked.
TEST(Checkpoint, AShardMustBeOfARunWithTheSameSettings) {
  CheckpointHeader h;
  h.model = ModelConfig::named("tiny", 16, 64);
  h.batch = 2;
  h.seq = 16;
  h.seed = 7;
  h.batcher.seed = 7;
  h.train_data = {"synthetic", 100, 1};
  h.parameter_count = 4;
  h.world_size = 2;
  h.shard_rank = 1;
  h.shard_elements = 2;
  h.run_settings = {{"optimizer.lr_max", "0.002"}, {"optimizer.cosine_steps", "6"}, {"seed", "7"}};
  const std::string path = temp_path("shard.ckpt");
  const std::vector<float> payload(2, 0.5f);
  write_checkpoint(path, h, payload, payload, payload);
  const CheckpointHeader saved = CheckpointReader(path).header();
  ASSERT_EQ(saved.run_settings.size(), 3u);
  CheckpointHeader run = h;
  run.shard_rank = -1;
  run.shard_elements = 0;
  std::reverse(run.run_settings.begin(), run.run_settings.end());  // by name, not by position
  EXPECT_NO_THROW(check_resumable(path, saved, run));
  run.run_settings[2].value = "0.003";
  expect_error([&] { check_resumable(path, saved, run); },
               {path, "this shard was written by a run with a different configuration: optimizer.lr_max is 0.002 "
                      "there, 0.003 in this run"});
  run.run_settings[2].value = "0.002";
  run.run_settings.push_back({"zero1", "false"});
  expect_error([&] { check_resumable(path, saved, run); }, {"zero1 is not recorded there, false in this run"});
  run.run_settings.pop_back();
  run.run_settings[1].value = "12";  // another --steps without --cosine-steps: a resume may extend the run
  run.run_settings.push_back({"steps", "12"});
  EXPECT_NO_THROW(check_resumable(path, saved, run));
  CheckpointHeader old = saved;
  old.run_settings.clear();
  EXPECT_NO_THROW(check_resumable(path, old, run));
  CheckpointHeader whole = saved;
  whole.shard_rank = -1;
  EXPECT_NO_THROW(check_resumable(path, whole, run));

  // Malformed: refused without the value in the message.
  const CheckpointBytes good = CheckpointBytes::read(path);
  CheckpointBytes not_object = good;
  not_object.header["run_settings"] = nlohmann::json::array({"seed"});
  not_object.write(path);
  expect_error([&] { CheckpointReader{path}; }, {path, "header field 'run_settings'", "expected an object of strings"});
  CheckpointBytes nested = good;
  nested.header["run_settings"]["seed"] = nlohmann::json::object({{"deep", std::string(1000, 'x')}});
  nested.write(path);
  const std::string what = error_of([&] { CheckpointReader{path}; });
  EXPECT_NE(what.find("header field 'run_settings' holds a value that is not a string"), std::string::npos) << what;
  EXPECT_EQ(what.find("xxxx"), std::string::npos) << what;
}
