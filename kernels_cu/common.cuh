// Device helpers shared by every cupyffn kernel.
//
// cupyffn/cuda/kernels.py pastes this file in place of `#include "common.cuh"` before handing a
// source to NVRTC, so CuPy's cache (keyed by the source text) sees every byte that was compiled.
//
// Operand formats (the numbers must match cupyffn/core/precision.py):
//   FMT_F32    plain fp32 (the "ieee" plan; only the GELU-derivative kernel writes it)
//   FMT_BF16   one bf16 part: bf16(x)
//   FMT_BF16X3 two bf16 parts hi = bf16(x), lo = bf16(x - hi) written as three 16-bit planes;
//              bit j of `pattern` chooses lo (1) or hi (0) for plane j, so a GEMM that stacks the
//              planes along K forms hi*hi' + hi*lo' + lo*hi' in one call
//   FMT_F16S   one fp16 part of x * 2^e, e a per-tensor exponent kept on the device (see convert.cu)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_BF16X3 2
#define FMT_F16S 3

// fp16 scale state (the "tf32" plan): one int array of 4 * kSlots entries.
//   state[s]              exponent e of slot s: the tensor is stored as fp16(x * 2^e)
//   state[kSlots + s]     bits of max |x| over the finite x converted into slot s (atomicMax)
//   state[2 * kSlots + s] 1 when the last pass moved e and slot s must be converted again
//   state[3 * kSlots + c] arrival counter of launch c (last-block-decides, reset by that block)
// consts[0] = 0, consts[1] = 1, consts[2 + g] = alpha of GEMM g (2^-(e_a + e_b); 1 for other plans).
#define kSlots 8

#include "activation.cuh"

namespace cupyffn {

// The fp16 codes of (a * scale, b * scale), a in the low half: one cvt.rn.f16x2.f32, the rounding of f16_bits.
__device__ __forceinline__ unsigned f16x2_bits(float a, float b, float scale) {
  const __half2 h = __floats2half2_rn(a * scale, b * scale);
  return *reinterpret_cast<const unsigned*>(&h);
}

// bf16(x) rounded to nearest even, except that a finite x beyond bf16's largest finite value is
// truncated instead of rounded to infinity, so that hi + lo still represents it. Written with
// selects, not branches, so that the compiler keeps all loads of a thread in flight together.
__device__ __forceinline__ unsigned short bf16_bits(float x) {
  const unsigned short rn = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  const unsigned short rz = (unsigned short)(__float_as_uint(x) >> 16);
  const bool overflowed = (rn & 0x7fffu) == 0x7f80u && fabsf(x) <= 3.402823466e38f;
  return overflowed ? rz : rn;
}

__device__ __forceinline__ float bf16_value(unsigned short bits) {
  return __uint_as_float((unsigned int)bits << 16);
}

// x = hi + lo + O(2^-17 |x|). x - hi is exact in fp32; lo is 0 for non-finite x so that an
// Inf or NaN input is carried by hi alone.
__device__ __forceinline__ void split_bf16(float x, unsigned short& hi, unsigned short& lo) {
  hi = bf16_bits(x);
  const unsigned short rest = bf16_bits(x - bf16_value(hi));
  lo = (hi & 0x7f80u) == 0x7f80u ? (unsigned short)0 : rest;
}

__device__ __forceinline__ unsigned short f16_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// max |x| over finite x (NaN and Inf are left out: they are not scaled, they propagate).
__device__ __forceinline__ float finite_absmax(float m, float x) {
  const float a = fabsf(x);
  return a <= 3.402823466e38f ? fmaxf(m, a) : m;
}

// Fold a per-thread maximum of non-negative floats into *dst: warp shuffles, then one shared-memory
// step, then one atomic per block (same-address atomics serialize in L2, so fewer is faster).
// Non-negative floats order like their bit patterns. Every thread of the block must call this.
__device__ __forceinline__ void block_absmax_to(unsigned int* dst, float m) {
  __shared__ float warp_max[32];
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < (int)(blockDim.x >> 5) ? warp_max[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0 && m > 0.0f) atomicMax(dst, __float_as_uint(m));
  }
}

