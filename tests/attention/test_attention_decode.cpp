// flash_attention_with_kvcache (decoding over a paged or contiguous KV cache) against an fp64 oracle computed
// by attention_forward (naive) on the gathered cache: on the CPU, and, where a GPU is visible, the CUDA
// split-KV kernels. Pages lie out of order in the block table (unused entries are -1, which must never be
// read), the last page is partly filled, sequences of one batch have different lengths (0 and 1 included),
// outputs are poisoned with NaN, and the cache bytes are checked after the in-place append.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_testing.h"
#include "attention/backends.h"
#include "attention/decode_split.h"
#include "core/cuda_runtime.h"
#include "flashlm/attention.h"
#include "flashlm/memory.h"
#include "gpu_testing.h"

using namespace flashlm;
using namespace flashlm::testing;

namespace {

struct KvCase {
  int64_t batch = 0, nq = 0, hq = 0, hk = 0, d = 0;
  int64_t page_size = 0;        // 0: the non-paged cache [batch, max_seq, hk, d]
  std::vector<int32_t> lens{};  // cache_seqlens, before the append
  int64_t seq_new = 0;        // 0: no k_new / v_new
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  DType dtype = DType::f32;
  bool with_lse = true;
  std::optional<double> scale{};
};

std::string kv_name(const KvCase& c) {
  std::string lens;
  for (auto l : c.lens) lens += fmt::format("{}{}", lens.empty() ? "" : ",", l);
  return fmt::format("b{}_nq{}_h{}x{}_d{}_{}_lens[{}]_new{}{}_win({},{})_cap{}_{}{}", c.batch, c.nq, c.hq, c.hk, c.d,
                     c.page_size > 0 ? fmt::format("page{}", c.page_size) : std::string("flat"), lens, c.seq_new,
                     c.causal ? "_causal" : "", c.window_left, c.window_right, c.softcap, dtype_name(c.dtype),
                     c.with_lse ? "" : "_nolse");
}

// One call's host tensors: the cache (pages shuffled through the block table), q, the new rows, poisoned
// outputs.
struct KvFixture {
  KvCase c;
  int64_t max_pages = 0, num_pages = 0, rows_per_page = 0;
  Tensor q, k_cache, v_cache, k_new, v_new, o, lse;
  std::vector<int32_t> block_table;

  KvFixture(const KvCase& kc, uint64_t seed) : c(kc) {
    const int64_t longest = *std::max_element(c.lens.begin(), c.lens.end()) + c.seq_new;
    if (c.page_size > 0) {
      rows_per_page = c.page_size;
      max_pages = (longest + c.page_size - 1) / c.page_size + 1;  // one spare column (-1, never read)
      num_pages = c.batch * max_pages + 3;                        // and pages nobody uses
      std::vector<int32_t> pages(static_cast<size_t>(num_pages));
      std::iota(pages.begin(), pages.end(), 0);
      std::mt19937 rng(static_cast<uint32_t>(seed));
      std::shuffle(pages.begin(), pages.end(), rng);
      block_table.assign(static_cast<size_t>(c.batch * max_pages), -1);
      size_t next = 0;
      for (int64_t b = 0; b < c.batch; ++b) {
        const int64_t used = (c.lens[static_cast<size_t>(b)] + c.seq_new + c.page_size - 1) / c.page_size;
        for (int64_t i = 0; i < used; ++i) block_table[static_cast<size_t>(b * max_pages + i)] = pages[next++];
      }
      k_cache = Tensor::empty({num_pages, c.page_size, c.hk, c.d}, c.dtype);
      v_cache = Tensor::empty({num_pages, c.page_size, c.hk, c.d}, c.dtype);
    } else {
      rows_per_page = longest + 5;
      k_cache = Tensor::empty({c.batch, rows_per_page, c.hk, c.d}, c.dtype);
      v_cache = Tensor::empty({c.batch, rows_per_page, c.hk, c.d}, c.dtype);
    }
    q = Tensor::empty({c.batch, c.nq, c.hq, c.d}, c.dtype);
    o = Tensor::empty({c.batch, c.nq, c.hq, c.d}, c.dtype);
    lse = Tensor::empty({c.batch, c.hq, c.nq}, c.dtype == DType::f64 ? DType::f64 : DType::f32);
    fill_normal(q.view(), seed + 1);
    fill_normal(k_cache.view(), seed + 2);
    fill_normal(v_cache.view(), seed + 3);
    if (c.seq_new > 0) {
      k_new = Tensor::empty({c.batch, c.seq_new, c.hk, c.d}, c.dtype);
      v_new = Tensor::empty({c.batch, c.seq_new, c.hk, c.d}, c.dtype);
      fill_normal(k_new.view(), seed + 4);
      fill_normal(v_new.view(), seed + 5);
    }
    fill_value(o.view(), std::numeric_limits<double>::quiet_NaN());
    fill_value(lse.view(), std::numeric_limits<double>::quiet_NaN());
  }

