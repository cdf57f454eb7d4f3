// Device helpers shared by every cupyffn kernel.
//
// cupyffn/_kernels.py pastes this file in place of `#include "common.cuh"` before handing a
// source to NVRTC, so CuPy's cache (keyed by the source text) sees every byte that was compiled.
//
// Operand formats (the numbers must match cupyffn/_precision.py):
//   FMT_F32    plain fp32 (the "ieee" plan; only the GELU-derivative kernel writes it)
//   FMT_BF16   one bf16 part: bf16(x)
//   FMT_BF16X3 two bf16 parts hi = bf16(x), lo = bf16(x - hi) written as three 16-bit planes;
//              bit j of `pattern` chooses lo (1) or hi (0) for plane j, so a GEMM that stacks the
//              planes along K forms hi*hi' + hi*lo' + lo*hi' in one call
//   FMT_F16S   one fp16 part of x * 2^e, e a per-tensor exponent kept on the device (see f16_scale.cu)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_BF16X3 2
#define FMT_F16S 3

// Slots of the fp16 scale state: one int array of 3 * kSlots entries.
//   state[s]             exponent e of slot s (the tensor is stored as fp16(x * 2^e))
//   state[kSlots + s]    bits of max |x| over the finite x converted into slot s (atomicMax)
//   state[2 * kSlots + s] 1 when f16_decide changed e and the tensor must be converted again
#define kSlots 8

namespace cupyffn {

// GELU(tanh) derivative from the saved tanh output t = tanh(sqrt(2/pi) * (x + 0.044715 x^3)):
//   d/dx [0.5 x (1 + t)] = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
__device__ __forceinline__ float gelu_grad(float x, float t) {
  const float kSqrt2OverPi = 0.7978845608028654f;
  const float kCubicCoeff = 0.134145f;  // 3 * 0.044715
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + kCubicCoeff * x * x);
}

// bf16(x) rounded to nearest even, except that a finite x beyond bf16's largest finite value is
// truncated instead of rounded to infinity, so that hi + lo still represents it.
__device__ __forceinline__ unsigned short bf16_bits(float x) {
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  if (__isinf(__bfloat162float(h)) && isfinite(x)) h = __float2bfloat16_rz(x);
  return __bfloat16_as_ushort(h);
}

__device__ __forceinline__ float bf16_value(unsigned short bits) {
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

// x = hi + lo + O(2^-17 |x|). x - hi is exact in fp32; lo is 0 for non-finite x so that an
// Inf or NaN input is carried by hi alone.
__device__ __forceinline__ void split_bf16(float x, unsigned short& hi, unsigned short& lo) {
  hi = bf16_bits(x);
  const float h = bf16_value(hi);
  lo = isfinite(h) ? bf16_bits(x - h) : (unsigned short)0;
}

__device__ __forceinline__ unsigned short f16_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// max |x| over finite x (NaN and Inf are left out: they are not scaled, they propagate).
__device__ __forceinline__ float finite_absmax(float m, float x) {
  const float a = fabsf(x);
  return a <= 3.402823466e38f ? fmaxf(m, a) : m;
}

// Reduce a per-thread maximum of non-negative floats over the warp and fold it into *dst with one
// atomic per warp. Non-negative floats order like their bit patterns.
__device__ __forceinline__ void warp_absmax_to(unsigned int* dst, float m) {
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if ((threadIdx.x & 31) == 0 && m > 0.0f) atomicMax(dst, __float_as_uint(m));
}

__device__ __forceinline__ unsigned int pack2(unsigned short a, unsigned short b) {
  return (unsigned int)a | ((unsigned int)b << 16);
}

// Eight consecutive floats, loaded as two 16-byte streaming loads (each input is read once).
struct F8 {
  float v[8];
};

__device__ __forceinline__ F8 load8_stream(const float* p) {
  const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
  const float4 b = __ldcs(reinterpret_cast<const float4*>(p) + 1);
  F8 r;
  r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
  r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
  return r;
}

// N 16-bit codes at p: one 16-byte store when N == 8. The store goes through an intrinsic because
// NVRTC 12.9 split a plain `*(uint4*)p = w` into four 4-byte stores here; .cg keeps the data in L2,
// where the GEMM that reads it next finds it.
template <int N>
__device__ __forceinline__ void store_codes(unsigned short* p, const unsigned short (&c)[N]) {
  if constexpr (N == 8) {
    uint4 w;
    w.x = pack2(c[0], c[1]);
    w.y = pack2(c[2], c[3]);
    w.z = pack2(c[4], c[5]);
    w.w = pack2(c[6], c[7]);
    __stcg(reinterpret_cast<uint4*>(p), w);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = c[i];
  }
}

// Writes the 16-bit operand(s) of `n` values (N = 8 on the vector path, 1 otherwise) at dst.
// For FMT_BF16X3 the three planes go to dst, dst + part_stride, dst + 2 * part_stride.
template <int FMT, int N>
__device__ __forceinline__ void write_operand(const float (&x)[N], unsigned short* dst, long long part_stride,
                                              int pattern, float scale, float& amax) {
  if constexpr (FMT == FMT_BF16X3) {
    unsigned short hi[N], lo[N];
#pragma unroll
    for (int i = 0; i < N; ++i) split_bf16(x[i], hi[i], lo[i]);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      // Branch rather than pick an array through a pointer: that would put hi/lo in local memory.
      if ((pattern >> j) & 1) {
        store_codes<N>(dst + j * part_stride, lo);
      } else {
        store_codes<N>(dst + j * part_stride, hi);
      }
    }
  } else {
    unsigned short c[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if constexpr (FMT == FMT_F16S) {
        amax = finite_absmax(amax, x[i]);
        c[i] = f16_bits(x[i] * scale);
      } else {
        c[i] = bf16_bits(x[i]);
      }
    }
    store_codes<N>(dst, c);
  }
}

}  // namespace cupyffn
