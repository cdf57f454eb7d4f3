// sm90 GEMM: the operand and epilogue codes, the kernel parameters (TmaDesc, GemmArgs: mirrored by ctypes in
// cupyffn/gemm/sm90/launch.py) and the shared-memory budget of each variant (mirrored by cupyffn/gemm/sm90/config.py).
#pragma once

#define kEpiF32 0
#define kEpiDgeluF16 2
#define kEpiDgeluBf16x3 3
#define kEpiDgeluF16G 4
#define kOpF16 0
#define kOpBf16 1
#define kOpF16E4M3 2

namespace sm90 {

constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kBM = 128;       // rows of a CTA tile (64 per consumer warpgroup)
constexpr int kBK = 64;        // K per stage: 64 16-bit elements = one 128-byte swizzle row

// A CUtensorMap: 128 opaque bytes built on the host by cuTensorMapEncodeTiled, passed by value as a
// __grid_constant__ parameter (so its address is a valid generic address for the TMA unit).
struct __align__(64) TmaDesc {
  unsigned long long opaque[16];
};

struct GemmArgs {
  void* c;        // kEpiF32: float*; else 16-bit codes
  const float* x; // linear1_out (dgelu epilogues)
  const float* t; // tanh_inner (dgelu epilogues); nullptr: recomputed from x
  long long ldc;
  long long ldx;
  long long ldt;
  int m;
  int n;
  int k;
  float alpha;    // kEpiDgeluF16: scale applied before rounding to fp16; kEpiF32: C's scale (unless acc_scale)
  unsigned* amax; // dgelu epilogues: if not nullptr, max |g| over the finite g (unscaled) is folded into
                  // *amax by atomicMax on the float's bits (non-negative floats order like their bits)
  // The engine's device-side scales (the "tf32" plan; common.cuh's scale state), all optional:
  const float* acc_scale;  // dgelu epilogues: g = (*acc_scale * acc) * gelu' (GEMM1's alpha 2^-(e_a + e_b))
  int* state;     // kEpiDgeluF16: alpha = 2^state[slot] instead of `alpha`
  float* consts;  // rescue launch: block 0 writes the alphas of alpha_mask's GEMMs (common.cuh write_alphas)
  int slot;       // the output's scale slot
  int rescue;     // 1: the rescue launch: runs only if state flags `slot` for conversion again
  int alpha_mask;
  int xt_pairs;   // direct epilogue: 1 if x and t rows hold 8-byte aligned column pairs (else one float at a time)
  int raster;     // order of the output tiles: 0 down each column, R > 0 in bands of R tile rows (tile_coords)
  // kOpF16E4M3 (gemm_sm90_pair_kernel): C = scale * (pair_scale * A8 B8^T + A B^T) (+ C), the e4m3 stages first
  float pair_scale;  // the e4m3 product's weight against the fp16 one (a power of two: exact)
  int k8;            // K of the e4m3 operands (bytes per row in use; 0: no e4m3 stages)
  int accumulate;    // kEpiF32: 1 adds to C (the weight gradients' beta = 1), 0 overwrites it
  // kEpiDgeluF16G: the second output, gelu_out as fp16 codes (GEMM2's B operand)
  unsigned short* g;
  long long ldg;
  unsigned* g_amax;  // if not nullptr: max |gelu_out| (finite, unscaled) folded in as amax is
  int g_slot;        // with state: gelu_out's scale slot (scale 2^state[g_slot]); without: scale g_alpha
  float g_alpha;
};
static_assert(sizeof(GemmArgs) == 160, "GemmArgs layout is mirrored in cupyffn/gemm/sm90/launch.py");
static_assert(sizeof(TmaDesc) == 128, "a CUtensorMap is 128 bytes");

// Bytes of one pipeline stage: the 16-bit (or e4m3: the same bytes) A and B tiles.
__host__ __device__ constexpr int stage_bytes_for(int bn) { return (kBM + bn) * kBK * 2; }

// Pipeline depth: as many stages as fit in 200 KiB of the 227 KiB of shared memory (6 for BN = 128, 5 for the
// pair's 192, 4 for 256; 200 rather than 192 KiB gives 192 its fifth stage and leaves 128 and 256 as they were).
__host__ __device__ constexpr int stages_for(int bn) { return (200 * 1024) / stage_bytes_for(bn); }

// Shared memory a launch needs: the stages, 1 KiB of slack to align them to 1024 bytes, and the
// mbarriers (full and empty per stage, 8 bytes each). cupyffn/gemm/sm90/config.py computes the same numbers for the
// launcher; every build checks that they agree (config.py budget_checks).
__host__ __device__ constexpr int smem_bytes_for(int bn) { return stages_for(bn) * stage_bytes_for(bn) + 1024 + 2 * 8 * stages_for(bn); }

// The staged dgelu epilogue (XS = 1): kXsStageDrop pipeline stages fewer, and per consumer a ring of x/t slots.
// A slot holds one "group": a 64-row x kXtCols-column block of x and of t, each of the consumer's four warps
// owning the 16 rows of its accumulator fragment (a warp slot, kWarpSlotBytes). Stages and slots share 224 KiB
// (docs/decisions/027-xt-whole-row-segments.md: groups of whole 128-byte row segments, one stage given up).
constexpr int kXtCols = 32;                           // columns of a group: 4 lanes x 8 columns per row
constexpr int kXsStageDrop = 1;                       // pipeline stages given up for the slots
constexpr int kXtChunks = kXtCols / 4;                // 16-byte chunks per row of a warp slot
constexpr int kWarpSlotBytes = 2 * 16 * kXtCols * 4;  // x and t, 16 rows each
constexpr int kXtSlotBytes = 4 * kWarpSlotBytes;
__host__ __device__ constexpr int xs_stages_for(int bn) { return stages_for(bn) - kXsStageDrop; }
__host__ __device__ constexpr int xt_slots_for(int bn) {
  return (224 * 1024 - xs_stages_for(bn) * stage_bytes_for(bn)) / (2 * kXtSlotBytes);
}
__host__ __device__ constexpr int xs_smem_bytes_for(int bn) {
  return xs_stages_for(bn) * stage_bytes_for(bn) + 2 * xt_slots_for(bn) * kXtSlotBytes + 1024 + 2 * 8 * xs_stages_for(bn);
}
static_assert(xs_smem_bytes_for(256) <= 232448 && xs_smem_bytes_for(128) <= 232448,
              "227 KiB of dynamic shared memory per CTA at most");
static_assert(xs_stages_for(256) >= 2 && xs_stages_for(128) >= 2 && xt_slots_for(256) >= 1 && xt_slots_for(128) >= 1,
              "at least two stages and one slot");

// The epilogue warps (XS = 2, cooperative 128 x 128 tiles; epilogue_warps.cuh): seven warps besides the producer
// and consumers run the dgelu epilogue from an fp32 accumulator tile in shared memory, x and t streamed through a
// ring per warp (docs/decisions/045-epilogue-warps.md).
constexpr int kEwThreads = 512;                // kThreads + the epilogue warpgroup
constexpr int kEwStages = 4;                   // pipeline stages (32 KiB each at BN = 128)
constexpr int kEwWarps = 7;                    // warps 1-3 of the producer warpgroup, the 4 of warpgroup 3
constexpr int kEwRing = 2;                     // x/t items in flight per epilogue warp
constexpr int kEwItemBytes = 2 * 2 * 128 * 4;  // an item: x and t of two 128-column rows (2 KiB)
constexpr int kEwAccBytes = kBM * 128 * 4;     // the fp32 accumulator tile (64 KiB)
constexpr int kEwRingBytes = kEwWarps * kEwRing * kEwItemBytes;
__host__ __device__ constexpr int ew_smem_bytes_for() {
  return kEwStages * stage_bytes_for(128) + kEwAccBytes + kEwRingBytes + 1024 + 8 * (2 * kEwStages + 2);
}
static_assert(ew_smem_bytes_for() <= 232448, "227 KiB of dynamic shared memory per CTA at most");

}  // namespace sm90