  // Page and row of key j of sequence b.
  std::pair<int64_t, int64_t> locate(int64_t b, int64_t j) const {
    if (c.page_size == 0) return {b, j};
    return {block_table[static_cast<size_t>(b * max_pages + j / c.page_size)], j % c.page_size};
  }
  static TensorView cache_rows(const TensorView& cache, int64_t page, int64_t row) {
    return cache.slice(0, page, page + 1).slice(1, row, row + 1);  // [1, 1, hk, d]
  }

  KvCacheIndex index(const int32_t* seqlens, const int32_t* table) const {
    KvCacheIndex ix;
    ix.cache_seqlens = seqlens;
    if (c.page_size > 0) {
      ix.block_table = table;
      ix.max_pages = max_pages;
    }
    return ix;
  }
  AttentionOptions options() const {
    AttentionOptions opt;
    opt.causal = c.causal;
    opt.window_size_left = c.window_left;
    opt.window_size_right = c.window_right;
    opt.softcap = c.softcap;
    opt.scale = c.scale;
    return opt;
  }
  TensorView lse_arg() const { return c.with_lse ? lse.view() : TensorView{}; }

  // The cache as it must be after the append: the new rows at positions lens[b] .. lens[b] + seq_new - 1.
  Tensor expected_cache(const Tensor& cache, const Tensor& rows) const {
    const TensorView& v = cache.view();
    Tensor out = Tensor::empty(std::span<const int64_t>(v.sizes.data(), 4), v.dtype);
    copy_into(out.view(), v);
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t t = 0; t < c.seq_new; ++t) {
        const auto [page, row] = locate(b, c.lens[static_cast<size_t>(b)] + t);
        copy_into(cache_rows(out.view(), page, row), rows.view().slice(0, b, b + 1).slice(1, t, t + 1));
      }
    }
    return out;
  }

  // attention_forward (naive) per sequence on the gathered keys (the cache before the append, then the new
  // rows), in `dtype` (fp64: the oracle; c.dtype: the low-precision naive attention of the tolerance rule).
  void reference(DType dtype, Tensor& o_ref, Tensor& lse_ref) const {
    o_ref = Tensor::empty({c.batch, c.nq, c.hq, c.d}, dtype);
    lse_ref = Tensor::empty({c.batch, c.hq, c.nq}, dtype == DType::f64 ? DType::f64 : DType::f32);
    AttentionOptions opt = options();
    opt.impl = AttentionImpl::naive;
    opt.align = CausalAlign::bottom_right;
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t len = c.lens[static_cast<size_t>(b)], total = len + c.seq_new;
      Tensor kb = Tensor::empty({1, total, c.hk, c.d}, dtype), vb = Tensor::empty({1, total, c.hk, c.d}, dtype);
      for (int64_t j = 0; j < total; ++j) {
        if (j < len) {
          const auto [page, row] = locate(b, j);
          copy_into(kb.view().slice(1, j, j + 1), cache_rows(k_cache.view(), page, row));
          copy_into(vb.view().slice(1, j, j + 1), cache_rows(v_cache.view(), page, row));
        } else {
          copy_into(kb.view().slice(1, j, j + 1), k_new.view().slice(0, b, b + 1).slice(1, j - len, j - len + 1));
          copy_into(vb.view().slice(1, j, j + 1), v_new.view().slice(0, b, b + 1).slice(1, j - len, j - len + 1));
        }
      }
      Tensor qb = Tensor::empty({1, c.nq, c.hq, c.d}, dtype);
      copy_into(qb.view(), q.view().slice(0, b, b + 1));
      attention_forward(qb.view(), kb.view(), vb.view(), o_ref.view().slice(0, b, b + 1),
                        lse_ref.view().slice(0, b, b + 1), opt);
    }
  }
};

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// o within the tolerance rule of the other attention tests (fp16/bf16: twice the naive low-precision
// attention's error plus 1e-3), lse within 1e-4 (fp64: 1e-10) where finite and -inf exactly where the
// oracle's is; never NaN.
void expect_matches_reference(const KvFixture& f, const Tensor& o, const Tensor& lse, const std::string& what) {
  Tensor o_ref, lse_ref, o_lowp, lse_lowp;
  f.reference(DType::f64, o_ref, lse_ref);
  double lowp_err = 0;
  if (f.c.dtype == DType::f16 || f.c.dtype == DType::bf16) {
    f.reference(f.c.dtype, o_lowp, lse_lowp);
    lowp_err = max_abs_diff(o_lowp.view(), o_ref.view());
  }
  const double err = max_abs_diff(o.view(), o_ref.view());
  EXPECT_LE(err, tolerance(f.c.dtype, lowp_err, max_abs(o_ref.view()))) << "o of " << what;
  if (!f.c.with_lse) return;
  Tensor got = to_f64(lse.view()), want = to_f64(lse_ref.view());
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double a = got.view().ptr<double>()[i], b = want.view().ptr<double>()[i];
    if (std::isinf(b)) EXPECT_EQ(a, b) << "lse[" << i << "] of " << what;
    else EXPECT_NEAR(a, b, f.c.dtype == DType::f64 ? 1e-10 : 1e-4) << "lse[" << i << "] of " << what;
  }
}

