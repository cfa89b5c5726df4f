// flash_attention_with_kvcache on the CPU: the append of the new keys/values into the cache, then each
// query row's scores, softmax and weighted sum of values over its sequence's visible keys, read through the
// block table, with fp64 accumulation. One code serves as the CPU path and as the oracle of the CUDA
// kernels' tests (which also check it against attention_forward on the gathered cache).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/backends.h"
#include "attention/cpu_rows.h"

namespace flashlm {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Row (key position j of sequence b, head h) of the cache `t`.
template <class T>
T* cache_row(const KvCacheProblem& kp, const int32_t* block_table, const TensorView& t, int64_t b, int64_t j,
             int64_t h) {
  const int64_t page = kp.paged ? block_table[b * kp.block_table_stride + j / kp.page_size] : b;
  const int64_t row = kp.paged ? j % kp.page_size : j;
  return t.ptr<T>() + page * t.stride(0) + row * t.stride(1) + h * t.stride(2);
}

template <class T>
void append(const KvCacheProblem& kp, const int32_t* block_table, const TensorView& k_cache, const TensorView& v_cache,
            const TensorView& k_new, const TensorView& v_new) {
  const auto& p = kp.attn;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t start = kp.seqlens[static_cast<size_t>(b)];
    for (int64_t t = 0; t < kp.seq_new; ++t) {
      for (int64_t h = 0; h < p.heads_k; ++h) {
        const T* kn = attention_row<const T>(k_new, b, t, h);
        const T* vn = attention_row<const T>(v_new, b, t, h);
        std::copy(kn, kn + p.head_dim, cache_row<T>(kp, block_table, k_cache, b, start + t, h));
        std::copy(vn, vn + p.head_dim, cache_row<T>(kp, block_table, v_cache, b, start + t, h));
      }
    }
  }
}

template <class T>
void attend(const KvCacheProblem& kp, const int32_t* block_table, const TensorView& q, const TensorView& k_cache,
            const TensorView& v_cache, const TensorView& o, const TensorView& lse) {
  const auto& p = kp.attn;
  const int64_t D = p.head_dim;
#pragma omp parallel
  {
    std::vector<double> qrow(static_cast<size_t>(D)), krow(static_cast<size_t>(D)), orow(static_cast<size_t>(D));
    std::vector<double> scores;
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh) {
      const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group();
      const AttentionProblem seq = kp.for_sequence(kp.seqlens[static_cast<size_t>(b)] + kp.seq_new);
      for (int64_t i = 0; i < p.seq_q; ++i) {
        load_row(attention_row<const T>(q, b, i, h), qrow.data(), D);
        const int64_t first = seq.first_visible_key(i), end = std::max(first, seq.visible_keys(i));
        scores.resize(static_cast<size_t>(end - first));
        double m = kNegInf;
        for (int64_t j = first; j < end; ++j) {
          load_row(cache_row<const T>(kp, block_table, k_cache, b, j, hk), krow.data(), D);
          double s = p.scale * dot(qrow.data(), krow.data(), D);
          if (p.softcap > 0) s = p.softcap * std::tanh(s / p.softcap);
          scores[static_cast<size_t>(j - first)] = s;
          m = max_propagating_nan(m, s);
        }
        double sum = 0;
        for (double& s : scores) {
          s = m == kNegInf ? 0.0 : std::exp(s - m);
          sum += s;
        }
        std::fill(orow.begin(), orow.end(), 0.0);
        for (int64_t j = first; j < end; ++j) {  // every visible key: 0 · NaN in v stays NaN
          load_row(cache_row<const T>(kp, block_table, v_cache, b, j, hk), krow.data(), D);
          axpy(sum != 0 ? scores[static_cast<size_t>(j - first)] / sum : 0.0, krow.data(), orow.data(), D);
        }
        store_row(orow.data(), attention_row<T>(o, b, i, h), D);
        if (kp.has_lse) {
          const double l = sum != 0 ? m + std::log(sum) : kNegInf;
          if (lse.dtype == DType::f64) lse_at<double>(lse, b, h, i) = l;
          else lse_at<float>(lse, b, h, i) = static_cast<float>(l);
        }
      }
    }
  }
}

}  // namespace

void kvcache_attention_cpu(const KvCacheProblem& kp, const TensorView& q, const TensorView& k_cache,
                           const TensorView& v_cache, const int32_t* block_table, const TensorView& k_new,
                           const TensorView& v_new, const TensorView& o, const TensorView& lse) {
  dispatch_dtype(kp.attn.dtype, [&](auto t) {
    using T = decltype(t);
    if (kp.seq_new > 0) append<T>(kp, block_table, k_cache, v_cache, k_new, v_new);
    attend<T>(kp, block_table, q, k_cache, v_cache, o, lse);
  });
}

}  // namespace flashlm
