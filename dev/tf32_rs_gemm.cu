// Measurement kernel (dev/tf32_rs_probe.py; not part of the package): GEMMs that read an fp32 weight as it is
// stored, with the weight as wgmma's register-sourced operand, so that neither a conversion pass nor a transposed
// copy is needed (issue 32's first option; docs/decisions/053-tf32-register-weight-probe.md).
//
//   C[N, M] (+= over a split of K) = alpha * B[N, K] @ W[K, M], fp32 accumulation, W fp32 in memory; two forms:
//   tf32rs::Form<BN, LAYOUT, MOVE_ONLY>  B fp32, products in tf32 (W rounded with cvt.rna)
//   mixedrs::Form                        B fp16 (converted beforehand), W * w_scale rounded to fp16 in registers
//
// GEMM1 of the backward is grad_gelu[T, H] = grad_output[T, D] @ weight2[D, H] (B = grad_output, W = weight2);
// GEMM3 is grad_hidden[T, D] = grad_linear1[T, H] @ weight1[H, D]. In wgmma's terms the weight is A (M = its N
// dimension; tf32 operands in shared memory must be K-major, which would need a transposed copy), so each consumer
// loads its 64-row slice of W per MMA step from the TMA tile into registers (any layout is allowed there) and
// B = the activations is K-major in shared memory, as stored. The accumulator tile is [M, N]: the epilogue stores it
// transposed into C [N, M].
//
// 384 threads: warpgroup 0 the TMA producer (one thread), warpgroups 1 and 2 the consumers (64 rows of M each).
// One CTA per output tile of 128 (M) x BN (N), grid (M / 128, N / BN, splits); split z sums K-steps
// [z * k_steps, (z + 1) * k_steps) into C + z * split_stride. A stage is one 128-byte swizzle row of B deep in K
// (32 fp32 or 64 fp16): W as four TMA boxes of BK K-rows x 32 M-elements, B as one box of BN rows x 128 bytes.
// Probe limits (checked by the tool): M % 128 == 0, N % BN == 0, K % BK == 0, 16-byte aligned rows.
//
// LAYOUT picks the tf32 register fragment order of A (0: a1 = row + 8, a2 = k + 4, the mma.m16n8k8 order; 1:
// swapped), so that one run tells which one wgmma uses (the wrong one fails the tool's check). MOVE_ONLY = 1 is a
// measurement build that leaves out the shared-memory loads and the MMAs (the TMA traffic alone; wrong results by
// design: the tool does not check it).
#include "common.cuh"
#include "sm90/types.cuh"
#include "sm90/ptx.cuh"

namespace rsprobe {

struct Args {
  float* c;
  long long ldc;
  long long split_stride;  // elements from one split's C to the next
  float w_scale;           // mixed form: W is multiplied by this (a power of two) before rounding to fp16
  float alpha;             // C = alpha * acc
  int k_steps;             // K steps (of the form's BK) per split
  int pad;
};

// (k, m) of a stage's W tile: box m / 32 (BK rows of 128 bytes), row k, 16-byte chunk (m % 32) / 4 swizzled by k % 8.
template <int BK>
__device__ __forceinline__ unsigned w_addr(unsigned w_stage, int k, int m) {
  return w_stage + (m >> 5) * (BK * 128) + k * 128 + ((((m & 31) >> 2) ^ (k & 7)) << 4) + ((m & 3) << 2);
}

__device__ __forceinline__ float lds(unsigned addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}

}  // namespace rsprobe

namespace tf32rs {

__device__ __forceinline__ unsigned tf32(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
}

#define TF32RS_WGMMA(N, REGS, AREGS, DESC, ...)                                                          \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 {" REGS "}, " AREGS ", " DESC \
               ", 1, 1, 1;\n"                                                                          \
               : __VA_ARGS__                                                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)                               \
               : "memory")

template <int BN>
__device__ __forceinline__ void wgmma_rs(float (&d)[BN / 2], const unsigned (&a)[4], unsigned long long desc_b) {
  if constexpr (BN == 64) {
    TF32RS_WGMMA(64,
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                 "{%32, %33, %34, %35}", "%36", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]),
                 "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
                 "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]),
                 "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]));
  } else {
    static_assert(BN == 128, "BN 64 or 128 (256 would not keep two steps' fragments beside its accumulators)");
    TF32RS_WGMMA(128, CUPYFFN_WGMMA_REGS_0_64, "{%64, %65, %66, %67}", "%68", CUPYFFN_WGMMA_D_0_64);
  }
}

template <int BN_, int LAYOUT, int MOVE_ONLY>
struct Form {
  static constexpr int BN = BN_, BK = 32;
  static constexpr unsigned kBBytes = BN * BK * 4;
  static constexpr bool kMoveOnly = MOVE_ONLY;

  // One stage of a consumer: its 64 x 32 slice of W into registers (4 k8 steps x 4), then 4 wgmmas on them.
  static __device__ __forceinline__ void mma(float (&acc)[BN / 2], unsigned (&a)[4][4], unsigned w_stage,
                                             unsigned b_stage, int m_row, const rsprobe::Args&) {
    using rsprobe::lds;
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int k = 8 * kk + t;
      a[kk][0] = tf32(lds(rsprobe::w_addr<BK>(w_stage, k, m_row)));
      a[kk][LAYOUT ? 2 : 1] = tf32(lds(rsprobe::w_addr<BK>(w_stage, k, m_row + 8)));
      a[kk][LAYOUT ? 1 : 2] = tf32(lds(rsprobe::w_addr<BK>(w_stage, k + 4, m_row)));
      a[kk][3] = tf32(lds(rsprobe::w_addr<BK>(w_stage, k + 4, m_row + 8)));
    }
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<BN>(acc, a[kk], sm90::smem_desc(b_stage + 32 * kk));
    sm90::wgmma_commit();
  }
};

}  // namespace tf32rs