void run_cpu_and_check(const KvCase& c, uint64_t seed = 7) {
  KvFixture f(c, seed);
  const Tensor k_expected = f.c.seq_new > 0 ? f.expected_cache(f.k_cache, f.k_new) : Tensor();
  const Tensor v_expected = f.c.seq_new > 0 ? f.expected_cache(f.v_cache, f.v_new) : Tensor();
  KvFixture before(c, seed);  // the same values: the oracle gathers the cache before the append
  flash_attention_with_kvcache(f.q.view(), f.k_cache.view(), f.v_cache.view(),
                               f.index(f.c.lens.data(), f.block_table.data()),
                               c.seq_new > 0 ? f.k_new.view() : TensorView{},
                               c.seq_new > 0 ? f.v_new.view() : TensorView{}, f.o.view(), f.lse_arg(), f.options());
  expect_matches_reference(before, f.o, f.lse, kv_name(c));
  if (c.seq_new > 0) {
    EXPECT_TRUE(same_bytes(f.k_cache, k_expected)) << "k_cache after the append of " << kv_name(c);
    EXPECT_TRUE(same_bytes(f.v_cache, v_expected)) << "v_cache after the append of " << kv_name(c);
  }
}

// The grid of cases both backends run (the CUDA ones at the kernels' head dims and 16-bit dtypes).
std::vector<KvCase> common_cases(int64_t d, DType dt) {
  std::vector<KvCase> cases;
  auto add = [&](KvCase c) {
    c.d = d;
    c.dtype = dt;
    cases.push_back(c);
  };
  // Many pages out of order, partly filled last pages, a length 0 and a length 1.
  add({.batch = 4, .nq = 1, .hq = 8, .hk = 2, .page_size = 16, .lens = {37, 0, 100, 1}});
  add({.batch = 4, .nq = 1, .hq = 8, .hk = 2, .page_size = 16, .lens = {37, 0, 100, 1}, .causal = true});
  // The append: a page filled exactly, a new page begun, an empty sequence gaining its first key.
  add({.batch = 4, .nq = 1, .hq = 4, .hk = 4, .page_size = 16, .lens = {15, 16, 47, 0}, .seq_new = 1, .causal = true});
  // Several queries per sequence (speculative decoding), appended together, GQA 8, bottom-right causal.
  add({.batch = 3, .nq = 4, .hq = 8, .hk = 1, .page_size = 32, .lens = {70, 3, 0}, .seq_new = 4, .causal = true});
  add({.batch = 2, .nq = 16, .hq = 2, .hk = 2, .page_size = 48, .lens = {0, 200}, .seq_new = 16, .causal = true});
  add({.batch = 2, .nq = 16, .hq = 8, .hk = 2, .page_size = 16, .lens = {5, 129}, .seq_new = 16, .causal = true});
  // More queries than keys: the first queries see none (o = 0, lse = -inf).
  add({.batch = 3, .nq = 3, .hq = 4, .hk = 1, .page_size = 16, .lens = {1, 2, 0}, .causal = true});
  // Non-causal with more queries than appended rows.
  add({.batch = 2, .nq = 5, .hq = 4, .hk = 1, .page_size = 64, .lens = {90, 31}, .seq_new = 2});
  // Sliding windows (causal, and two-sided without causal) and soft-capping.
  add({.batch = 3, .nq = 2, .hq = 8, .hk = 2, .page_size = 16, .lens = {300, 10, 64}, .seq_new = 2, .causal = true,
       .window_left = 20});
  add({.batch = 2, .nq = 4, .hq = 4, .hk = 4, .page_size = 32, .lens = {150, 9}, .window_left = 10,
       .window_right = 5});
  add({.batch = 2, .nq = 1, .hq = 8, .hk = 2, .page_size = 256, .lens = {600, 255}, .seq_new = 1, .causal = true,
       .softcap = 2.0});
  add({.batch = 2, .nq = 3, .hq = 8, .hk = 1, .page_size = 16, .lens = {77, 40}, .seq_new = 3, .causal = true,
       .window_left = 8, .softcap = 1.5, .scale = 0.3});
  // The non-paged cache, without lse.
  add({.batch = 3, .nq = 1, .hq = 8, .hk = 2, .page_size = 0, .lens = {50, 7, 0}, .seq_new = 2, .causal = true});
  add({.batch = 2, .nq = 2, .hq = 4, .hk = 4, .page_size = 0, .lens = {33, 1}, .with_lse = false});
  add({.batch = 2, .nq = 1, .hq = 4, .hk = 1, .page_size = 80, .lens = {400, 79}, .seq_new = 1, .causal = true,
       .with_lse = false});
  return cases;
}

