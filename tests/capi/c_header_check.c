/* The public C header compiles as C and its entry points link: a C program calling the ABI. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "flashlm/flashlm.h"

static flashlm_tensor view4(float* data, int64_t b, int64_t n, int64_t h, int64_t d) {
  flashlm_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.ndim = 4;
  t.dtype = FLASHLM_FP32;
  t.device = FLASHLM_CPU;
  t.sizes[0] = b, t.sizes[1] = n, t.sizes[2] = h, t.sizes[3] = d;
  t.strides[0] = n * h * d, t.strides[1] = h * d, t.strides[2] = d, t.strides[3] = 1;
  return t;
}

static flashlm_tensor view3(float* data, int64_t n, int64_t h, int64_t d) {
  flashlm_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.ndim = 3;
  t.dtype = FLASHLM_FP32;
  t.device = FLASHLM_CPU;
  t.sizes[0] = n, t.sizes[1] = h, t.sizes[2] = d;
  t.strides[0] = h * d, t.strides[1] = d, t.strides[2] = 1;
  return t;
}

int main(void) {
  static float q[2 * 16 * 2 * 8], o[2 * 16 * 2 * 8], lse_data[2 * 2 * 16];
  for (int i = 0; i < 2 * 16 * 2 * 8; ++i) q[i] = (float)sin(0.37 * i);
  flashlm_tensor tq = view4(q, 2, 16, 2, 8), to = view4(o, 2, 16, 2, 8);
  flashlm_tensor lse;
  memset(&lse, 0, sizeof lse);
  lse.data = lse_data, lse.ndim = 3, lse.dtype = FLASHLM_FP32, lse.device = FLASHLM_CPU;
  lse.sizes[0] = 2, lse.sizes[1] = 2, lse.sizes[2] = 16;
  lse.strides[0] = 32, lse.strides[1] = 16, lse.strides[2] = 1;
  flashlm_attention_options opt = flashlm_attention_options_default();
  opt.causal = 1;
  if (flashlm_abi_version() != FLASHLM_ABI_VERSION) return fprintf(stderr, "abi version mismatch\n"), 1;
  if (flashlm_attention_forward(&tq, &tq, &tq, &to, &lse, &opt) != FLASHLM_OK)
    return fprintf(stderr, "forward failed: %s\n", flashlm_last_error()), 1;
  /* Query 0 sees only key 0: its output is v_0 = q_0. */
  if (fabsf(o[0] - q[0]) > 1e-6f) return fprintf(stderr, "o[0] = %f, expected %f\n", o[0], q[0]), 1;
  lse.dtype = FLASHLM_FP16;
  if (flashlm_attention_forward(&tq, &tq, &tq, &to, &lse, &opt) != FLASHLM_INVALID_ARGUMENT) return 1;
  if (!strstr(flashlm_last_error(), "lse: expected dtype fp32")) return fprintf(stderr, "%s\n", flashlm_last_error()), 1;
  if (flashlm_attention_forward(NULL, &tq, &tq, &to, &lse, &opt) != FLASHLM_INVALID_ARGUMENT) return 1;
  if (!strstr(flashlm_last_error(), "q: null flashlm_tensor pointer")) return 1;
  /* An output that aliases an input is refused (it used to return OK with a wrong result). */
  lse.dtype = FLASHLM_FP32;
  if (flashlm_attention_forward(&tq, &tq, &tq, &tq, &lse, &opt) != FLASHLM_INVALID_ARGUMENT)
    return fprintf(stderr, "o aliasing q was accepted\n"), 1;
  if (!strstr(flashlm_last_error(), "o: the output overlaps the input q"))
    return fprintf(stderr, "%s\n", flashlm_last_error()), 1;
  /* Varlen: the same 32 rows as two packed sequences of 16 ([32, 2, 8], lse [2, 32]), causal per sequence:
   * the first query of each sequence sees only its own first key. */
  {
    static float ov[32 * 2 * 8];
    static const int32_t cu[3] = {0, 16, 32}, bad[3] = {0, 10, 8};
    flashlm_tensor pq = view3(q, 32, 2, 8), po = view3(ov, 32, 2, 8), pl;
    memset(&pl, 0, sizeof pl);
    pl.data = lse_data, pl.ndim = 2, pl.dtype = FLASHLM_FP32, pl.device = FLASHLM_CPU;
    pl.sizes[0] = 2, pl.sizes[1] = 32, pl.strides[0] = 32, pl.strides[1] = 1;
    flashlm_varlen seqs = {cu, cu, 2, FLASHLM_CPU, 16, 16};
    if (flashlm_attention_varlen_forward(&pq, &pq, &pq, &po, &pl, &seqs, &opt) != FLASHLM_OK)
      return fprintf(stderr, "varlen forward failed: %s\n", flashlm_last_error()), 1;
    if (fabsf(ov[0] - q[0]) > 1e-6f || fabsf(ov[16 * 16] - q[16 * 16]) > 1e-6f)
      return fprintf(stderr, "varlen: a sequence's first query does not see only its own first key\n"), 1;
    seqs.cu_seqlens_q = bad;
    if (flashlm_attention_varlen_forward(&pq, &pq, &pq, &po, &pl, &seqs, &opt) != FLASHLM_INVALID_ARGUMENT) return 1;
    if (!strstr(flashlm_last_error(), "cu_seqlens_q: the offsets decrease at sequence 1"))
      return fprintf(stderr, "%s\n", flashlm_last_error()), 1;
  }
  /* KV cache: a contiguous cache [1, 4, 1, 8] holding 2 keys, one new row appended at position 2, one query
   * (NULL lse). The appended row must land in the cache; a missing index is refused. */
  {
    static float kc[4 * 8], vc[4 * 8], kn[8], vn[8], q1[8], o1[8];
    static const int32_t lens[1] = {2};
    for (int i = 0; i < 4 * 8; ++i) kc[i] = (float)cos(0.11 * i), vc[i] = (float)sin(0.23 * i);
    for (int i = 0; i < 8; ++i) kn[i] = 0.5f + (float)i, vn[i] = -1.0f - (float)i, q1[i] = (float)sin(0.7 * i);
    flashlm_tensor tkc = view4(kc, 1, 4, 1, 8), tvc = view4(vc, 1, 4, 1, 8), tkn = view4(kn, 1, 1, 1, 8);
    flashlm_tensor tvn = view4(vn, 1, 1, 1, 8), tq1 = view4(q1, 1, 1, 1, 8), to1 = view4(o1, 1, 1, 1, 8);
    flashlm_kvcache_index index = {lens, NULL, 0, 0};
    if (flashlm_attention_with_kvcache(&tq1, &tkc, &tvc, &index, &tkn, &tvn, &to1, NULL, &opt) != FLASHLM_OK)
      return fprintf(stderr, "with_kvcache failed: %s\n", flashlm_last_error()), 1;
    if (kc[2 * 8 + 3] != kn[3] || vc[2 * 8 + 5] != vn[5])
      return fprintf(stderr, "with_kvcache: the new row is not in the cache\n"), 1;
    if (flashlm_attention_with_kvcache(&tq1, &tkc, &tvc, NULL, NULL, NULL, &to1, NULL, &opt) != FLASHLM_INVALID_ARGUMENT)
      return 1;
    if (!strstr(flashlm_last_error(), "index: null")) return fprintf(stderr, "%s\n", flashlm_last_error()), 1;
  }
  printf("flashlm %s, C ABI %d: ok\n", flashlm_version(), flashlm_abi_version());
  return 0;
}
