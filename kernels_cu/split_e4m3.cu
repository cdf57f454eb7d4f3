// Conversion of fp32 operands for the "fp16+fp8" plan (issue 9): per element x of a slot with
// exponent e (the FMT_F16S scale machinery of common.cuh / convert.cu):
//   s = x * 2^e,  hi = fp16_rn(s),  fin = isfinite(float(hi)),  lo = fin ? s - float(hi) : 0
//   H8 = fin ? e4m3_rn_satfinite(s * 2^-7) : 0,  L8 = fin ? e4m3_rn_satfinite(lo * 2^4) : 0
// (isfinite(float(hi)) implies isfinite(s): fp16_rn maps Inf/NaN to Inf/NaN.)
//
// Each job (one matrix X[rows, cols]) writes any subset of (nullptr = skipped):
//   f16  hi, natural [rows, cols], row stride f16_ld elements
//   x3   bf16x3 planes of x (unscaled), exactly FMT_BF16X3's write_operand (common.cuh)
//   e4n  e4m3 pair natural:    [rows, 2 * e4n_kpad] bytes, X[r, k] at row r
//   e4t  e4m3 pair transposed: [cols, 2 * e4t_kpad] bytes, X[k, c] at row c
// e4 rows hold (order 0) L8 in columns [0, K) and H8 in [kpad, kpad + K), or (order 1) H8 first.
// Padding columns [K, kpad) and [kpad + K, 2 kpad) are never written.
//
// KIND 0 (convert): X = src (job kind 0), or gelu_out = 0.5 z (1 + t) of z = src, t = src2
// (nullptr: recomputed), as convert.cu's kind 1. KIND 1 (dgelu): X = grad_gelu * gelu'(z, t) of
// grad_gelu = src, z = src2, t = src3 (nullptr: recomputed), as dgelu.cu.
//
// Work: steps of 64 columns x NB 64-row sub-tiles (NB per variant, below), grid-stride over
// the job's steps (job k owns blocks [block_begin, block_begin + block_count), as in convert.cu). In each
// sub-tile thread t holds a 4 x 4 block (rows 4 rg.., cols 4 cg..): a warp reads 4 rows x 128
// contiguous bytes per 16-byte load, and all loads of a step are issued before any value is used.
// Natural outputs go straight from registers; the transposed pair goes through shared memory
// (double-buffered: one barrier per step), laid out so that both its 4-byte writes and its 16-byte reads are free of bank
// conflicts, and leaves as 16-byte row segments (64 bytes per output row per tile and warp).
//
// Instantiation split_e4m3_kernel<ID>: KIND = ID % 10, scheduling variant = ID / 10 (split::Variant, one per
// KIND; the variants measured wrote the same bytes and differed only in scheduling): NB sub-tiles per step, MINB
// resident blocks for ptxas (__launch_bounds__), PIPE 1 = software-pipelined: the next step's loads are issued
// right after this step's values are formed, so they are in flight during its encoding, stores and barrier.
//
// Scales as convert.cu: the gathering pass (rescue == 0) converts with 2^state[slot], folds max |x|
// into state[kSlots + slot] and lets its last block decide; the rescue pass (rescue == 1, a small
// grid) writes the alphas of alpha_mask (block 0) and converts again, all encodings, only the jobs
// whose slot was flagged.
#include "common.cuh"
#include <cuda_fp8.h>

struct SplitJob {
  const float* src;        // KIND 0: the matrix (kind 0) or linear1_out (kind 1); KIND 1: grad_gelu
  const float* src2;       // KIND 0 kind 1: tanh_inner (nullptr: recomputed); KIND 1: linear1_out
  const float* src3;       // KIND 1: tanh_inner (nullptr: recomputed from src2)
  unsigned short* f16;     // fp16 codes of x * 2^e
  unsigned short* x3;      // bf16x3 planes at x3, x3 + x3_part_stride, x3 + 2 * x3_part_stride
  unsigned char* e4n;      // e4m3 pair, natural
  unsigned char* e4t;      // e4m3 pair, transposed
  long long src_ld;        // row strides of the sources (elements)
  long long src2_ld;
  long long src3_ld;
  long long f16_ld;        // elements
  long long x3_ld;         // elements
  long long x3_part_stride;
  long long e4n_ld;        // bytes, a multiple of 16
  long long e4t_ld;        // bytes, a multiple of 16
  long long rows;
  int cols;
  int x3_pattern;          // bit j set -> plane j holds lo
  int e4n_kpad;            // >= cols, a multiple of 16
  int e4n_order;           // 0: L8 first, 1: H8 first
  int e4t_kpad;            // >= rows, a multiple of 16
  int e4t_order;
  int slot;                // scale slot
  int kind;                // KIND 0: 0 convert src, 1 gelu_out from linear1_out
  int vec;                 // 1: cols % 4 == 0 and every source row start is 16-byte aligned
  int vec_out;             // 1: f16 / x3 rows (and planes) start 8-byte aligned: 8-byte stores
  int block_begin;
  int block_count;
};
static_assert(sizeof(SplitJob) == 176, "SplitJob layout is mirrored in cupyffn/cuda/kernels.py");