TEST(AttentionDecode, CpuMatchesTheOracleOnTheGatheredCache) {
  for (DType dt : {DType::f32, DType::f64}) {
    for (const KvCase& c : common_cases(dt == DType::f32 ? 64 : 16, dt)) run_cpu_and_check(c);
  }
}

TEST(AttentionDecode, CpuMatchesTheOracleIn16BitTypes) {
  for (DType dt : {DType::bf16, DType::f16}) {
    const auto cases = common_cases(32, dt);
    for (size_t i = 0; i < cases.size(); i += 2) run_cpu_and_check(cases[i]);
  }
}

TEST(AttentionDecode, CpuAppendWithoutQueriesOnlyWritesTheCache) {
  KvCase c{.batch = 2, .nq = 0, .hq = 4, .hk = 2, .d = 8, .page_size = 16, .lens = {3, 16}, .seq_new = 2};
  run_cpu_and_check(c);
}

// ---- The CUDA split kernel's arithmetic (host code, checked without a GPU) -------------------------------

// decode_split_range: tiles start at multiples of the tile; every key of [lo, hi) belongs to exactly one split,
// and the splits' tiles hold their keys with less than a tile to spare; near the int32 limit too.
TEST(AttentionDecode, SplitRangesCoverTheVisibleKeysOnce) {
  constexpr int n = kDecodeTileKeys;
  const int big = std::numeric_limits<int32_t>::max();
  const std::vector<std::pair<int, int>> spans = {{0, 0},      {0, 1},       {0, 63},      {0, 64},
                                                  {0, 65},     {5, 5},       {37, 200},    {64, 128},
                                                  {100, 16421}, {15904, 20008}, {0, 131072}, {big - 1000, big},
                                                  {big - 64, big}, {0, big}};
  for (const auto& [lo, hi] : spans) {
    for (int splits : {1, 2, 3, 7, 32, 33, 127, 128}) {
      int64_t next = lo, tiles = 0;  // the splits are in key order: split s starts where s - 1 ended
      for (int s = 0; s < splits; ++s) {
        const DecodeSplitRange r = decode_split_range(lo, hi, splits, s);
        const std::string what = fmt::format("[{}, {}) in {} splits, split {}", lo, hi, splits, s);
        if (r.tiles == 0) {
          EXPECT_EQ(r.first, r.end) << what;
          continue;
        }
        EXPECT_EQ(r.begin % n, 0) << what;
        EXPECT_EQ(r.first, next) << what;
        EXPECT_LT(r.first, r.end) << what;
        EXPECT_LE(r.begin, r.first) << what;
        EXPECT_LT(r.first - r.begin, n) << what;
        EXPECT_GE(int64_t{r.begin} + int64_t{r.tiles} * n, r.end) << what;
        EXPECT_LT(int64_t{r.begin} + int64_t{r.tiles - 1} * n, r.end) << what;
        next = r.end;
        tiles += r.tiles;
      }
      EXPECT_EQ(next, hi) << "[" << lo << ", " << hi << ") in " << splits << " splits";
      EXPECT_LE(tiles, (int64_t{hi} - lo + n - 1) / n + 1) << "tiles read";
    }
  }
}

// kvcache_num_splits at the decoding benchmark's shapes (8 key/value heads, one row chunk) on a GPU of 264 block
// slots (132 SMs x 2): whole waves, the fewest splits that fill them, one split where the batch fills the GPU.
TEST(AttentionDecode, SplitCountsFillTheGpuInWholeWaves) {
  EXPECT_EQ(kvcache_num_splits(16384, 8, 264), 32);
  EXPECT_EQ(kvcache_num_splits(131072, 8, 264), 32);
  EXPECT_EQ(kvcache_num_splits(4096, 8, 264), 32);
  EXPECT_EQ(kvcache_num_splits(16384, 8 * 16, 264), 2);
  EXPECT_EQ(kvcache_num_splits(131072, 8 * 16, 264), 2);
  EXPECT_EQ(kvcache_num_splits(16384, 8 * 32, 264), 1);
  EXPECT_EQ(kvcache_num_splits(16384, 8 * 48, 264), 2);  // 384 blocks: 2 waves of 264 are 73% busy, 3 of 768 97%
  EXPECT_EQ(kvcache_num_splits(131072, 8 * 64, 264), 1);
  EXPECT_EQ(kvcache_num_splits(100, 8, 264), 1);  // under two tiles per split: one split
  // A GPU far larger than the grid: as many splits as allowed, within the 5% of slack the rule takes.
  EXPECT_GE(kvcache_num_splits(1 << 20, 1, 100000), kDecodeMaxSplits * 95 / 100);
  EXPECT_EQ(kvcache_num_splits(0, 8, 264), 1);
  EXPECT_EQ(kvcache_num_splits(16384, 0, 264), 1);
  for (int64_t cap : std::vector<int64_t>{16, 128, 1000, 4096, 65536, int64_t{1} << 31}) {
    for (int64_t other : std::vector<int64_t>{1, 7, 64, 1000, 100000}) {
      const int64_t s = kvcache_num_splits(cap, other, 264);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, std::max<int64_t>(1, std::min<int64_t>(kDecodeMaxSplits, cap / kDecodeMinKeysPerSplit)));
    }
  }
}

