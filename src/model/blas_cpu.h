// The one entry to OpenBLAS's matrix products, under the CPU threading policy of flashlm/blas.h.
#pragma once
#include <cstdint>

namespace flashlm::cpu {

// C[m, n] = alpha · op(A) · op(B) + beta · C, row-major, op(X) = Xᵀ where transposed; lda/ldb/ldc as cblas
// takes them. Splits C into blocks of rows (or of columns, when n is the longer side) across the OpenMP
// threads, each block one single-threaded sgemm: the K-sum of every element stays in one call, so the
// result does not depend on the thread count beyond what OpenBLAS's kernels do for a block's shape.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace flashlm::cpu