#define kSplitMaxJobs 5
struct SplitJobs {
  SplitJob job[kSplitMaxJobs];
  int count;
  int rescue;      // 0 gathering pass, 1 rescue pass
  int counter;     // arrival counter of this launch (state[3 * kSlots + counter])
  int slot_mask;   // slots this launch decides
  int alpha_mask;  // GEMM alphas the rescue pass writes
  int unused;
  float* colsum;   // KIND 1, gathering pass: [row tiles, cols] column sums of X per step's rows (nullptr: none)
};
static_assert(sizeof(SplitJobs) == 176 * kSplitMaxJobs + 32, "SplitJobs layout is mirrored in cupyffn/cuda/kernels.py");

namespace split {

constexpr int kTile = 64;

// e4m3 "fn" codes of a (low byte) and b: nearest even, |v| > 448 -> +-448 (one cvt on sm_89+).
__device__ __forceinline__ unsigned int e4m3x2_bits(float a, float b) {
  return (unsigned int)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// Word of tile column c (0..63), rows 4 rg .. 4 rg + 3 (rg 0..15), in one 1024-word staging plane.
// Two columns share a 32-word bank row; which half a column takes and an XOR of its row groups
// (both fixed per 4 columns, so 16-byte groups stay whole) spread a warp's writes (8 column groups x
// 4 row groups) and reads (8 lanes: 2 columns x 4 row segments) over all banks.
__device__ __forceinline__ int stage_word(int c, int rg) {
  return 32 * (c >> 1) + 16 * ((c ^ (c >> 2)) & 1) + (rg ^ (((c >> 3) & 3) << 2));
}

// Row j (0 .. 4 NB - 1) of a thread's values lies row_off(j) rows below its first row: NB
// 64-row sub-tiles stacked, each with the 4 x 4 thread mapping.
__device__ __forceinline__ constexpr int row_off(int j) { return (j & 3) + kTile * (j >> 2); }

// v[j][i] = p[(r + row_off(j)) * ld + c + i], 0 outside [rows, cols). No value is used before all
// loads are issued.
template <int R>
__device__ __forceinline__ void load_block(const float* p, long long ld, long long r, int c, long long rows,
                                           int cols, int vec, float (&v)[R][4]) {
  if (vec) {  // cols % 4 == 0: a group of 4 is wholly inside or outside
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const long long rr = r + row_off(j);
      float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (rr < rows && c < cols) a = __ldcs(reinterpret_cast<const float4*>(p + rr * ld + c));
      v[j][0] = a.x; v[j][1] = a.y; v[j][2] = a.z; v[j][3] = a.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const long long rr = r + row_off(j);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float a = 0.0f;
        if (rr < rows && c + i < cols) a = __ldcs(p + rr * ld + c + i);
        v[j][i] = a;
      }
    }
  }
}

// The raw source values of this thread's rows (see the file comment for the kinds): a = src, b = src2
// (KIND 0: only for job kind 1 with tanh_inner given), t = src3 (KIND 1, when given).
template <int R>
struct Sources {
  float a[R][4], b[R][4], t[R][4];
};

template <int KIND, int R>
__device__ __forceinline__ void load_sources(const SplitJob& job, long long r, int c, Sources<R>& s) {
  const long long rows = job.rows;
  const int cols = job.cols;
  load_block<R>(job.src, job.src_ld, r, c, rows, cols, job.vec, s.a);
  if constexpr (KIND == 0) {
    if (job.kind == 1 && job.src2 != nullptr) load_block<R>(job.src2, job.src2_ld, r, c, rows, cols, job.vec, s.b);
  } else {
    load_block<R>(job.src2, job.src2_ld, r, c, rows, cols, job.vec, s.b);
    if (job.src3 != nullptr) load_block<R>(job.src3, job.src3_ld, r, c, rows, cols, job.vec, s.t);
  }
}

