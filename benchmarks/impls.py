"""The implementations the bench compares: cupyffn's precisions and its peers (plain CuPy, PyTorch).

Each is an `Impl` with `bind(args2d, out) -> run`, where `run()` enqueues one backward on the current
stream (the bench's) and returns the three outputs; `takes_out`: whether it writes into given `out=`
buffers (those are NaN-poisoned before each checked call; the others allocate new outputs, which
the fresh inputs of every round keep from passing with stale values).
"""

import math
import os
import time

import cupyffn
from cupyffn.api.backward_plan import plan_with_options
from cupyffn.f32.options import EngineOptions

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def torch_backward(dy, x, w1, w2, z, t, g):
    """The reference formula in PyTorch eager ops (2-D tensors)."""
    gg = dy @ w2
    gw2 = dy.t() @ g
    gelu_grad = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * SQRT_2_OVER_PI * (1 + 0.134145 * z * z)
    dz = gg * gelu_grad
    return dz @ w1, dz.t() @ x, gw2


# Two functions with their own code objects: torch.compile caches per code object, so the fp32 and
# the TF32 compilation (whose kernels depend on the TF32 flag at compile time) never share an entry.
def _compiled_fp32(dy, x, w1, w2, z, t, g):
    return torch_backward(dy, x, w1, w2, z, t, g)


def _compiled_tf32(dy, x, w1, w2, z, t, g):
    return torch_backward(dy, x, w1, w2, z, t, g)


#: Twins of a cupyffn plan for an A/B in the same run (report.A_B_TWINS), each the plan built with one mechanism
#: turned off in its options (cupyffn/f32/options.py, backward_plan.plan_with_options): (options, precision). For tf32:
#: the cuBLAS GEMM1 + dgelu pass route instead of the fused sm90 kernel (H100/H200 only, fused_gemm1=False), every
#: launch from the host instead of the re-pointed call graph (call_graph=False), convert A and B as two launches on
#: two streams instead of one (convert_ab=False), the fused GEMM1's staged epilogue instead of its epilogue warps
#: (H100/H200 only, epilogue_warps=False). For fp16+fp8: no pair on the sm90 pair kernel, GEMM1 as cuBLAS bf16x3 and
#: GEMM2-4 as cuBLAS's pair (or bf16x3 where that is slower: CUBLAS_PAIR_TOKENS) (H100/H200 only, sm90_pair=False).
TF32_CUBLAS_GEMM1 = "cupyffn-tf32-cublas-gemm1"
TF32_LAUNCHES = "cupyffn-tf32-launches"
TF32_CONVERT_APART = "cupyffn-tf32-convert-apart"
TF32_STAGED_EPILOGUE = "cupyffn-tf32-staged-epilogue"
FP16FP8_CUBLAS_GEMM1 = "cupyffn-fp16+fp8-cublas-gemm1"
TWIN_OPTIONS = {TF32_CUBLAS_GEMM1: (EngineOptions(fused_gemm1=False), "tf32"),
                TF32_LAUNCHES: (EngineOptions(call_graph=False), "tf32"),
                TF32_CONVERT_APART: (EngineOptions(convert_ab=False), "tf32"),
                TF32_STAGED_EPILOGUE: (EngineOptions(epilogue_warps=False), "tf32"),
                FP16FP8_CUBLAS_GEMM1: (EngineOptions(sm90_pair=False), "fp16+fp8")}
#: The twins that differ from their plan only on an H100/H200 (an option of an sm90 kernel).
SM90_TWINS = (TF32_CUBLAS_GEMM1, TF32_STAGED_EPILOGUE, FP16FP8_CUBLAS_GEMM1)
#: Memory mode beside the headline (labelled, never the headline): the tf32 plan called without gelu_out, which it
#: then forms in the fused GEMM1's epilogue from T = 4096 on (GELU_EPILOGUE_TOKENS) instead of converting the
#: caller's; every other implementation uses the inputs as given (docs/decisions/002-honour-every-input.md).
TF32_MEMORY_MODE = "cupyffn-tf32-memory-mode"


def torch_or_none(in_process_compile=False):
    if in_process_compile:
        # torch.compile's pool of compile workers stays alive and competes for the host CPU with the
        # host-time measurements of loop mode: compile in-process there (slower to compile).
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


class Impl:
    def __init__(self, name, bind, takes_out=False, plan=None, memory_mode=False):
        self.name, self.bind, self.takes_out, self.plan = name, bind, takes_out, plan
        self.memory_mode = memory_mode

    def call_args(self, args):
        """The seven inputs as this implementation passes them (memory mode: gelu_out left out)."""
        return tuple(args[:6]) + (None,) if self.memory_mode else tuple(args)

    def close(self):
        if self.plan is not None:
            self.plan.close()