// ---- bad arguments ------------------------------------------------------------------------------------

struct BadCall {
  KvFixture f;
  std::vector<int32_t> lens;
  KvCacheIndex ix;
  explicit BadCall(const KvCase& c) : f(c, 3), lens(c.lens), ix(f.index(lens.data(), f.block_table.data())) {}
  void run(const TensorView& q, const TensorView& kc, const TensorView& vc, const TensorView& kn, const TensorView& vn,
           const TensorView& o, const TensorView& lse, const AttentionOptions& opt) const {
    flash_attention_with_kvcache(q, kc, vc, ix, kn, vn, o, lse, opt);
  }
  void run() const {
    run(f.q.view(), f.k_cache.view(), f.v_cache.view(), f.c.seq_new ? f.k_new.view() : TensorView{},
        f.c.seq_new ? f.v_new.view() : TensorView{}, f.o.view(), f.lse_arg(), f.options());
  }
};

const KvCase kBase{.batch = 2, .nq = 1, .hq = 4, .hk = 2, .d = 16, .page_size = 16, .lens = {20, 5}, .seq_new = 1,
                   .causal = true};

TEST(AttentionDecode, BadIndexValuesAreErrorsOnTheCpu) {
  {
    BadCall bad(kBase);
    bad.f.block_table[0] = static_cast<int32_t>(bad.f.num_pages);
    expect_error([&] { bad.run(); }, {"flash_attention_with_kvcache", "block_table", "entry [0, 0]", "not a page"});
  }
  {
    BadCall bad(kBase);
    bad.f.block_table[1] = -1;  // the second page of sequence 0 holds keys 16..20
    expect_error([&] { bad.run(); }, {"block_table", "entry [0, 1] = -1"});
  }
  {
    BadCall bad(kBase);
    bad.lens[1] = -2;
    expect_error([&] { bad.run(); }, {"cache_seqlens", "sequence 1", "-2"});
  }
  {
    BadCall bad(kBase);
    bad.lens[0] = static_cast<int32_t>(bad.f.max_pages * 16);  // full: no room for the appended row
    expect_error([&] { bad.run(); }, {"cache_seqlens", "sequence 0", "after appending 1"});
  }
  {
    BadCall bad(kBase);
    bad.ix.cache_seqlens = nullptr;
    expect_error([&] { bad.run(); }, {"cache_seqlens", "null"});
  }
  {  // A failed check writes nothing: the cache keeps its bytes.
    BadCall bad(kBase);
    Tensor k_before = bad.f.expected_cache(bad.f.k_cache, bad.f.k_new);  // a copy (seq_new rows aside)
    copy_into(k_before.view(), bad.f.k_cache.view());
    bad.lens[1] = -2;
    EXPECT_THROW(bad.run(), Error);
    EXPECT_TRUE(same_bytes(bad.f.k_cache, k_before));
  }
}