// The matrix values from the raw sources (the same expressions in every variant: the same bits).
template <int KIND, int R>
__device__ __forceinline__ void combine(const SplitJob& job, const Sources<R>& s, float (&x)[R][4]) {
  if constexpr (KIND == 0) {
    if (job.kind == 1) {
      float b[R][4];
      if (job.src2 != nullptr) {
#pragma unroll
        for (int j = 0; j < R; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) b[j][i] = s.b[j][i];
      } else {
#pragma unroll
        for (int j = 0; j < R; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) b[j][i] = cupyffn::tanh_inner_of(s.a[j][i]);
      }
#pragma unroll
      for (int j = 0; j < R; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) x[j][i] = 0.5f * s.a[j][i] * (1.0f + b[j][i]);  // as convert.cu's gelu_out_of
    } else {
#pragma unroll
      for (int j = 0; j < R; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) x[j][i] = s.a[j][i];
    }
  } else {
    float t[R][4];
    if (job.src3 != nullptr) {
#pragma unroll
      for (int j = 0; j < R; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) t[j][i] = s.t[j][i];
    } else {
#pragma unroll
      for (int j = 0; j < R; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) t[j][i] = cupyffn::tanh_inner_of(s.b[j][i]);
    }
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) x[j][i] = s.a[j][i] * cupyffn::gelu_grad(s.b[j][i], t[j][i]);  // as dgelu.cu
  }
}

// 4 consecutive 16-bit codes at p: one 8-byte store when aligned and whole, else those inside.
__device__ __forceinline__ void store4(unsigned short* p, const unsigned short (&h)[4], bool whole, int n) {
  if (whole) {
    __stcg(reinterpret_cast<uint2*>(p), make_uint2(cupyffn::pack2(h[0], h[1]), cupyffn::pack2(h[2], h[3])));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (i < n) p[i] = h[i];
  }
}

// 4 consecutive bytes (a word, low byte first) at p: one 4-byte store when whole, else those inside.
__device__ __forceinline__ void store4b(unsigned char* p, unsigned int w, int n) {
  if (n >= 4) {
    __stcg(reinterpret_cast<unsigned int*>(p), w);
  } else {
#pragma unroll
    for (int i = 0; i < 3; ++i)
      if (i < n) p[i] = (unsigned char)(w >> (8 * i));
  }
}

// Scheduling of instantiation ID (ID = 10 * variant + KIND; cupyffn/cuda/kernels.py SPLIT_VARIANT names the one per
// KIND, docs/decisions/011-split-e4m3-schedules.md). Loads in flight per thread: 64 bytes per source and sub-tile;
// per SM that times 256 * MINB threads.
template <int ID>
struct Variant;
// KIND 1, variant 0 (the first kernel): one sub-tile per step (three sources: 192 bytes per thread), 2 blocks per
// SM; loads, then encode and stores, then the next loads.
template <> struct Variant<1> { static constexpr int NB = 1, MINB = 2, PIPE = 0; };
// KIND 0, variant 1: pipelined, one sub-tile per step at 3 blocks per SM (80 registers).
template <> struct Variant<10> { static constexpr int NB = 1, MINB = 3, PIPE = 1; };

}  // namespace split

