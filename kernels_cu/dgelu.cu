// grad_linear1 = grad_gelu * gelu'(linear1_out, tanh_inner), written straight into the operand
// format of the two GEMMs that read it (grad_hidden = grad_linear1 @ weight1 and
// grad_weight1 = grad_linear1^T @ hidden_states). One pass: three fp32 reads, one write.
// FMT_F16S: gathering pass + rescue pass as in convert.cu.
#include "common.cuh"

struct DgeluJob {
  const float* grad_gelu;  // [rows, cols] fp32 (cupyffn scratch)
  const float* x;          // linear1_out
  const float* t;          // tanh_inner; nullptr: recomputed from x (memory mode)
  void* dst;               // FMT_F32: float*, may equal grad_gelu; else 16-bit codes
  long long grad_gelu_ld;
  long long x_ld;
  long long t_ld;
  long long dst_ld;
  long long part_stride;
  long long rows;
  int cols;
  int pattern;
  int slot;
  int vec;                 // 1: cols % 8 == 0 and every row start is 16-byte aligned
  int rescue;              // FMT_F16S: 0 gathering pass, 1 rescue pass
  int counter;             // FMT_F16S: arrival counter of this launch
  int alpha_mask;          // FMT_F16S: GEMM alphas the rescue pass writes
  int unused;
  float* colsum;           // dgelu_sums_kernel: [gridDim.x / per_row, cols] column sums of grad_linear1
};
static_assert(sizeof(DgeluJob) == 120, "DgeluJob layout is mirrored in cupyffn/cuda/kernels.py");

// SUMS (grad_bias1 wanted): the gathering pass also writes column sums of grad_linear1. The grid is a multiple of
// the row's chunk count (per_row), so every item of a block is the same chunk of columns and each thread sums its
// own columns over the block's rows, in order; block b writes row b / per_row of job.colsum, and
// kernels_cu/bias.cu's colsum_kernel adds those rows (a fixed order: bit-identical sums).
template <int FMT, bool SUMS>
__device__ __forceinline__ void dgelu_body(const DgeluJob& job, int* state, float* consts) {
  float scale = 1.0f;
  if constexpr (FMT == FMT_F16S) {
    if (job.rescue) {
      cupyffn::write_alphas(state, consts, job.alpha_mask);
      if (state[2 * kSlots + job.slot] == 0) return;  // uniform across the grid
    }
    scale = ldexpf(1.0f, state[job.slot]);
  }
  float amax = 0.0f;
  float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const int cols = job.cols;
  const cupyffn::RowChunks items(job.rows, cols, job.vec);
  for (long long w = blockIdx.x; w < items.count; w += gridDim.x) {
    long long r;
    int c;
    items.locate(w, r, c);
    if (c >= cols) continue;
    const float* gg = job.grad_gelu + r * job.grad_gelu_ld + c;
    const float* xr = job.x + r * job.x_ld + c;
    const float* tr = job.t != nullptr ? job.t + r * job.t_ld + c : nullptr;
    if (job.vec) {
      const cupyffn::F8 g = cupyffn::load8_stream(gg);
      const cupyffn::F8 x = cupyffn::load8_stream(xr);
      cupyffn::F8 t;
      if (job.t != nullptr) {
        t = cupyffn::load8_stream(tr);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) t.v[i] = cupyffn::tanh_inner_of(x.v[i]);
      }
      float d[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) d[i] = g.v[i] * cupyffn::gelu_grad(x.v[i], t.v[i]);
      if constexpr (SUMS) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] += d[i];
      }
      if constexpr (FMT == FMT_F32) {
        float4* out = reinterpret_cast<float4*>(static_cast<float*>(job.dst) + r * job.dst_ld + c);
        __stcg(out, make_float4(d[0], d[1], d[2], d[3]));  // intrinsic: see store_codes
        __stcg(out + 1, make_float4(d[4], d[5], d[6], d[7]));
      } else {
        unsigned short* out = static_cast<unsigned short*>(job.dst) + r * job.dst_ld + c;
        cupyffn::write_operand<FMT, 8>(d, out, job.part_stride, job.pattern, scale, amax);
      }
    } else {
      const float x = __ldcs(xr);
      const float t = job.t != nullptr ? __ldcs(tr) : cupyffn::tanh_inner_of(x);
      const float d[1] = {__ldcs(gg) * cupyffn::gelu_grad(x, t)};
      if constexpr (SUMS) sum[0] += d[0];
      if constexpr (FMT == FMT_F32) {
        static_cast<float*>(job.dst)[r * job.dst_ld + c] = d[0];
      } else {
        unsigned short* out = static_cast<unsigned short*>(job.dst) + r * job.dst_ld + c;
        cupyffn::write_operand<FMT, 1>(d, out, job.part_stride, job.pattern, scale, amax);
      }
    }
  }
  if constexpr (SUMS) {
    if (FMT != FMT_F16S || !job.rescue) {  // the rescue pass forms the same values again
      const int c = (int)(blockIdx.x % items.per_row) * items.chunk + items.width * (int)threadIdx.x;
      float* dst = job.colsum + (long long)(blockIdx.x / items.per_row) * cols + c;
#pragma unroll
      for (int i = 0; i < 8; ++i)  // a constant trip count keeps sum[] in registers
        if (i < items.width && c + i < cols) dst[i] = sum[i];
    }
  }
  if constexpr (FMT == FMT_F16S) {
    if (!job.rescue) {
      cupyffn::block_absmax_to(reinterpret_cast<unsigned int*>(state + kSlots + job.slot), amax);
      cupyffn::last_block_decides(state, job.counter, 1 << job.slot);
    }
  }
}

template <int FMT>
// 6 blocks of 256 per SM leave ptxas room to keep all six 16-byte loads of a thread in flight at
// once (at its default of 32 registers it issued two, waited, then four: 3.0 instead of 3.9 TB/s).
__global__ void __launch_bounds__(256, 6) dgelu_kernel(const __grid_constant__ DgeluJob job, int* state,
                                                    float* consts) {
  dgelu_body<FMT, false>(job, state, consts);
}

template <int FMT>
// Eight more registers per thread (the sums): at 6 blocks per SM ptxas spills them, at 5 it does not.
__global__ void __launch_bounds__(256, 5) dgelu_sums_kernel(const __grid_constant__ DgeluJob job, int* state,
                                                         float* consts) {
  dgelu_body<FMT, true>(job, state, consts);
}

// The decision after a fused GEMM1 + dgelu gathering launch (kernels_cu/gemm_sm90.cu gathers max |g| of
// grad_linear1 into the state, as dgelu_kernel's gathering pass does, and with kEpiDgeluF16G max |gelu_out|):
// one thread decides the slots in slot_mask, launched once the exponents of their GEMM partners (weight1,
// hidden_states; grad_output) are final; the fused rescue launch follows.
extern "C" __global__ void f16_decide_kernel(int* state, int slot_mask) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  cupyffn::f16_decide_slots(state, slot_mask);
}