TEST(AttentionDecode, BadShapesAndOptionsAreRefusedByName) {
  BadCall ok(kBase);
  ok.run();  // the base call is valid
  const auto& f = ok.f;
  const TensorView q = f.q.view(), kc = f.k_cache.view(), vc = f.v_cache.view(), kn = f.k_new.view(),
                   vn = f.v_new.view(), o = f.o.view(), lse = f.lse.view();
  const AttentionOptions opt = f.options();
  {  // page sizes: not a multiple of 16, or outside [16, 256]
    for (int64_t ps : {8, 24, 512}) {
      Tensor kc2 = Tensor::empty({4, ps, 2, 16}, DType::f32), vc2 = Tensor::empty({4, ps, 2, 16}, DType::f32);
      expect_error([&] { ok.run(q, kc2, vc2, kn, vn, o, lse, opt); }, {"k_cache", "page_size", "multiple of 16"});
    }
  }
  {
    BadCall bad(kBase);
    bad.ix.max_pages = 0;
    expect_error([&] { bad.run(); }, {"block_table", "max_pages"});
  }
  {
    BadCall bad(kBase);
    bad.ix.block_table_stride = 1;
    expect_error([&] { bad.run(); }, {"block_table", "row stride 1"});
  }
  {  // a capacity product that overflows, and one past int32
    BadCall bad(kBase);
    bad.ix.max_pages = std::numeric_limits<int64_t>::max() / 8;
    expect_error([&] { bad.run(); }, {"overflows"});
    bad.ix.max_pages = int64_t{1} << 28;
    expect_error([&] { bad.run(); }, {"k_cache", "int32"});
  }
  {  // non-paged: batch must match, and no max_pages
    BadCall flat(KvCase{.batch = 2, .nq = 1, .hq = 4, .hk = 2, .d = 16, .page_size = 0, .lens = {3, 4}});
    flat.ix.max_pages = 4;
    expect_error([&] { flat.run(); }, {"max_pages", "without a block table"});
    flat.ix.max_pages = 0;
    TensorView k3 = flat.f.k_cache.view().slice(0, 0, 1), v3 = flat.f.v_cache.view().slice(0, 0, 1);
    expect_error([&] { flat.run(flat.f.q.view(), k3, v3, {}, {}, flat.f.o.view(), flat.f.lse.view(), {}); },
                 {"k_cache", "non-paged", "batch 1"});
  }
  expect_error([&] { ok.run(q, kc, vc, kn, TensorView{}, o, lse, opt); }, {"v_new"});
  {
    Tensor kn2 = Tensor::empty({2, 1, 1, 16}, DType::f32), vn2 = Tensor::empty({2, 1, 1, 16}, DType::f32);
    expect_error([&] { ok.run(q, kc, vc, kn2, vn2, o, lse, opt); }, {"k_new", "expected shape [2, seq_new, 2, 16]"});
  }
  {
    Tensor vc16 = Tensor::empty({f.num_pages, 16, 2, 16}, DType::bf16);
    expect_error([&] { ok.run(q, kc, vc16, kn, vn, o, lse, opt); }, {"v_cache", "dtype"});
  }
  {
    Tensor q3 = Tensor::empty({2, 1, 3, 16}, DType::f32), o3 = Tensor::empty({2, 1, 3, 16}, DType::f32);
    Tensor l3 = Tensor::empty({2, 3, 1}, DType::f32);
    expect_error([&] { ok.run(q3, kc, vc, kn, vn, o3, l3, opt); }, {"heads_q = 3", "multiple"});
  }
  {
    Tensor l2 = Tensor::empty({2, 4, 2}, DType::f32);
    expect_error([&] { ok.run(q, kc, vc, kn, vn, o, l2, opt); }, {"lse", "expected shape [2, 4, 1]"});
  }
  {
    AttentionOptions w = opt;
    w.window_size_left = -3;
    expect_error([&] { ok.run(q, kc, vc, kn, vn, o, lse, w); }, {"window_size_left"});
    AttentionOptions s = opt;
    s.softcap = -1;
    expect_error([&] { ok.run(q, kc, vc, kn, vn, o, lse, s); }, {"softcap"});
  }
  // Outputs that alias inputs: o over the cache, the cache over k_new, k_cache over v_cache.
  {
    TensorView o_alias = TensorView::contiguous(f.k_cache.data(), DType::f32, {2, 1, 4, 16});
    expect_error([&] { ok.run(q, kc, vc, kn, vn, o_alias, lse, opt); }, {"o", "overlaps", "k_cache"});
    expect_error([&] { ok.run(q, kc, kc, kn, vn, o, lse, opt); }, {"k_cache", "overlaps", "v_cache"});
  }
}

// ---- CUDA ------------------------------------------------------------------------------------------------

// A host tensor's contiguous device copy.
Tensor device_copy(const Tensor& t) {
  const TensorView& v = t.view();
  Tensor d = Tensor::empty(std::span<const int64_t>(v.sizes.data(), static_cast<size_t>(v.ndim)), v.dtype,
                           Device::cuda);
  copy_into(d.view(), v);
  return d;
}

Buffer device_ints(const std::vector<int32_t>& x) {
  Buffer b = Buffer::allocate(std::max<size_t>(1, x.size()) * sizeof(int32_t), Device::cuda, "test: int32 index");
  if (!x.empty()) cuda_copy(b.data(), x.data(), x.size() * sizeof(int32_t));
  return b;
}

// The call on device copies (outputs poisoned with NaN on the device too); results and caches copied back.
void run_cuda(KvFixture& f, const std::vector<int32_t>& lens) {
  Tensor q = device_copy(f.q), kc = device_copy(f.k_cache), vc = device_copy(f.v_cache);
  Tensor o = device_copy(f.o), lse = device_copy(f.lse);
  Tensor kn, vn;
  if (f.c.seq_new > 0) kn = device_copy(f.k_new), vn = device_copy(f.v_new);
  Buffer seqlens = device_ints(lens), table = device_ints(f.block_table);
  flash_attention_with_kvcache(q.view(), kc.view(), vc.view(),
                               f.index(static_cast<const int32_t*>(seqlens.data()),
                                       static_cast<const int32_t*>(table.data())),
                               f.c.seq_new > 0 ? kn.view() : TensorView{}, f.c.seq_new > 0 ? vn.view() : TensorView{},
                               o.view(), f.c.with_lse ? lse.view() : TensorView{}, f.options());
  cuda_synchronize();
  copy_into(f.o.view(), o.view());
  copy_into(f.lse.view(), lse.view());
  copy_into(f.k_cache.view(), kc.view());
  copy_into(f.v_cache.view(), vc.view());
}