class Implementations:
    """Builds each workload's implementations; keeps what lives across workloads (compiled functions)."""

    def __init__(self, cupy, torch, compile_):
        self.cupy, self.torch = cupy, torch
        self.compiled = {}
        if torch is not None and compile_:
            for name, fn in (("torch-compile-fp32", _compiled_fp32), ("torch-compile-tf32", _compiled_tf32)):
                self.compiled[name] = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=True)
        self._naive_dgelu = cupy.ElementwiseKernel(
            "float32 gg, float32 x, float32 t", "float32 dz",
            "dz = gg * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f"
            " * (1.0f + 0.134145f * x * x))", "bench_naive_dgelu")

    def names(self):
        names = [f"cupyffn-{p}" for p in cupyffn.PRECISIONS]
        if self.cupy.cuda.Device().compute_capability == "90":  # where the twins' sm90 kernels run
            names += list(SM90_TWINS)
        names += [TF32_LAUNCHES, TF32_CONVERT_APART, TF32_MEMORY_MODE]
        names += ["cupy-naive-fp32", "cupy-naive-tf32"]
        if self.torch is not None:
            names += ["torch-fp32", "torch-tf32"] + list(self.compiled)
        return names

    def build(self, names, tokens, dim, hidden_dim):
        """{name: Impl} for one shape, in the order of `names`."""
        return {n: self._build(n, tokens, dim, hidden_dim) for n in names}

    def _build(self, name, T, D, H):
        torch = self.torch
        if name.startswith("cupyffn-"):
            memory_mode = name == TF32_MEMORY_MODE
            if name in TWIN_OPTIONS:
                options, precision = TWIN_OPTIONS[name]
                plan = plan_with_options(T, D, H, options, precision=precision)
            else:
                plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32" if memory_mode else name[len("cupyffn-"):])

            impl = Impl(name, None, takes_out=True, plan=plan, memory_mode=memory_mode)

            def bind(args, out, plan=plan):
                args = impl.call_args(args)  # memory mode: gelu_out formed in GEMM1's epilogue where the plan can
                return lambda: plan(*args, out=out)  # the current stream: the bench's
            impl.bind = bind
            return impl
        if name.startswith("cupy-naive-"):
            tf32 = name.endswith("tf32")
            return Impl(name, lambda args, out: (lambda: self._naive(args, tf32)))
        if name in ("torch-fp32", "torch-tf32") or name in self.compiled:
            fn = self.compiled.get(name, torch_backward)
            tf32 = name.endswith("tf32")

            def bind(args, out):
                targs = [torch.from_dlpack(a) for a in args]

                def run():  # TF32 for this call only: the process's setting is put back after it
                    matmul = torch.backends.cuda.matmul
                    before = matmul.allow_tf32
                    matmul.allow_tf32 = tf32
                    try:
                        return fn(*targs)
                    finally:
                        matmul.allow_tf32 = before
                return run
            return Impl(name, bind)
        raise ValueError(f"unknown implementation {name!r}")

    def _naive(self, args, tf32):
        """Plain CuPy: four cupy.matmul (cuBLAS gemmEx; FAST_TF32 compute for -tf32) + one ElementwiseKernel."""
        from cupy._core import _routines_linalg as linalg

        dy, x, w1, w2, z, t, g = args
        previous = linalg.get_compute_type(self.cupy.float32)
        if tf32:
            linalg.set_compute_type(self.cupy.float32, linalg.COMPUTE_TYPE_TF32)
        try:
            gg = dy @ w2
            gw2 = dy.T @ g
            dz = self._naive_dgelu(gg, z, t)
            return dz @ w1, dz.T @ x, gw2
        finally:  # the fp32 reference and every other matmul must stay without TF32
            linalg.set_compute_type(self.cupy.float32, previous)


def stream_context(cupy, torch, stream):
    """A context factory: `stream` current for CuPy and (if present) for torch."""

    class Both:
        def __enter__(s):
            stream.__enter__()
            s.t = None
            if torch is not None:
                s.t = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr))
                s.t.__enter__()

        def __exit__(s, *exc):
            if s.t is not None:
                s.t.__exit__(*exc)
            stream.__exit__(*exc)

    return Both


def timed_first_call(run, cupy):
    """(outputs, seconds) of a call including its device work (a first call: compilation, autotuning)."""
    t0 = time.perf_counter()
    out = run()
    cupy.cuda.runtime.deviceSynchronize()
    return out, time.perf_counter() - t0
