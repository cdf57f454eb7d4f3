"""The GEMM floor row: the four fp16 GEMMs of a backward alone, by cuBLAS, on operands converted before timing.

Not a solution: it computes no gradient (no GELU derivative, no scales), so it is kept out of the check and the
headline; the bench times it under the same protocol as every implementation (L2 flushed, inputs rotated), and the
report sets each plan against it per workload (issue 57's target: tf32 within 1.15x of it at T >= 4096).

The four products are the ones the tf32 plan runs, with its output formats: GEMM1 writes fp16 [T, H] (what the
fused GEMM1 writes as grad_linear1), which GEMM3 and GEMM4 then read; GEMM2-4 write fp32. One stream, one after the
other, cublasGemmEx with fp32 accumulation (cupyffn/gemm/cublas.py, the engine's binding).
"""

from cupyffn.gemm import cublas

NAME = "gemm-floor-fp16"
WHAT = ("the four fp16 GEMMs alone (cuBLAS, operands converted before timing, GEMM1 out fp16, GEMM2-4 out fp32, "
        "one stream): not a solution, no check")


class GemmFloor:
    """`bind(args2d) -> run`: the four GEMMs over one input set's fp16 copies (made in bind, untimed)."""

    def __init__(self, cupy, T, D, H):
        self.cupy = cupy
        f16, f32 = cublas.R_16F, cublas.R_32F
        self.gemms = (  # (plan, A, B, C) by role: C = A @ B, names as in cupyffn/f32/plan.py GEMM_NAMES
            cublas.Gemm(T, H, D, f16, f16, f16, name="GEMM1 floor"),
            cublas.Gemm(D, H, T, f16, f16, f32, a_trans=True, name="GEMM2 floor"),
            cublas.Gemm(T, D, H, f16, f16, f32, name="GEMM3 floor"),
            cublas.Gemm(H, D, T, f16, f16, f32, a_trans=True, name="GEMM4 floor"),
        )
        self.shapes = ((T, H), (D, H), (T, D), (H, D))
        self.consts = cupy.asarray([1.0, 0.0], dtype=cupy.float32)  # alpha, beta (device pointer mode)
        self.handle = cublas.acquire(cupy.cuda.Device().id)

    def bind(self, args2d):
        cupy = self.cupy
        dy, x, w1, w2, _, _, g = (a.astype(cupy.float16) for a in args2d)
        dz = cupy.empty(self.shapes[0], dtype=cupy.float16)
        out = [dz] + [cupy.empty(s, dtype=cupy.float32) for s in self.shapes[1:]]
        operands = ((dy, w2, dz), (dy, g, out[1]), (dz, w1, out[2]), (dz, x, out[3]))
        keep = (dy, x, w1, w2, g, out)  # alive while `run` is

        def run(keep=keep):
            self.handle.bind(cupy.cuda.get_current_stream().ptr)
            for plan, (a, b, c) in zip(self.gemms, operands):
                plan.a.value, plan.b.value, plan.c.value = a.data.ptr, b.data.ptr, c.data.ptr
                plan.alpha.value, plan.beta.value = self.consts.data.ptr, self.consts.data.ptr + 4
                plan(self.handle)
            return tuple(keep[-1][1:])
        return run

    def close(self):
        self.cupy.cuda.runtime.deviceSynchronize()  # its last GEMMs have finished before the handle is reused
        cublas.release(self.handle)