// The mixed-input form (docs/decisions/053's "what would be needed"): per k16 step a thread converts 8 fp32 W
// elements into the four f16x2 registers of wgmma's A fragment (rows g, g + 8; K pairs 2t, 2t + 1 and 2t + 8, 2t + 9).
namespace mixedrs {

#define MIXEDRS_WGMMA(N, REGS, AREGS, DESC, ...)                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS "}, " AREGS ", " DESC \
               ", 1, 1, 1, 0;\n"                                                                      \
               : __VA_ARGS__                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)                              \
               : "memory")

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long desc_b) {
  MIXEDRS_WGMMA(128, CUPYFFN_WGMMA_REGS_0_64, "{%64, %65, %66, %67}", "%68", CUPYFFN_WGMMA_D_0_64);
}

struct Form {
  static constexpr int BN = 128, BK = 64;
  static constexpr unsigned kBBytes = BN * BK * 2;
  static constexpr bool kMoveOnly = false;

  static __device__ __forceinline__ void mma(float (&acc)[64], unsigned (&a)[4][4], unsigned w_stage,
                                             unsigned b_stage, int m_row, const rsprobe::Args& args) {
    using rsprobe::lds;
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int k = 16 * kk + 2 * t;
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // a[r]: rows m_row + 8 (r & 1), K pair k + 8 (r >> 1)
        const int kr = k + 8 * (r >> 1), m = m_row + 8 * (r & 1);
        a[kk][r] = cupyffn::f16x2_bits(lds(rsprobe::w_addr<BK>(w_stage, kr, m)),
                                       lds(rsprobe::w_addr<BK>(w_stage, kr + 1, m)), args.w_scale);
      }
    }
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs(acc, a[kk], sm90::smem_desc(b_stage + 32 * kk));
    sm90::wgmma_commit();
  }
};

}  // namespace mixedrs

template <class Form, int STAGES>
__global__ void __launch_bounds__(384, 1)
    rs_gemm(const __grid_constant__ sm90::TmaDesc map_w, const __grid_constant__ sm90::TmaDesc map_b,
            const __grid_constant__ rsprobe::Args args) {
  constexpr int BN = Form::BN, BK = Form::BK;
  constexpr unsigned kWBox = BK * 128, kWBytes = 4 * kWBox, kBBytes = Form::kBBytes;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (sm90::smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned w_smem = base, b_smem = base + STAGES * kWBytes;
  const unsigned full_bar = b_smem + STAGES * kBBytes, empty_bar = full_bar + 8 * STAGES;
  const int wg = threadIdx.x >> 7, m0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  const int k0 = blockIdx.z * args.k_steps * BK;
  if (threadIdx.x == 0) {  // full[s]: the stage's TMA bytes landed; empty[s]: each of the 8 consumer warps is done
    for (int s = 0; s < STAGES; ++s) {
      sm90::mbar_init(full_bar + 8 * s, 1);
      sm90::mbar_init(empty_bar + 8 * s, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      for (int i = 0; i < args.k_steps; ++i) {
        const unsigned s = i % STAGES, phase = (i / STAGES) & 1u;
        sm90::mbar_wait(empty_bar + 8 * s, phase ^ 1u);
        sm90::mbar_arrive_expect_tx(full_bar + 8 * s, kWBytes + kBBytes);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          sm90::tma_load_2d(w_smem + s * kWBytes + q * kWBox, &map_w, full_bar + 8 * s, m0 + 32 * q, k0 + i * BK);
        }
        sm90::tma_load_2d(b_smem + s * kBBytes, &map_b, full_bar + 8 * s, k0 + i * BK, n0);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int ctid = threadIdx.x - 128 * wg, warp = ctid >> 5, lane = ctid & 31;
  const int m_row = 64 * (wg - 1) + 16 * warp + (lane >> 2);  // this thread's first row of M in the tile
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
  unsigned a_even[4][4], a_odd[4][4];  // the W fragments of even and odd steps: a group's are kept until it is done
  // one K step: wait for its stage, issue its wgmma group, and once step i - 1's group is done (wait<1>) hand
  // that stage back to the producer (the loop is unrolled by two so that each step's fragments have names of their own)
  auto step = [&](int i, unsigned (&a)[4][4]) {
    const unsigned s = i % STAGES;
    sm90::mbar_wait(full_bar + 8 * s, (i / STAGES) & 1u);
    if constexpr (Form::kMoveOnly) {
      if (lane == 0) sm90::mbar_arrive(empty_bar + 8 * s);
      return;
    }
    Form::mma(acc, a, w_smem + s * kWBytes, b_smem + s * kBBytes, m_row, args);
    sm90::wgmma_wait<1>();
    if (i > 0 && lane == 0) sm90::mbar_arrive(empty_bar + 8 * ((i - 1) % STAGES));
  };
  int i = 0;
  for (; i + 1 < args.k_steps; i += 2) {
    step(i, a_even);
    step(i + 1, a_odd);
  }
  if (i < args.k_steps) step(i, a_even);
  sm90::wgmma_wait<0>();
  sm90::fence_regs(acc);
  // acc[4j + 2h + e] is (row m_row + 8h, column 8j + 2(lane % 4) + e) of the [M, N] tile: C[n][m] times alpha
  float* c = args.c + blockIdx.z * args.split_stride;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const long long n = n0 + 8 * j + 2 * (lane & 3) + e;
        c[n * args.ldc + m0 + m_row + 8 * h] = args.alpha * acc[4 * j + 2 * h + e];
      }
    }
  }
}