void run_cuda_and_check(const KvCase& c, uint64_t seed = 11) {
  KvFixture f(c, seed);
  const KvFixture before(c, seed);
  const Tensor k_expected = c.seq_new > 0 ? f.expected_cache(f.k_cache, f.k_new) : Tensor();
  const Tensor v_expected = c.seq_new > 0 ? f.expected_cache(f.v_cache, f.v_new) : Tensor();
  run_cuda(f, c.lens);
  expect_matches_reference(before, f.o, f.lse, "cuda " + kv_name(c));
  if (c.seq_new > 0) {
    EXPECT_TRUE(same_bytes(f.k_cache, k_expected)) << "k_cache after the cuda append of " << kv_name(c);
    EXPECT_TRUE(same_bytes(f.v_cache, v_expected)) << "v_cache after the cuda append of " << kv_name(c);
  }
}

TEST(AttentionDecodeCuda, MatchesTheOracleAtEveryHeadDim) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    for (DType dt : {DType::bf16, DType::f16}) {
      for (const KvCase& c : common_cases(d, dt)) run_cuda_and_check(c);
    }
  }
}

// Long caches: many splits per sequence (the combine), GQA 32/8 and 8/8, page 256 and 16, lengths that
// differ by orders of magnitude within a batch.
TEST(AttentionDecodeCuda, LongCachesSplitAcrossBlocks) {
  SKIP_WITHOUT_GPU();
  run_cuda_and_check({.batch = 3, .nq = 1, .hq = 32, .hk = 8, .d = 128, .page_size = 256, .lens = {16384 + 37, 5000, 1},
                      .seq_new = 1, .causal = true, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 2, .nq = 1, .hq = 8, .hk = 8, .d = 128, .page_size = 16, .lens = {9000, 0},
                      .seq_new = 1, .causal = true, .dtype = DType::f16});
  run_cuda_and_check({.batch = 2, .nq = 4, .hq = 16, .hk = 4, .d = 64, .page_size = 0, .lens = {20000, 3000},
                      .seq_new = 4, .causal = true, .window_left = 4096, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 1, .nq = 16, .hq = 32, .hk = 8, .d = 128, .page_size = 128, .lens = {12000},
                      .seq_new = 16, .causal = true, .softcap = 3.0, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 1, .nq = 2, .hq = 8, .hk = 2, .d = 256, .page_size = 64, .lens = {7000},
                      .seq_new = 2, .causal = true, .dtype = DType::bf16});
}

// Many short sequences: a grid of several waves with few splits, and with one split (a capacity under two
// splits' minimum, kDecodeMinKeysPerSplit: the split kernel writes o directly).
TEST(AttentionDecodeCuda, ManySequencesFewSplits) {
  SKIP_WITHOUT_GPU();
  std::vector<int32_t> lens(80);
  for (size_t i = 0; i < lens.size(); ++i) lens[i] = static_cast<int32_t>((i * 37) % 300);
  run_cuda_and_check({.batch = 80, .nq = 1, .hq = 32, .hk = 8, .d = 128, .page_size = 64, .lens = lens, .seq_new = 1,
                      .causal = true, .dtype = DType::bf16});
  for (size_t i = 0; i < lens.size(); ++i) lens[i] = static_cast<int32_t>((i * 37) % 200);  // capacity 224
  run_cuda_and_check({.batch = 80, .nq = 1, .hq = 32, .hk = 8, .d = 128, .page_size = 16, .lens = lens, .seq_new = 1,
                      .causal = true, .dtype = DType::bf16});
}

// The split kernel's edges at the benchmark's shape and beside it: a batch-1 cache long enough for ~32 splits
// whose length is no multiple of a tile or a page (page 256, the last page partly filled); query rows that are
// not a multiple of the 16-row tile (group 8 x nq 3 = 24: a full chunk and a part one; group 1); a window whose
// first key is not tile-aligned over many splits; soft-capping over many splits; d64 and d256 with many splits;
// the non-paged cache with many splits.
TEST(AttentionDecodeCuda, SplitKernelEdges) {
  SKIP_WITHOUT_GPU();
  run_cuda_and_check({.batch = 1, .nq = 1, .hq = 32, .hk = 8, .d = 128, .page_size = 256, .lens = {20000 + 77},
                      .seq_new = 1, .causal = true, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 2, .nq = 3, .hq = 16, .hk = 2, .d = 128, .page_size = 32, .lens = {5003, 70},
                      .seq_new = 3, .causal = true, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 2, .nq = 1, .hq = 4, .hk = 4, .d = 128, .page_size = 16, .lens = {3001, 17},
                      .seq_new = 1, .causal = true, .dtype = DType::f16});
  run_cuda_and_check({.batch = 1, .nq = 2, .hq = 32, .hk = 8, .d = 128, .page_size = 48, .lens = {30011},
                      .seq_new = 2, .causal = true, .window_left = 9000, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 1, .nq = 1, .hq = 32, .hk = 8, .d = 128, .page_size = 80, .lens = {20000},
                      .causal = true, .softcap = 5.0, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 1, .nq = 1, .hq = 16, .hk = 2, .d = 64, .page_size = 64, .lens = {25000},
                      .seq_new = 1, .causal = true, .dtype = DType::f16});
  run_cuda_and_check({.batch = 1, .nq = 1, .hq = 8, .hk = 2, .d = 256, .page_size = 16, .lens = {12345},
                      .seq_new = 1, .causal = true, .dtype = DType::bf16});
  run_cuda_and_check({.batch = 2, .nq = 1, .hq = 32, .hk = 8, .d = 128, .page_size = 0, .lens = {33333, 64},
                      .seq_new = 1, .causal = true, .dtype = DType::bf16, .with_lse = false});
}

