// Forward GELU(tanh), fused: read linear1_out z once, write the two saved tensors
//   tanh_inner = tanh(sqrt(2/pi) * (z + 0.044715 z^3)),  gelu_out = 0.5 * z * (1 + tanh_inner)
// (fp32, the caller's arrays) and gelu_out again as the operand of the second GEMM
// (output = gelu_out @ weight2^T) in the plan's format. FMT_F32 ("ieee") writes no operand: that
// GEMM reads gelu_out itself. FMT_F16S gathers max |gelu_out| and its last block decides the scale;
// the rescue pass is a convert.cu launch that re-reads gelu_out.
// With bias1 (job.bias): z = linear1_out + bias1 is written back into linear1_out first (the saved pre-activation
// includes the bias, as the backward expects).
#include "common.cuh"

struct GeluForwardJob {
  float* z;                // linear1_out [rows, cols] (bias1 added in place when bias is given)
  float* t;                // tanh_inner (output)
  float* g;                // gelu_out (output)
  unsigned short* dst;     // operand planes of gelu_out (not FMT_F32)
  long long z_ld;
  long long t_ld;
  long long g_ld;
  long long dst_ld;
  long long part_stride;
  long long rows;
  int cols;
  int pattern;
  int slot;
  int vec;                 // 1: cols % 8 == 0 and every row start is 16-byte aligned
  int counter;             // FMT_F16S: arrival counter of this launch
  int unused;
  const float* bias;       // bias1 [cols] or nullptr (16-byte aligned when vec)
};
static_assert(sizeof(GeluForwardJob) == 112, "GeluForwardJob layout is mirrored in cupyffn/cuda/kernels.py");

template <int FMT>
__global__ void __launch_bounds__(256, 6) gelu_forward_kernel(const __grid_constant__ GeluForwardJob job, int* state) {
  float scale = 1.0f;
  if constexpr (FMT == FMT_F16S) scale = ldexpf(1.0f, state[job.slot]);
  float amax = 0.0f;
  const int cols = job.cols;
  const cupyffn::RowChunks items(job.rows, cols, job.vec);
  for (long long w = blockIdx.x; w < items.count; w += gridDim.x) {
    long long r;
    int c;
    items.locate(w, r, c);
    if (c >= cols) continue;
    float* tr = job.t + r * job.t_ld + c;
    float* gr = job.g + r * job.g_ld + c;
    if (job.vec) {
      cupyffn::F8 z = cupyffn::load8_stream(job.z + r * job.z_ld + c);
      if (job.bias != nullptr) {
        const float4 b0 = __ldg(reinterpret_cast<const float4*>(job.bias + c));
        const float4 b1 = __ldg(reinterpret_cast<const float4*>(job.bias + c) + 1);
        z.v[0] += b0.x; z.v[1] += b0.y; z.v[2] += b0.z; z.v[3] += b0.w;
        z.v[4] += b1.x; z.v[5] += b1.y; z.v[6] += b1.z; z.v[7] += b1.w;
        float4* zr = reinterpret_cast<float4*>(job.z + r * job.z_ld + c);
        __stcs(zr, make_float4(z.v[0], z.v[1], z.v[2], z.v[3]));
        __stcs(zr + 1, make_float4(z.v[4], z.v[5], z.v[6], z.v[7]));
      }
      float t[8], g[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) cupyffn::gelu(z.v[i], t[i], g[i]);
      __stcs(reinterpret_cast<float4*>(tr), make_float4(t[0], t[1], t[2], t[3]));  // saved for the backward
      __stcs(reinterpret_cast<float4*>(tr) + 1, make_float4(t[4], t[5], t[6], t[7]));
      __stcg(reinterpret_cast<float4*>(gr), make_float4(g[0], g[1], g[2], g[3]));  // read again by GEMM (ieee)
      __stcg(reinterpret_cast<float4*>(gr) + 1, make_float4(g[4], g[5], g[6], g[7]));
      if constexpr (FMT != FMT_F32) {
        cupyffn::write_operand<FMT, 8>(g, job.dst + r * job.dst_ld + c, job.part_stride, job.pattern, scale, amax);
      }
    } else {
      float t[1], g[1];
      float z = __ldcs(job.z + r * job.z_ld + c);
      if (job.bias != nullptr) {
        z += __ldg(job.bias + c);
        job.z[r * job.z_ld + c] = z;
      }
      cupyffn::gelu(z, t[0], g[0]);
      *tr = t[0];
      *gr = g[0];
      if constexpr (FMT != FMT_F32) {
        cupyffn::write_operand<FMT, 1>(g, job.dst + r * job.dst_ld + c, job.part_stride, job.pattern, scale, amax);
      }
    }
  }
  if constexpr (FMT == FMT_F16S) {
    cupyffn::block_absmax_to(reinterpret_cast<unsigned int*>(state + kSlots + job.slot), amax);
    cupyffn::last_block_decides(state, job.counter, 1 << job.slot);
  }
}
