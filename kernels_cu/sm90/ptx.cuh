// sm90 GEMM: thin wrappers of the PTX the kernel issues (mbarriers, named barriers, TMA, wgmma, cp.async,
// shared-memory loads and stores). Compiled for sm_90a only (wgmma, setmaxnreg).
#pragma once

namespace sm90 {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// ---- mbarrier -----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Returns once the phase of parity `parity` has completed (a fresh barrier counts its phase before
// phase 0 as completed: waiting for parity 1 returns at once). Parity alone tells phases apart only
// if the waiter is at most one phase ahead of the barrier: the schedules below make sure of that.
// A wait that never ends (a pipeline bug) traps after kHangNs of wall time (the clock is read once
// per 4096 failed polls): a launch error the caller sees within seconds instead of a process that
// hangs (a poll count alone gives no time bound: one try_wait may suspend the thread for a while).
constexpr unsigned long long kHangNs = 2000000000ull;  // 2 s; a legitimate wait lasts one GEMM at most

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done, polls = 0;
  unsigned long long since = 0;
  for (;;) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if ((++polls & 4095u) == 0) {
      const unsigned long long now = global_ns();
      if (since == 0) {
        since = now;
      } else if (now - since > kHangNs) {
        __trap();
      }
    }
  }
}

// Named barriers 1 and 2 (0 is __syncthreads): the ping-pong consumers' turns, see the kernel.
__device__ __forceinline__ void named_bar_sync(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_bar_arrive(unsigned id, unsigned threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- TMA ----------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc* map, unsigned bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// ---- wgmma --------------------------------------------------------------------------------------
// Shared-memory matrix descriptor (sm90 GMMA descriptor): start address >> 4 in bits 0-13, leading
// byte offset >> 4 in bits 16-29 (unused for swizzled K-major; 1 by convention), stride byte offset
// >> 4 in bits 32-45 (1024 B: one 8-row x 128 B swizzle atom to the next), layout in bits 62-63
// (1 = 128-byte swizzle). Tiles start on 1024-byte boundaries (base offset 0); stepping K by 16
// elements inside the 128-byte row adds 32 bytes to the start address.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// The same for an MN-major operand (B given as [K, N], N contiguous; the pair's A as [K, M]): the stage holds BN / 64
// TMA boxes of 64 K-rows x 64 N-elements (128 B), 8 KiB each, 128-byte swizzled. The canonical MN-major
// SW128 layout (as CUTLASS's make_gmma_desc<Major::MN> documents it) steps 64-element N chunks by the
// leading byte offset (8 KiB: box to box) and 8-row K groups by the stride byte offset (1024 B: atom to
// atom); stepping K by 16 rows adds 2048 bytes to the start address.
__device__ __forceinline__ unsigned long long smem_desc_mn(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(8192 >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving accesses to the accumulators across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The m64nNk16 wgmma with both operands from shared memory, scale-d = 1 (accumulate into d), each operand K-major
// (TA, TB = 0) or MN-major (1: imm-trans-a, imm-trans-b). The register lists are mechanical (d[0..N/2)), so they are spelled once,
// as macros: the PTX operand numbers %0.. and the matching "+f" constraints; the descriptors follow them.
#define CUPYFFN_WGMMA_REGS_0_64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUPYFFN_WGMMA_REGS_64_128 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CUPYFFN_WGMMA_REGS_64_96 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define CUPYFFN_WGMMA_D_0_64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define CUPYFFN_WGMMA_D_64_96 \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define CUPYFFN_WGMMA_D_64_128 \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// One wgmma of N columns on TYPE ("f16" or "bf16") operands: REGS the accumulator operand numbers, DESCS
// the numbers of the two descriptors and of the imm-trans-a and imm-trans-b immediates after them, then the
// accumulators' "+f" constraints.
#define CUPYFFN_WGMMA(N, TYPE, REGS, DESCS, ...)                                                      \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, " DESCS \
               ";\n"                                                                                \
               : __VA_ARGS__                                                                        \
               : "l"(desc_a), "l"(desc_b), "n"(TA), "n"(TB)                                         \
               : "memory")

// The m64nNk32 e4m3 x e4m3 wgmma (the fp16+fp8 pair's cross terms): 8-bit operands are K-major only, so
// the instruction has no transpose immediates (scale-d, imm-scale-a, imm-scale-b = 1).
#define CUPYFFN_WGMMA_E4M3(N, REGS, DESCS, ...)                                                    \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS "}, " DESCS ";\n" \
               : __VA_ARGS__                                                                     \
               : "l"(desc_a), "l"(desc_b)                                                        \
               : "memory")

template <int OP, int TA, int TB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (OP == kOpBf16) {
    CUPYFFN_WGMMA(128, "bf16", CUPYFFN_WGMMA_REGS_0_64, "%64, %65, 1, 1, 1, %66, %67", CUPYFFN_WGMMA_D_0_64);
  } else {
    CUPYFFN_WGMMA(128, "f16", CUPYFFN_WGMMA_REGS_0_64, "%64, %65, 1, 1, 1, %66, %67", CUPYFFN_WGMMA_D_0_64);
  }
}

template <int OP, int TA, int TB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (OP == kOpBf16) {
    CUPYFFN_WGMMA(256, "bf16", CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_128, "%128, %129, 1, 1, 1, %130, %131",
                  CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_128);
  } else {
    CUPYFFN_WGMMA(256, "f16", CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_128, "%128, %129, 1, 1, 1, %130, %131",
                  CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_128);
  }
}

