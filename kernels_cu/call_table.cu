// The first node of a call graph (cupyffn/cuda/call_graph.py): this call's operand addresses of the cuBLAS GEMMs,
// passed as kernel parameters (which the host re-points per call), copied into the table those GEMMs read
// their pointers from on the GPU (cublasGemmBatchedEx of one matrix: an array of one pointer per operand).
#include "common.cuh"

#define kCallGemms 4

struct GemmPointers {  // row-major roles, as cupyffn/gemm/cublas.py's Gemm: C[M,N] = op(A) @ op(B)
  const void* a;
  const void* b;
  void* c;
};
static_assert(sizeof(GemmPointers) == 24, "GemmPointers layout is mirrored in cupyffn/cuda/kernels.py");

struct CallTable {  // GEMM1..GEMM4; a GEMM the call does not run keeps null pointers
  GemmPointers gemm[kCallGemms];
};
static_assert(sizeof(CallTable) == 24 * kCallGemms, "CallTable layout is mirrored in cupyffn/cuda/kernels.py");

extern "C" __global__ void store_call_table(CallTable* table, CallTable values) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *table = values;
}
