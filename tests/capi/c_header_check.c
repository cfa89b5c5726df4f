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
  printf("flashlm %s, C ABI %d: ok\n", flashlm_version(), flashlm_abi_version());
  return 0;
}
