// Conversion of fp32 operands into the 16-bit formats the GEMMs read (see common.cuh).
//
// One launch converts up to kMaxJobs matrices, each as (row, chunk) work items (RowChunks in
// common.cuh). Job k owns blocks [block_begin, block_begin + block_count), which take items
// b - block_begin, + block_count, ...
// Each thread moves 8 floats per item (two 16-byte loads, one 16-byte store per plane) when the
// job allows it, else one float. A dense job (kind 0, rows contiguous in source and destination, the
// usual case) is one flat array instead: consecutive threads take consecutive groups of 8 floats and
// each thread issues the loads of CUPYFFN_CONVERT_UNROLL groups before their stores, so that more
// bytes are in flight per thread and no item needs a 64-bit division to find its row.
// kind 1 computes gelu_out from linear1_out on the fly (the backward's memory mode, where the caller
// kept only the pre-activation). FMT_F32 writes plain floats (gelu_out for the "ieee" plan).
//
// FMT_F16S runs twice per call: a gathering pass (rescue == 0) that converts with each slot's
// current exponent, gathers max |x| and lets its last block decide the exponents; then a rescue
// pass (rescue == 1, a small grid) that converts again only the slots whose exponent moved, and
// whose block 0 writes the alphas of the GEMMs in alpha_mask.
#include "common.cuh"

struct ConvertJob {
  const float* src;        // [rows, cols] fp32, row stride src_ld elements
  const float* src2;       // kind 1: tanh_inner (nullptr: recompute it from src)
  unsigned short* dst;     // 16-bit codes (FMT_F32: floats), row stride dst_ld elements
  long long src_ld;
  long long src2_ld;
  long long dst_ld;
  long long part_stride;   // FMT_BF16X3: elements between the three planes
  long long rows;
  int cols;
  int pattern;             // FMT_BF16X3: bit j set -> plane j holds lo
  int slot;                // FMT_F16S: scale slot
  int vec;                 // 1: cols % 8 == 0 and every row start is 16-byte aligned
  int block_begin;
  int block_count;
  int kind;                // 0: convert src; 1: convert gelu_out = 0.5 x (1 + t) of x = src, t = src2
  int unused;
};
static_assert(sizeof(ConvertJob) == 96, "ConvertJob layout is mirrored in cupyffn/cuda/kernels.py");

// The value converted at src[c] (kind 0), or the GELU output recomputed from linear1_out (kind 1).
__device__ __forceinline__ float gelu_out_of(const ConvertJob& job, const float* x, long long r, int c) {
  const float z = __ldcs(x);
  float t, g;
  if (job.src2 != nullptr) {
    t = __ldcs(job.src2 + r * job.src2_ld + c);
    g = cupyffn::gelu_of(z, t);
  } else {
    cupyffn::gelu(z, t, g);
  }
  return g;
}

// Groups of 8 floats whose loads a thread issues before their stores on the dense path. A macro, not a
// template parameter, so that an A/B can compile other values with -D (decision 010). 2: on the
// H200 the gathering passes of every T summed 0.964x the (row, chunk) kernel's time (1, 4, 8: 0.975, 0.989,
// 1.018; engine grid of 2 waves; docs/decisions/010-convert-dense-path.md). All builds write the same bits.
#ifndef CUPYFFN_CONVERT_UNROLL
#define CUPYFFN_CONVERT_UNROLL 2
#endif
// 0: every job takes the (row, chunk) path (the dense path off, decision 010's A/B).
#ifndef CUPYFFN_CONVERT_DENSE
#define CUPYFFN_CONVERT_DENSE 1
#endif

// The codes of 8 consecutive floats x at element offset `at` of the job's destination (FMT_F32: the floats).
template <int FMT>
__device__ __forceinline__ void put8(const ConvertJob& job, const float (&x)[8], long long at, float scale,
                                     float& amax) {
  if constexpr (FMT == FMT_F32) {
    float4* out = reinterpret_cast<float4*>(reinterpret_cast<float*>(job.dst) + at);
    __stcg(out, make_float4(x[0], x[1], x[2], x[3]));
    __stcg(out + 1, make_float4(x[4], x[5], x[6], x[7]));
  } else {
    cupyffn::write_operand<FMT, 8>(x, job.dst + at, job.part_stride, job.pattern, scale, amax);
  }
}

