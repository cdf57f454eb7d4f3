// sm90 GEMM: per-tile timestamps, for measurement only (dev/sm90_trace.py; Sm90Config(trace=True) compiles the
// variant with CUPYFFN_SM90_TRACE, the product never does). Per consumer and tile: the global timer when the
// tile's loop iteration starts, when the consumer has its turn on the tensor cores (ping-pong), when its mainloop
// has finished and when its epilogue has. The results are those of the untraced kernel.
#pragma once

#ifdef CUPYFFN_SM90_TRACE
namespace sm90 {
constexpr int kTraceTiles = 64;  // per consumer and CTA; later tiles are not recorded
}  // namespace sm90
extern "C" {  // unmangled: the tool sets it by name
__device__ unsigned long long* cupyffn_sm90_trace;
}
namespace sm90 {
__device__ __forceinline__ void trace_stamp(int consumer, int local, int what, int tid) {
  if (tid == 0 && local < kTraceTiles && cupyffn_sm90_trace != nullptr) {
    cupyffn_sm90_trace[((blockIdx.x * 2 + consumer) * kTraceTiles + local) * 4 + what] = global_ns();
  }
}
}  // namespace sm90
#define CUPYFFN_TRACE(what) sm90::trace_stamp(consumer, local, what, tid)
#else
#define CUPYFFN_TRACE(what) ((void)0)
#endif
