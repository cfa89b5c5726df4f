// The naive attention: materialised scores S and probabilities P for every (batch, head), everything
// accumulated in fp64. It is the oracle for every test and the O(seq²)-memory baseline of the benchmark.
#include <cmath>
#include <limits>
#include <vector>

#include "attention/backends.h"
#include "attention/cpu_rows.h"
#include "core/check.h"

namespace flashlm {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct ReferenceScratch {
  Buffer scores, probs;
  double* s(int64_t bh, const AttentionProblem& p) const { return static_cast<double*>(scores.data()) + bh * p.seq_q * p.seq_k; }
  double* pr(int64_t bh, const AttentionProblem& p) const { return static_cast<double*>(probs.data()) + bh * p.seq_q * p.seq_k; }
};

ReferenceScratch allocate_scores(const AttentionProblem& p) {
  const auto n = static_cast<size_t>(checked_product({p.batch, p.heads_q, p.seq_q, p.seq_k, int64_t{sizeof(double)}},
                                                     "naive attention: bytes of the scores S"));
  return {Buffer::allocate(n, Device::cpu, "naive attention scores S"),
          Buffer::allocate(n, Device::cpu, "naive attention probabilities P")};
}

// S = scale·QKᵀ (masked to -inf), P = softmax(S) row by row; returns nothing, fills scratch for (b, h).
// All seq rows of head h of a [batch, seq, heads, head_dim] view, as one fp64 matrix.
template <class T>
void load_head(const TensorView& t, int64_t b, int64_t h, std::vector<double>& out) {
  const int64_t n = t.size(1), D = t.size(3);
  out.resize(static_cast<size_t>(n * D));
  for (int64_t s = 0; s < n; ++s) load_row(attention_row<const T>(t, b, s, h), &out[static_cast<size_t>(s * D)], D);
}

// S = scale·QKᵀ (soft-capped where p.softcap > 0, plus the ALiBi bias; masked to -inf), P = softmax(S) row by
// row over the keys and the head's sink (which has no column: its probability is exp(sink - lse)), for (b, h).
// lse_row[i]: the row's log-sum-exp, sink included (-inf for a row with neither keys nor sink).
template <class T>
void scores_and_probs(const AttentionProblem& p, const TensorView& q, const std::vector<double>& kmat, int64_t b,
                      int64_t h, double* s, double* pr, std::vector<double>& qrow, double* lse_row) {
  const int64_t D = p.head_dim;
  const double slope = p.alibi_slope(b, h), sink = p.sink_logit(h);
  for (int64_t i = 0; i < p.seq_q; ++i) {
    load_row(attention_row<const T>(q, b, i, h), qrow.data(), D);
    const int64_t first = p.first_visible_key(i), visible = p.visible_keys(i);
    double m = sink;  // -inf without one
    for (int64_t j = 0; j < p.seq_k; ++j) {
      double sij = kNegInf;
      if (j >= first && j < visible) {
        sij = p.scale * dot(qrow.data(), &kmat[static_cast<size_t>(j * D)], D);
        if (p.softcap > 0) sij = p.softcap * std::tanh(sij / p.softcap);
        sij += p.alibi_bias(slope, i, j);
      }
      s[i * p.seq_k + j] = sij;
      m = max_propagating_nan(m, sij);
    }
    // Masked keys get P = 0 exactly; a NaN score (or two +inf) makes the sum, and so the row, NaN.
    double sum = m == kNegInf ? 0.0 : std::exp(sink - m);
    for (int64_t j = 0; j < p.seq_k; ++j) {
      const double e = j < first || j >= visible || m == kNegInf ? 0.0 : std::exp(s[i * p.seq_k + j] - m);
      pr[i * p.seq_k + j] = e;
      sum += e;
    }
    for (int64_t j = 0; j < p.seq_k; ++j) pr[i * p.seq_k + j] = sum != 0 ? pr[i * p.seq_k + j] / sum : 0.0;
    lse_row[i] = sum != 0 ? m + std::log(sum) : kNegInf;
  }
}

template <class T>
void forward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
             const TensorView& o, const TensorView& lse) {
  ReferenceScratch scratch = allocate_scores(p);
  const int64_t Dv = p.value_dim();
#pragma omp parallel
  {
    std::vector<double> qrow(p.head_dim), orow(Dv), lse_row(p.seq_q), kmat, vmat;
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh) {
      const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group();
      double* s = scratch.s(bh, p);
      double* pr = scratch.pr(bh, p);
      load_head<T>(k, b, hk, kmat);
      load_head<T>(v, b, hk, vmat);
      scores_and_probs<T>(p, q, kmat, b, h, s, pr, qrow, lse_row.data());
      for (int64_t i = 0; i < p.seq_q; ++i) {
        std::fill(orow.begin(), orow.end(), 0.0);
        // Every visible key, even at P = 0: 0 · NaN in v is NaN, as in PyTorch's P @ V.
        for (int64_t j = p.first_visible_key(i); j < p.visible_keys(i); ++j) {
          axpy(pr[i * p.seq_k + j], &vmat[static_cast<size_t>(j * Dv)], orow.data(), Dv);
        }
        store_row(orow.data(), attention_row<T>(o, b, i, h), Dv);
        if (lse.dtype == DType::f64) lse_at<double>(lse, b, h, i) = lse_row[i];
        else lse_at<float>(lse, b, h, i) = static_cast<float>(lse_row[i]);
      }
    }
  }
}