// 192 columns: the pair kernel's tile for 132 SMs (fp16 only: the pair's 16-bit stages).
template <int OP, int TA, int TB>
__device__ __forceinline__ void wgmma_m64n192k16(float (&d)[96], unsigned long long desc_a, unsigned long long desc_b) {
  static_assert(OP != kOpBf16, "n192: the pair's fp16 stages only");
  CUPYFFN_WGMMA(192, "f16", CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_96, "%96, %97, 1, 1, 1, %98, %99",
                CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_96);
}

// One k16 step of 16-bit operands (kOpF16E4M3: its fp16 part).
template <int OP, int BN, int TA, int TB>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (BN == 128) wgmma_m64n128k16<OP, TA, TB>(d, desc_a, desc_b);
  if constexpr (BN == 192) wgmma_m64n192k16<OP, TA, TB>(d, desc_a, desc_b);
  if constexpr (BN == 256) wgmma_m64n256k16<OP, TA, TB>(d, desc_a, desc_b);
}

// One k32 step of e4m3 operands (both K-major).
template <int BN>
__device__ __forceinline__ void wgmma_e4m3_k32(float (&d)[BN / 2], unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (BN == 128) {
    CUPYFFN_WGMMA_E4M3(128, CUPYFFN_WGMMA_REGS_0_64, "%64, %65, 1, 1, 1", CUPYFFN_WGMMA_D_0_64);
  } else if constexpr (BN == 192) {
    CUPYFFN_WGMMA_E4M3(192, CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_96, "%96, %97, 1, 1, 1",
                       CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_96);
  } else {
    CUPYFFN_WGMMA_E4M3(256, CUPYFFN_WGMMA_REGS_0_64 ", " CUPYFFN_WGMMA_REGS_64_128, "%128, %129, 1, 1, 1",
                       CUPYFFN_WGMMA_D_0_64, CUPYFFN_WGMMA_D_64_128);
  }
}

// ---- cp.async and shared memory (the dgelu epilogues' x/t copies) -------------------------------
// x and t are read once: evict them from L2 first, so that they do not push out the A and B tiles the
// other CTAs are still reading. (volatile: made again at each use, one instruction, so that the 64-bit
// policy does not hold two registers through the epilogue: the ping-pong variants have none to spare)
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// 16-byte asynchronous copy global -> shared, bypassing L1; bytes < 16 (down to 0) reads only that many
// and zero-fills the rest, so a partial chunk or an out-of-bounds row reads nothing past the matrix.
// (An 8-byte fallback for rows off 16-byte boundaries cost the ping-pong variants 28 bytes of spills:
// the launcher takes the direct epilogue for those instead.)
__device__ __forceinline__ void cp_async_16(unsigned dst, const float* src, unsigned bytes, unsigned long long policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(bytes),
               "l"(policy)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }


// A plain (not volatile, no memory clobber) shared load: the compiler may issue a group's loads together,
// ahead of the arithmetic and stores of earlier elements (one warp per scheduler runs an epilogue: nothing
// else hides a load's latency). What keeps it after the copies it reads have landed is its address, which
// comes out of slot_ready() below.
__device__ __forceinline__ float2 ld_shared_f2(unsigned addr) {
  float2 v;
  asm("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ float4 ld_shared_f4(unsigned addr) {
  float4 v;
  asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
  return v;
}

// Waits until at most N of this thread's cp.async groups are pending and the warp has synchronized (so every
// lane's copies of the oldest group have landed), then returns `addr`: routed through both asm statements, so
// that loads from the result cannot be scheduled before them.
template <int N>
__device__ __forceinline__ unsigned slot_ready(unsigned addr) {
  asm volatile("cp.async.wait_group %1;\n" : "+r"(addr) : "n"(N) : "memory");
  asm volatile("bar.warp.sync 0xffffffff;\n" : "+r"(addr) : : "memory");
  return addr;
}

// Volatile, with memory clobbers: they stay in order with each other and with the warp barriers between them.
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_u4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  return bytes;
}

}  // namespace sm90
