// The block's activation, GELU with the tanh approximation: its CUDA form (the Python description beside it,
// with the math and where every route reads it: cupyffn/core/activation.py). Pasted into every kernel through
// common.cuh; a second activation would be a header of the same three functions.
#pragma once

namespace cupyffn {

// GELU(tanh) derivative from the saved tanh output t = tanh(sqrt(2/pi) * (x + 0.044715 x^3)):
//   d/dx [0.5 x (1 + t)] = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// Evaluated as fma(x (1 - t^2), c0 + c1 x^2, 0.5 + 0.5 t) with c0 = sqrt(2/pi) / 2, c1 = c0 * 3 * 0.044715:
// six fp32 instructions (the form above compiles to nine), which the fused GEMM1 epilogue runs per element.
__device__ __forceinline__ float gelu_grad(float x, float t) {
  const float kC0 = 0.3989422804014327f;    // sqrt(2/pi) / 2
  const float kC1 = 0.05351611220445019f;   // sqrt(2/pi) / 2 * 3 * 0.044715
  const float poly = fmaf(x * x, kC1, kC0);
  const float half_one_plus_t = fmaf(0.5f, t, 0.5f);
  return fmaf(x * fmaf(-t, t, 1.0f), poly, half_one_plus_t);
}

// GELU(tanh) of z: t = tanh(sqrt(2/pi) * (z + 0.044715 z^3)) and g = 0.5 z (1 + t).
__device__ __forceinline__ float tanh_inner_of(float z) {
  const float kSqrt2OverPi = 0.7978845608028654f;
  return tanhf(kSqrt2OverPi * (z + 0.044715f * z * z * z));
}

// gelu_out = 0.5 z (1 + t) of z and its tanh_inner t, in the forward's order: every kernel that forms gelu_out
// (the conversion in memory mode, GEMM1's epilogue for GEMM2) uses this one expression, so they agree bit for bit.
__device__ __forceinline__ float gelu_of(float z, float t) { return 0.5f * z * (1.0f + t); }

__device__ __forceinline__ void gelu(float z, float& t, float& g) {
  t = tanh_inner_of(z);
  g = gelu_of(z, t);
}

}  // namespace cupyffn