template <int ID>
__global__ void __launch_bounds__(256, split::Variant<ID>::MINB) split_e4m3_kernel(const __grid_constant__ SplitJobs jobs,
                                                                                 int* state, float* consts) {
  using namespace split;
  constexpr int KIND = ID % 10;
  constexpr int NB = Variant<ID>::NB;      // 64-row sub-tiles per step
  constexpr bool PIPE = Variant<ID>::PIPE != 0;
  constexpr int R = 4 * NB;                // rows per thread
  int k = 0;
  while (k + 1 < jobs.count && (int)blockIdx.x >= jobs.job[k + 1].block_begin) ++k;
  const SplitJob& job = jobs.job[k];

  if (jobs.rescue) {
    cupyffn::write_alphas(state, consts, jobs.alpha_mask);
    if (state[2 * kSlots + job.slot] == 0) return;  // uniform across the block
  }
  const float scale = ldexpf(1.0f, state[job.slot]);

  // [buffer][sub-tile][0: L8, 1: H8][stage_word]
  __shared__ __align__(16) unsigned int stage[2][NB][2][kTile * kTile / 4];

  const int tid = threadIdx.x;
  const int cg = (tid & 7) | ((tid >> 2) & 8);          // a warp: 8 consecutive column groups,
  const int rg = ((tid >> 3) & 3) | ((tid >> 4) & 12);  // 4 consecutive row groups
  const long long rows = job.rows;
  const int cols = job.cols;
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = (rows + NB * kTile - 1) / (NB * kTile) * tiles_c;
  const int n_off = job.e4n_order ? job.e4n_kpad : 0;  // byte offsets of L8 and H8 in an e4 row
  const int n_hoff = job.e4n_order ? 0 : job.e4n_kpad;
  const int t_off = job.e4t_order ? job.e4t_kpad : 0;
  const int t_hoff = job.e4t_order ? 0 : job.e4t_kpad;
  // Top-left element of step `tile`'s tile (rows past the end for tile >= tiles: nothing loaded there).
  auto origin = [&](long long tile, long long& r0, int& c0) {
    const long long tr = tile / tiles_c;
    r0 = tr * (NB * kTile);
    c0 = (int)(tile - tr * tiles_c) * kTile;
  };
  float amax = 0.0f;
  __shared__ float part[KIND == 1 ? 2 : 1][16][kTile];  // jobs.colsum: a step's column sums per row group
  int sbuf = 0;
  int buf = 0;
  Sources<R> src;
  long long tile = (int)blockIdx.x - job.block_begin;
  if constexpr (PIPE) {
    long long r0;
    int c0;
    origin(tile, r0, c0);
    load_sources<KIND, R>(job, r0 + 4 * rg, c0 + 4 * cg, src);
  }
  for (; tile < tiles; tile += job.block_count) {
    long long r0;
    int c0;
    origin(tile, r0, c0);
    const long long r = r0 + 4 * rg;
    const int c = c0 + 4 * cg;

    if constexpr (!PIPE) load_sources<KIND, R>(job, r, c, src);
    float x[R][4];
    combine<KIND, R>(job, src, x);
    if constexpr (KIND == 1) {
      // grad_bias1's partial sums: this step's column sums over its rows (each step is one block's, so the
      // partial rows do not depend on the grid), its 16 row groups added in order; kernels_cu/bias.cu adds the
      // rows of all steps (a fixed order: bit-identical sums). Double-buffered: one barrier per step.
      if (jobs.colsum != nullptr && !jobs.rescue) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float t = 0.0f;
#pragma unroll
          for (int j = 0; j < R; ++j) t += x[j][i];  // rows outside the matrix were loaded as 0: x = 0
          part[sbuf][rg][4 * cg + i] = t;
        }
        __syncthreads();
        if (tid < kTile && c0 + tid < cols) {
          float t = part[sbuf][0][tid];
#pragma unroll
          for (int g = 1; g < 16; ++g) t += part[sbuf][g][tid];
          jobs.colsum[(tile / tiles_c) * cols + c0 + tid] = t;
        }
        sbuf ^= 1;
      }
    }
    if constexpr (PIPE) {  // the next step's loads, in flight while this step encodes and stores
      long long rn;
      int cn;
      origin(tile + job.block_count, rn, cn);
      load_sources<KIND, R>(job, rn + 4 * rg, cn + 4 * cg, src);
    }

    // Row by row: encode, write the natural outputs straight from registers, keep the e4m3 words.
    unsigned int l8[R], h8[R];  // per row j: the codes of columns c .. c + 3, low byte first
    const int n = min(4, cols - c);  // columns of this thread inside the matrix (may be <= 0)
    const bool whole = job.vec_out && n == 4;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      unsigned short hi[4];
      float lin[4], hin[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        amax = cupyffn::finite_absmax(amax, x[j][i]);
        const float s = x[j][i] * scale;
        const __half h = __float2half_rn(s);  // = f16_bits(x * scale), FMT_F16S's rounding
        hi[i] = __half_as_ushort(h);
        const float hf = __half2float(h);
        const bool fin = fabsf(hf) <= 65504.0f;  // false for Inf and NaN
        hin[i] = fin ? s * 0.0078125f : 0.0f;    // s * 2^-7
        lin[i] = fin ? (s - hf) * 16.0f : 0.0f;  // s - hf is exact
      }
      l8[j] = e4m3x2_bits(lin[0], lin[1]) | (e4m3x2_bits(lin[2], lin[3]) << 16);
      h8[j] = e4m3x2_bits(hin[0], hin[1]) | (e4m3x2_bits(hin[2], hin[3]) << 16);
      const long long rr = r + row_off(j);
      if (n > 0 && rr < rows) {
        if (job.f16 != nullptr) store4(job.f16 + rr * job.f16_ld + c, hi, whole, n);
        if (job.x3 != nullptr) {
          unsigned short bh[4], bl[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) cupyffn::split_bf16(x[j][i], bh[i], bl[i]);
          unsigned short* p = job.x3 + rr * job.x3_ld + c;
#pragma unroll
          for (int plane = 0; plane < 3; ++plane) {
            // Branch rather than pick an array through a pointer (see write_operand in common.cuh).
            if ((job.x3_pattern >> plane) & 1) {
              store4(p + plane * job.x3_part_stride, bl, whole, n);
            } else {
              store4(p + plane * job.x3_part_stride, bh, whole, n);
            }
          }
        }
        if (job.e4n != nullptr) {
          unsigned char* p = job.e4n + rr * job.e4n_ld + c;
          store4b(p + n_off, l8[j], n);
          store4b(p + n_hoff, h8[j], n);
        }
      }
    }
    // Transposed pair: column words (4 rows of one column) into shared memory, then rows of 16 bytes out.
    if (job.e4t != nullptr) {
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        unsigned int* sl = stage[buf][b][0];
        unsigned int* sh = stage[buf][b][1];
        const unsigned int* L = l8 + 4 * b;
        const unsigned int* H = h8 + 4 * b;
        // 4 x 4 byte transpose: row words (byte i = column i) -> column words (byte j = row j).
        const unsigned int a0 = __byte_perm(L[0], L[1], 0x5140), a1 = __byte_perm(L[0], L[1], 0x7362);
        const unsigned int a2 = __byte_perm(L[2], L[3], 0x5140), a3 = __byte_perm(L[2], L[3], 0x7362);
        sl[stage_word(4 * cg + 0, rg)] = __byte_perm(a0, a2, 0x5410);
        sl[stage_word(4 * cg + 1, rg)] = __byte_perm(a0, a2, 0x7632);
        sl[stage_word(4 * cg + 2, rg)] = __byte_perm(a1, a3, 0x5410);
        sl[stage_word(4 * cg + 3, rg)] = __byte_perm(a1, a3, 0x7632);
        const unsigned int b0 = __byte_perm(H[0], H[1], 0x5140), b1 = __byte_perm(H[0], H[1], 0x7362);
        const unsigned int b2 = __byte_perm(H[2], H[3], 0x5140), b3 = __byte_perm(H[2], H[3], 0x7362);
        sh[stage_word(4 * cg + 0, rg)] = __byte_perm(b0, b2, 0x5410);
        sh[stage_word(4 * cg + 1, rg)] = __byte_perm(b0, b2, 0x7632);
        sh[stage_word(4 * cg + 2, rg)] = __byte_perm(b1, b3, 0x5410);
        sh[stage_word(4 * cg + 3, rg)] = __byte_perm(b1, b3, 0x7632);
      }
      __syncthreads();  // the other buffer was last read before the previous step's barrier
      const int cl = tid >> 2, q = tid & 3;  // output row c0 + cl; X rows .. + 16 q .. + 15 of each sub-tile
      if (c0 + cl < cols) {
        unsigned char* p = job.e4t + (long long)(c0 + cl) * job.e4t_ld;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          const long long orow = r0 + b * kTile + 16 * q;
          if (orow < rows) {
            const uint4 lw = *reinterpret_cast<const uint4*>(stage[buf][b][0] + stage_word(cl, 4 * q));
            const uint4 hw = *reinterpret_cast<const uint4*>(stage[buf][b][1] + stage_word(cl, 4 * q));
            if (orow + 16 <= rows) {
              __stcg(reinterpret_cast<uint4*>(p + t_off + orow), lw);
              __stcg(reinterpret_cast<uint4*>(p + t_hoff + orow), hw);
            } else {  // the matrix's last rows: only the bytes inside
              const int m = (int)(rows - orow);
              const unsigned int lv[4] = {lw.x, lw.y, lw.z, lw.w}, hv[4] = {hw.x, hw.y, hw.z, hw.w};
#pragma unroll
              for (int e = 0; e < 15; ++e) {
                if (e < m) {
                  p[t_off + orow + e] = (unsigned char)(lv[e >> 2] >> (8 * (e & 3)));
                  p[t_hoff + orow + e] = (unsigned char)(hv[e >> 2] >> (8 * (e & 3)));
                }
              }
            }
          }
        }
      }
      buf ^= 1;
    }
  }
  if (!jobs.rescue) {
    cupyffn::block_absmax_to(reinterpret_cast<unsigned int*>(state + kSlots + job.slot), amax);
    cupyffn::last_block_decides(state, jobs.counter, jobs.slot_mask);
  }
}
