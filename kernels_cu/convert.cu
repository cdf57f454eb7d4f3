// Conversion of fp32 operands into the 16-bit formats the GEMMs read (see common.cuh).
//
// One launch converts up to kMaxJobs matrices, each as (row, chunk) work items (RowChunks in
// common.cuh). Job k owns blocks [block_begin, block_begin + block_count), which take items
// b - block_begin, + block_count, ...
// Each thread moves 8 floats per item (two 16-byte loads, one 16-byte store per plane) when the
// job allows it, else one float.
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
static_assert(sizeof(ConvertJob) == 96, "ConvertJob layout is mirrored in cupyffn/_kernels.py");

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
static_assert(sizeof(ConvertJobs) == 96 * kMaxJobs + 24, "ConvertJobs layout is mirrored in cupyffn/_kernels.py");

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
  const cupyffn::RowChunks items(job.rows, cols, job.vec);
  for (long long w = (int)blockIdx.x - job.block_begin; w < items.count; w += job.block_count) {
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
      if constexpr (FMT == FMT_F32) {
        float4* out = reinterpret_cast<float4*>(reinterpret_cast<float*>(job.dst) + r * job.dst_ld + c);
        __stcg(out, make_float4(x.v[0], x.v[1], x.v[2], x.v[3]));
        __stcg(out + 1, make_float4(x.v[4], x.v[5], x.v[6], x.v[7]));
      } else {
        cupyffn::write_operand<FMT, 8>(x.v, job.dst + r * job.dst_ld + c, job.part_stride, job.pattern, scale, amax);
      }
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