template <class T>
void backward(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  ReferenceScratch scratch = allocate_scores(p);  // P is reused for dS
  const int64_t D = p.head_dim, Dv = p.value_dim(), Nq = p.seq_q, Nk = p.seq_k;
  // The sink's gradient per (batch, query head), summed over the batch in order afterwards (deterministic).
  std::vector<double> dsink(p.dlearnable_sink ? static_cast<size_t>(p.batch * p.heads_q) : 0);
#pragma omp parallel
  {
    std::vector<double> qrow(D), dorow(Dv), acc(D), dp(static_cast<size_t>(Nk)), lse_row(Nq), kmat, vmat;
    std::vector<double> dk_acc, dv_acc;
#pragma omp for schedule(dynamic)
    for (int64_t bhk = 0; bhk < p.batch * p.heads_k; ++bhk) {
      const int64_t b = bhk / p.heads_k, hk = bhk % p.heads_k;
      load_head<T>(k, b, hk, kmat);
      load_head<T>(v, b, hk, vmat);
      dk_acc.assign(static_cast<size_t>(Nk * D), 0.0);
      dv_acc.assign(static_cast<size_t>(Nk * Dv), 0.0);
      for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        const int64_t bh = b * p.heads_q + h;
        double* s = scratch.s(bh, p);
        double* pr = scratch.pr(bh, p);
        scores_and_probs<T>(p, q, kmat, b, h, s, pr, qrow, lse_row.data());
        const double slope = p.alibi_slope(b, h), sink = p.sink_logit(h);
        double dsink_bh = 0;
        for (int64_t i = 0; i < Nq; ++i) {
          load_row(attention_row<const T>(dout, b, i, h), dorow.data(), Dv);
          // dP_ij = dO_i · V_j; Delta_i = Σ_j P_ij dP_ij (= dO_i · O_i); dS_ij = P_ij (dP_ij - Delta_i) into pr,
          // times d(c·tanh(x/c))/dx = 1 - tanh² = 1 - (C_ij / c)² with soft-capping (C_ij the capped score: S_ij
          // less the ALiBi bias). The sink has no value (its dP is 0): dsink = -Σ_i P_sink,i · Delta_i.
          // Masked keys take no part (NaN in dO or V stays out of the rows and keys that do not meet).
          const int64_t first = p.first_visible_key(i), visible = p.visible_keys(i);
          double delta = 0;
          for (int64_t j = first; j < visible; ++j) {
            dp[static_cast<size_t>(j)] = dot(dorow.data(), &vmat[static_cast<size_t>(j * Dv)], Dv);
            delta += pr[i * Nk + j] * dp[static_cast<size_t>(j)];
            axpy(pr[i * Nk + j], dorow.data(), &dv_acc[static_cast<size_t>(j * Dv)], Dv);
          }
          if (p.sink && first < visible) dsink_bh -= std::exp(sink - lse_row[static_cast<size_t>(i)]) * delta;
          for (int64_t j = first; j < visible; ++j) {
            pr[i * Nk + j] *= dp[static_cast<size_t>(j)] - delta;
            if (p.softcap > 0) {
              const double t = (s[i * Nk + j] - p.alibi_bias(slope, i, j)) / p.softcap;
              pr[i * Nk + j] *= 1 - t * t;
            }
          }
        }
        if (!dsink.empty()) dsink[static_cast<size_t>(bh)] = dsink_bh;
        for (int64_t i = 0; i < Nq; ++i) {
          load_row(attention_row<const T>(q, b, i, h), qrow.data(), D);
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = p.first_visible_key(i); j < p.visible_keys(i); ++j) {
            const double ds = pr[i * Nk + j];
            axpy(p.scale * ds, &kmat[static_cast<size_t>(j * D)], acc.data(), D);
            axpy(p.scale * ds, qrow.data(), &dk_acc[static_cast<size_t>(j * D)], D);
          }
          store_row(acc.data(), attention_row<T>(dq, b, i, h), D);
        }
      }
      for (int64_t j = 0; j < Nk; ++j) {
        store_row(&dk_acc[static_cast<size_t>(j * D)], attention_row<T>(dk, b, j, hk), D);
        store_row(&dv_acc[static_cast<size_t>(j * Dv)], attention_row<T>(dv, b, j, hk), Dv);
      }
    }
  }
  for (int64_t h = 0; h < static_cast<int64_t>(dsink.empty() ? 0 : p.heads_q); ++h) {
    double sum = 0;
    for (int64_t b = 0; b < p.batch; ++b) sum += dsink[static_cast<size_t>(b * p.heads_q + h)];
    p.dlearnable_sink[h * p.dsink_stride] += static_cast<float>(sum);
  }
}

}  // namespace

void reference_attention_forward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& o, const TensorView& lse) {
  dispatch_dtype(p.dtype, [&](auto t) { forward<decltype(t)>(p, q, k, v, o, lse); });
}

void reference_attention_backward_cpu(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& dout, const TensorView& dq,
                                      const TensorView& dk, const TensorView& dv) {
  dispatch_dtype(p.dtype, [&](auto t) { backward<decltype(t)>(p, q, k, v, dout, dq, dk, dv); });
}

}  // namespace flashlm