// A bad block-table entry or length is not checked on the host (no copy: graph capturable); the kernels give
// that sequence NaN, leave the others right, and touch no memory outside the cache.
TEST(AttentionDecodeCuda, BadIndexValuesGiveNaNForTheirSequenceOnly) {
  SKIP_WITHOUT_GPU();
  for (int64_t bad_what = 0; bad_what < 3; ++bad_what) {
    KvCase c{.batch = 3, .nq = 1, .hq = 8, .hk = 2, .d = 128, .page_size = 16, .lens = {600, 40, 70}, .seq_new = 1,
             .causal = true, .dtype = DType::bf16};
    KvFixture f(c, 5);
    const KvFixture before(c, 5);
    std::vector<int32_t> lens = c.lens;
    if (bad_what == 0) f.block_table[static_cast<size_t>(f.max_pages + 1)] = 1 << 30;  // sequence 1, page 1
    if (bad_what == 1) f.block_table[static_cast<size_t>(f.max_pages + 2)] = -7;       // sequence 1, page 2
    if (bad_what == 2) lens[1] = static_cast<int32_t>(f.max_pages * 16);                // no room to append
    run_cuda(f, lens);
    Tensor o = to_f64(f.o.view()), lse = to_f64(f.lse.view());
    Tensor o_ref, lse_ref;
    before.reference(DType::f64, o_ref, lse_ref);
    const int64_t per_seq = c.nq * c.hq * c.d;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t i = 0; i < per_seq; ++i) {
        const double x = o.view().ptr<double>()[b * per_seq + i];
        if (b == 1) {
          EXPECT_TRUE(std::isnan(x)) << "o of the bad sequence, case " << bad_what;
        } else {
          EXPECT_NEAR(x, o_ref.view().ptr<double>()[b * per_seq + i], 0.05) << "o of a good sequence, case " << bad_what;
        }
      }
      for (int64_t i = 0; i < c.hq * c.nq; ++i) {
        EXPECT_EQ(std::isnan(lse.view().ptr<double>()[b * c.hq * c.nq + i]), b == 1) << "lse, case " << bad_what;
      }
    }
  }
}

TEST(AttentionDecodeCuda, CudaOnlyArgumentsAreRefusedByName) {
  SKIP_WITHOUT_GPU();
  KvCase c{.batch = 2, .nq = 1, .hq = 4, .hk = 2, .d = 128, .page_size = 16, .lens = {20, 5}, .causal = true,
           .dtype = DType::bf16};
  KvFixture f(c, 1);
  Tensor q = device_copy(f.q), kc = device_copy(f.k_cache), vc = device_copy(f.v_cache), o = device_copy(f.o),
         lse = device_copy(f.lse);
  Buffer seqlens = device_ints(c.lens), table = device_ints(f.block_table);
  const KvCacheIndex ix = f.index(static_cast<const int32_t*>(seqlens.data()), static_cast<const int32_t*>(table.data()));
  flash_attention_with_kvcache(q.view(), kc.view(), vc.view(), ix, {}, {}, o.view(), lse.view(), f.options());
  cuda_synchronize();
  // Index arrays in host memory.
  expect_error([&] {
    flash_attention_with_kvcache(q.view(), kc.view(), vc.view(), f.index(c.lens.data(), f.block_table.data()), {}, {},
                                 o.view(), lse.view(), f.options());
  }, {"cache_seqlens", "device memory"});
  // fp32 and a head dim without a kernel.
  KvCase c32 = c;
  c32.dtype = DType::f32;
  KvFixture f32(c32, 1);
  Tensor q32 = device_copy(f32.q), kc32 = device_copy(f32.k_cache), vc32 = device_copy(f32.v_cache),
         o32 = device_copy(f32.o);
  expect_error([&] {
    flash_attention_with_kvcache(q32.view(), kc32.view(), vc32.view(), ix, {}, {}, o32.view(), lse.view(), f32.options());
  }, {"dtype fp32", "cpu"});
  KvCase c96 = c;
  c96.d = 96;
  KvFixture f96(c96, 1);
  Tensor q96 = device_copy(f96.q), kc96 = device_copy(f96.k_cache), vc96 = device_copy(f96.v_cache),
         o96 = device_copy(f96.o);
  expect_error([&] {
    flash_attention_with_kvcache(q96.view(), kc96.view(), vc96.view(), ix, {}, {}, o96.view(), lse.view(),
                                 f96.options());
  }, {"head_dim 96"});
}

}  // namespace