// GEMM g multiplies the tensors in slots kGemmSlots[g][0] and kGemmSlots[g][1] (cupyffn/core/precision.py SLOT).
__device__ const int kGemmSlots[4][2] = {{0, 1}, {0, 2}, {5, 4}, {5, 3}};
// The GEMM partners whose exponents are final when slot s is decided: weight2 and gelu_out are
// decided after grad_output, grad_linear1 after weight1 and hidden_states.
__device__ const int kPartners[kSlots] = {0, 1 << 0, 1 << 0, 0, 0, (1 << 3) | (1 << 4), 0, 0};

// Check slot s's exponent against the maximum just gathered: the scaled maximum must lie in
// [2^8, 2^15) (no overflow, and 2^22 of headroom above fp16's smallest normal). If it does not,
// move the exponent so the maximum lands in [2^13, 2^14) and flag the slot for the rescue pass.
// The exponent is also capped so that e + e_partner <= 126 for every GEMM partner: the alpha
// 2^-(e + e_partner) then stays a normal float (a denormal alpha may be flushed to zero). The cap
// only bites when the product of the two tensors' maxima is below 2^-98, near fp32's own underflow.
__device__ __forceinline__ void f16_decide_slot(int* state, int s) {
  volatile int* exponent = state;
  const float amax = __uint_as_float(atomicExch(reinterpret_cast<unsigned int*>(state + kSlots + s), 0u));
  int cap = 127;
  for (int p = 0; p < kSlots; ++p) {
    if ((kPartners[s] >> p) & 1) cap = min(cap, 126 - exponent[p]);
  }
  int flag = 0;
  const int e = exponent[s];
  if (amax > 0.0f) {
    int k;
    frexpf(amax, &k);  // amax < 2^k <= 2 * amax
    const int wanted = max(min(14 - k, cap), -126);
    if (k + e < 9 || k + e > 15 || e > cap) {
      if (wanted != e) {
        exponent[s] = wanted;
        flag = 1;
      }
    }
  } else if (e > cap) {
    exponent[s] = cap;  // all zero (or non-finite): any exponent converts it exactly; keep alphas normal
  }
  state[2 * kSlots + s] = flag;
}

// f16_decide_slot for each slot in slot_mask, in slot order.
__device__ __forceinline__ void f16_decide_slots(int* state, int slot_mask) {
  for (int s = 0; s < kSlots; ++s) {
    if ((slot_mask >> s) & 1) f16_decide_slot(state, s);
  }
}

// Called by every block at the end of a first (gathering) pass: the last block to arrive decides
// the slots in slot_mask (all maxima are in by then) and resets the counter for the next call.
__device__ __forceinline__ void last_block_decides(int* state, int counter, int slot_mask) {
  __syncthreads();  // this block's atomicMax (block_absmax_to) has been issued
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(reinterpret_cast<unsigned int*>(state + 3 * kSlots + counter), 1u) != gridDim.x - 1) return;
  __threadfence();
  f16_decide_slots(state, slot_mask);
  state[3 * kSlots + counter] = 0;
}

// GEMM alphas 2^-(e_a + e_b) for the GEMMs in alpha_mask; written by block 0 of a rescue pass, when
// the exponents of both operands are final.
__device__ __forceinline__ void write_alphas(const int* state, float* consts, int alpha_mask) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int g = 0; g < 4; ++g) {
    if ((alpha_mask >> g) & 1) {
      const int sum = state[kGemmSlots[g][0]] + state[kGemmSlots[g][1]];
      consts[2 + g] = ldexpf(1.0f, -min(max(sum, -127), 126));  // a normal float, never 0 or inf
    }
  }
}

__device__ __forceinline__ unsigned int pack2(unsigned short a, unsigned short b) {
  return (unsigned int)a | ((unsigned int)b << 16);
}

// Work items of an elementwise kernel over [rows, cols]: (row, chunk) pairs, a chunk being the
// width * blockDim columns one block covers in one step (width 8 on the vector path, else 1), so that
// few long rows (weights, small T) still spread over many blocks.
struct RowChunks {
  int width, chunk, per_row;
  long long count;

  __device__ __forceinline__ RowChunks(long long rows, int cols, int vec)
      : width(vec ? 8 : 1), chunk(width * (int)blockDim.x), per_row((cols + chunk - 1) / chunk),
        count(rows * per_row) {}

  // Row of item w and the first column this thread handles in it (may be past the row's end).
  __device__ __forceinline__ void locate(long long w, long long& r, int& c) const {
    r = w / per_row;
    c = (int)(w - r * per_row) * chunk + width * (int)threadIdx.x;
  }
};

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