// A dense job: rows * cols floats (cols % 8 == 0, 16-byte aligned) as rows * cols / 8 groups; this block's
// threads take groups g, g + step, ... (step = the job's threads), U at a time: U loads, then U stores.
template <int FMT>
__device__ __forceinline__ void convert_dense(const ConvertJob& job, float scale, float& amax) {
  constexpr int U = CUPYFFN_CONVERT_UNROLL;
  const long long groups = job.rows * job.cols / 8;
  const long long step = (long long)job.block_count * blockDim.x;
  long long g = (long long)((int)blockIdx.x - job.block_begin) * blockDim.x + threadIdx.x;
  for (; g + (U - 1) * step < groups; g += U * step) {
    cupyffn::F8 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = cupyffn::load8_stream(job.src + 8 * (g + u * step));
#pragma unroll
    for (int u = 0; u < U; ++u) put8<FMT>(job, x[u].v, 8 * (g + u * step), scale, amax);
  }
  for (; g < groups; g += step) {
    const cupyffn::F8 x = cupyffn::load8_stream(job.src + 8 * g);
    put8<FMT>(job, x.v, 8 * g, scale, amax);
  }
}

#define kMaxJobs 5
struct ConvertJobs {
  ConvertJob job[kMaxJobs];
  int count;
  int rescue;      // FMT_F16S: 0 gathering pass, 1 rescue pass
  int counter;     // FMT_F16S: arrival counter of this launch (state[3 * kSlots + counter])
  int slot_mask;   // FMT_F16S: slots this launch decides
  int alpha_mask;  // FMT_F16S: GEMM alphas the rescue pass writes
  int unused;
};
static_assert(sizeof(ConvertJobs) == 96 * kMaxJobs + 24, "ConvertJobs layout is mirrored in cupyffn/cuda/kernels.py");

template <int FMT>
__global__ void __launch_bounds__(256) convert_kernel(const __grid_constant__ ConvertJobs jobs, int* state,
                                                      float* consts) {
  int k = 0;
  while (k + 1 < jobs.count && (int)blockIdx.x >= jobs.job[k + 1].block_begin) ++k;
  const ConvertJob& job = jobs.job[k];

  float scale = 1.0f;
  if constexpr (FMT == FMT_F16S) {
    if (jobs.rescue) {
      cupyffn::write_alphas(state, consts, jobs.alpha_mask);
      if (state[2 * kSlots + job.slot] == 0) return;  // uniform across the block
    }
    scale = ldexpf(1.0f, state[job.slot]);
  }
  float amax = 0.0f;
  const int cols = job.cols;
  const bool dense = CUPYFFN_CONVERT_DENSE && job.vec && job.kind == 0 && job.src_ld == cols && job.dst_ld == cols;
  const cupyffn::RowChunks items(job.rows, cols, job.vec);
  if (dense) convert_dense<FMT>(job, scale, amax);
  for (long long w = (int)blockIdx.x - job.block_begin; !dense && w < items.count; w += job.block_count) {
    long long r;
    int c;
    items.locate(w, r, c);
    if (c >= cols) continue;
    const float* src = job.src + r * job.src_ld + c;
    if (job.vec) {
      cupyffn::F8 x;
      if (job.kind == 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) x.v[i] = gelu_out_of(job, src + i, r, c + i);
      } else {
        x = cupyffn::load8_stream(src);
      }
      put8<FMT>(job, x.v, r * job.dst_ld + c, scale, amax);
    } else {
      const float x[1] = {job.kind == 1 ? gelu_out_of(job, src, r, c) : __ldcs(src)};
      if constexpr (FMT == FMT_F32) {
        reinterpret_cast<float*>(job.dst)[r * job.dst_ld + c] = x[0];
      } else {
        cupyffn::write_operand<FMT, 1>(x, job.dst + r * job.dst_ld + c, job.part_stride, job.pattern, scale, amax);
      }
    }
  }
  if constexpr (FMT == FMT_F16S) {
    if (!jobs.rescue) {
      cupyffn::block_absmax_to(reinterpret_cast<unsigned int*>(state + kSlots + job.slot), amax);
      cupyffn::last_block_decides(state, jobs.counter, jobs.slot_mask);
    }
  }
}
