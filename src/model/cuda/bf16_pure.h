// The one layer kernel pure-bf16 training (ModelOptions::bf16_pure) needs beyond cuda/ops.h's: the token
// embedding looked up from a bf16 table (cuda/ops.h's reads an fp32 master table). AdamW over bf16 state is
// optim/optimizer.h's adamw_step_bf16. Device pointers, asynchronous on `stream`, flashlm::Error on bad
// sizes.
#pragma once
#include <cstdint>

#include "flashlm/dtype.h"

namespace flashlm::gpu {

// x[r] = table[tokens[r]] (bf16 rows copied exactly); rows whose token lies outside [0, vocab) become NaN.
void embedding_forward_bf16(const bf16_t* table, const int32_t* tokens, bf16_t* x, int64_t n, int64_t d,
                            int64_t vocab, void* stream);

}  // namespace flashlm::gpu
