"""GEMMs that read fp32 weights as stored (dev/tf32_rs_gemm.cu: tf32, and mixed-input fp16) against today's route,
in one process (GPU machine; a measurement, not a test; docs/decisions/053-tf32-register-weight-probe.md):

    PYTHONPATH=. python3 dev/tf32_rs_probe.py [--tokens 256 512 1024 2048] [--out results/tf32-rs-probe.json]

At the official dim 1536 / hidden 6144, per T:
- check: each variant (BN, stages, register-fragment order) against float64 on fresh random inputs, the output
  NaN-filled first (relative L2; a wrong fragment order gives ~1);
- GEMM1's shape (grad_output [T, 1536] @ weight2 [1536, 6144]) and GEMM3's (grad_linear1 [T, 6144] @ weight1 [6144,
  1536], split along K into fp32 partials summed by one cupy.sum): the tf32 probe per BN / split, the mixed-input
  probe (activations cast to fp16 first, timed apart), cuBLAS TF32 on the same fp32 operands (torch.matmul), and one
  weight's fp32 -> fp16 copy (cupy's cast);
- the tf32 plan's own stages at that T (benchmarks/stages.py profile: convert, GEMM1 + dgelu, GEMM3).
CUDA events, L2 flushed before each sample, medians (benchmarks/timing.py). Writes the JSON and prints a table.
"""

import argparse
import ctypes
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _event_timing import flushed_median_ms  # noqa: E402
from benchmarks.stages import profile as profile_stages  # noqa: E402
from _json_out import save_json  # noqa: E402

D, H = 1536, 6144
HERE = os.path.dirname(os.path.abspath(__file__))
#: (BN, stages, fragment order, move only): the shared-memory ring is 192 KiB (128 KiB with 4 stages); order 1 and
#: move-only are measurement builds (the first run showed order 0 is wgmma's; move-only leaves the MMAs out)
VARIANTS = [(128, 6, 0, 0), (128, 6, 1, 0), (64, 8, 0, 0), (128, 4, 0, 0), (128, 6, 0, 1)]
_FLOAT32 = 7  # CU_TENSOR_MAP_DATA_TYPE_FLOAT32


#: the mixed-input kernel (fp32 weight to fp16 in registers, fp16 activations): its stages (48 KiB each)
MIXED_STAGES = 4
W_SCALE = 256.0  # the weight's power-of-two scale before fp16 rounding (weights ~ 0.02 N(0, 1))


class Args(ctypes.Structure):
    """Mirror of rsprobe::Args (dev/tf32_rs_gemm.cu)."""

    _fields_ = [("c", ctypes.c_void_p), ("ldc", ctypes.c_longlong), ("split_stride", ctypes.c_longlong),
                ("w_scale", ctypes.c_float), ("alpha", ctypes.c_float), ("k_steps", ctypes.c_int),
                ("pad", ctypes.c_int)]


def kernel_names():
    """The kernel instantiations the tool launches: the tf32 VARIANTS, then the mixed-input form."""
    return ([f"rs_gemm<tf32rs::Form<{bn}, {order}, {move}>, {stages}>" for bn, stages, order, move in VARIANTS]
            + [f"rs_gemm<mixedrs::Form, {MIXED_STAGES}>"])


def source():
    """dev/tf32_rs_gemm.cu with its kernels_cu/ headers pasted in (as cupyffn/cuda/kernels.py does)."""
    from cupyffn.cuda import kernels as _kernels

    folder, pasted = _kernels.kernel_dir(), set()

    def paste(match):
        name = match.group(1)
        if name in pasted:
            return ""
        pasted.add(name)
        return re.sub(r'^#include "([^"]+)"\n', paste, (folder / name).read_text().replace("#pragma once\n", ""),
                      flags=re.M)

    with open(os.path.join(HERE, "tf32_rs_gemm.cu")) as f:
        text = f.read()
    return re.sub(r'^#include "([^"]+)"\n', paste, text, flags=re.M)


def fp32_map(ptr, rows, cols, box_rows):
    """Tensor map of a row-major fp32 [rows, cols] matrix in boxes of box_rows x 32 (128 bytes), 128-byte swizzle."""
    from cupyffn.cuda import libcuda as _libcuda
    from cupyffn.gemm.sm90 import tensor_map as tm

    encode = _libcuda.function("cuTensorMapEncodeTiled", [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    holder = tm._AlignedDesc()
    status = encode(ctypes.addressof(holder.desc), _FLOAT32, 2, ctypes.c_void_p(ptr),
                    (ctypes.c_uint64 * 2)(cols, rows), (ctypes.c_uint64 * 1)(cols * 4),
                    (ctypes.c_uint32 * 2)(32, box_rows), (ctypes.c_uint32 * 2)(1, 1), 0, 3, 3, 0)
    _libcuda.check(status, "cuTensorMapEncodeTiled")
    return holder


class Probe:
    def __init__(self, cupy):
        from cupy_backends.cuda.api import driver

        self.cupy, self.driver = cupy, driver
        names = kernel_names()
        self.module = cupy.RawModule(code=source(), options=("-arch=sm_90a", "--std=c++17"), name_expressions=names)
        self.kernels = {}
        for (bn, st, lay, mo), name in zip(VARIANTS, names):
            k = self.module.get_function(name)
            smem = st * (128 * 32 * 4 + bn * 32 * 4) + 16 * st + 1024
            driver.funcSetAttribute(k.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            self.kernels[(bn, st, lay, mo)] = (k, smem)
        k = self.module.get_function(names[-1])
        smem = MIXED_STAGES * (128 * 64 * 4 + 128 * 64 * 2) + 16 * MIXED_STAGES + 1024
        driver.funcSetAttribute(k.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        self.mixed = (k, smem)
        self.regs = {v: k.num_regs for v, (k, _) in self.kernels.items()}
        self.spills = {v: k.local_size_bytes for v, (k, _) in self.kernels.items()}

    def prepare(self, variant, b, w, c, splits):
        """A launch of C[N, M] (partials [splits, N, M] when splits > 1) = B[N, K] @ W[K, M]; returns a callable."""
        bn = variant[0]
        n, k = b.shape
        m = w.shape[1]
        assert m % 128 == 0 and n % bn == 0 and k % (32 * splits) == 0
        kernel, smem = self.kernels[variant]
        maps = (fp32_map(w.data.ptr, k, m, 32), fp32_map(b.data.ptr, n, k, bn))
        args = Args(c.data.ptr, m, n * m, 1.0, 1.0, k // 32 // splits, 0)
        argv = (ctypes.c_void_p * 3)(ctypes.addressof(maps[0].desc), ctypes.addressof(maps[1].desc),
                                     ctypes.addressof(args))
        keep = (maps, args, argv)

        def run(stream_ptr):
            _ = keep
            self.driver.launchKernel(kernel.kernel.ptr, m // 128, n // bn, splits, 384, 1, 1, smem, stream_ptr,
                                     ctypes.addressof(argv), 0)
        return run


    def prepare_mixed(self, b16, w, c, splits):
        """C[N, M] (partials [splits, N, M]) = B16[N, K] @ fp16(W[K, M] * W_SCALE) / W_SCALE; returns a callable."""
        from cupyffn.gemm.sm90 import config, tensor_map as tm

        n, k = b16.shape
        m = w.shape[1]
        assert m % 128 == 0 and n % 128 == 0 and k % (64 * splits) == 0
        kernel, smem = self.mixed
        maps = (fp32_map(w.data.ptr, k, m, 64), tm.encode_tensor_map(b16.data.ptr, n, k, k * 2, config.OP_F16, 128))
        args = Args(c.data.ptr, m, n * m, W_SCALE, 1.0 / W_SCALE, k // 64 // splits, 0)
        argv = (ctypes.c_void_p * 3)(ctypes.addressof(maps[0].desc), ctypes.addressof(maps[1].desc),
                                     ctypes.addressof(args))
        keep = (maps, args, argv)

        def run(stream_ptr):
            _ = keep
            self.driver.launchKernel(kernel.kernel.ptr, m // 128, n // 128, splits, 384, 1, 1, smem, stream_ptr,
                                     ctypes.addressof(argv), 0)
        return run


def rel_l2(cupy, got, want):
    got = got.astype(cupy.float64)
    return float(cupy.linalg.norm(got - want) / cupy.linalg.norm(want))


def label(v):
    bn, stages, order, move_only = v
    return f"BN={bn} stages={stages}" + (f" order={order}" if order else "") + (" move-only" if move_only else "")


def measure(cupy, torch, cupyffn, probe, T, reps):
    cupy.cuda.Device().synchronize()  # nothing of the previous T still runs into memory the pool hands out again
    rng = cupy.random.default_rng(T)
    s = cupy.cuda.Stream(non_blocking=True)
    flush_buf = cupy.empty(256 * 2 ** 20 // 4, cupy.float32)
    flush = lambda: flush_buf.fill(1)  # noqa: E731  (flushed_median_ms enqueues it on s)
    time = lambda run: flushed_median_ms(cupy, s, run, flush, reps, 3)  # noqa: E731
    x, dy = (rng.standard_normal((T, D), dtype=cupy.float32) for _ in range(2))
    w1 = rng.standard_normal((H, D), dtype=cupy.float32) / 40
    w2 = rng.standard_normal((D, H), dtype=cupy.float32) / 80
    gl1 = rng.standard_normal((T, H), dtype=cupy.float32)
    cupy.cuda.Device().synchronize()  # made on the null stream; s does not wait for it
    row = {"tokens": T, "check": {}, "gemm1": {}, "gemm3": {}}
    for name, b, w in (("gemm1", dy, w2), ("gemm3", gl1, w1)):
        want = b.astype(cupy.float64) @ w.astype(cupy.float64)
        out = cupy.empty((b.shape[0], w.shape[1]), cupy.float32)
        row.setdefault("finite", {})[name] = {k: bool(cupy.isfinite(v).all()) for k, v in
                                              (("activations", b), ("weight", w), ("float64 product", want))}
        for v in VARIANTS:
            if v[3]:
                continue  # move-only: wrong by design
            with s:
                out.fill(cupy.nan)
            probe.prepare(v, b, w, out, 1)(s.ptr)
            s.synchronize()
            row["check"][f"{name} {label(v)}"] = rel_l2(cupy, out, want)
            row.setdefault("nan outputs", {})[f"{name} {label(v)}"] = int(cupy.isnan(out).sum())
        # timing: every variant but the wrong fragment order (and GEMM3's split along K for the first two)
        for v in VARIANTS:
            if v[2]:
                continue
            if name == "gemm1" or v[1] != 6:
                run = probe.prepare(v, b, w, out, 1)
                row[name][f"probe {label(v)}"] = time(lambda: run(s.ptr))
                continue
            for splits in (1, 2, 4, 8):
                part = cupy.empty((splits, b.shape[0], w.shape[1]), cupy.float32) if splits > 1 else out
                run = probe.prepare(v, b, w, part, splits)
                if splits == 1:
                    row[name][f"probe {label(v)} splits=1"] = time(lambda: run(s.ptr))
                    continue

                def run_sum(run=run, part=part):
                    run(s.ptr)
                    cupy.sum(part, axis=0, out=out)
                with s:
                    out.fill(cupy.nan)
                    run_sum()
                s.synchronize()
                if not v[3]:
                    row["check"][f"gemm3 {label(v)} splits={splits}"] = rel_l2(cupy, out, want)
                row[name][f"probe {label(v)} splits={splits}"] = time(run_sum)
        # the mixed-input form: activations converted to fp16 first (timed apart), the weight read as fp32
        b16 = b.astype(cupy.float16)
        cupy.cuda.Device().synchronize()
        for splits in (1, 2, 4) if name == "gemm3" else (1,):
            part = cupy.empty((splits, b.shape[0], w.shape[1]), cupy.float32) if splits > 1 else out
            run = probe.prepare_mixed(b16, w, part, splits)

            def run_mixed(run=run, part=part, splits=splits):
                run(s.ptr)
                if splits > 1:
                    cupy.sum(part, axis=0, out=out)
            with s:
                out.fill(cupy.nan)
                run_mixed()
            s.synchronize()
            row["check"][f"{name} mixed splits={splits}"] = rel_l2(cupy, out, want)
            row[name][f"mixed splits={splits}"] = time(run_mixed)
        row[name]["activations fp32->fp16 copy"] = time(lambda: b16.__setitem__(Ellipsis, b))
        tb, tw, tout = torch.from_dlpack(b), torch.from_dlpack(w), torch.from_dlpack(out)
        torch.backends.cuda.matmul.allow_tf32 = True
        with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
            row[name]["cublas tf32"] = time(lambda: torch.matmul(tb, tw, out=tout))
        half = cupy.empty(w.shape, cupy.float16)
        row[name]["weight fp32->fp16 copy"] = time(lambda: half.__setitem__(Ellipsis, w))
    # the product's stages at this T
    fwd = [cupy.empty((T, n), cupy.float32) for n in (D, H, H, H)]
    cupyffn.gelu_ffn_forward(x, w1, w2, out=fwd, stream=s)
    plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32")
    outs = [cupy.empty(sh, cupy.float32) for sh in ((T, D), (H, D), (D, H))]
    stages = profile_stages(plan, dy, x, w1, w2, fwd[1], fwd[2], fwd[3], out=outs, stream=s, reps=reps,
                            before_each=flush)
    row["plan stages ms"] = {k: round(v["ms"], 4) for k, v in stages.items()}
    plan.close()
    cupy.cuda.Device().synchronize()
    return row


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tf32-rs-probe.json"))
    a = p.parse_args(argv)
    import cupy
    import torch

    import cupyffn

    probe = Probe(cupy)
    print("registers / spill bytes per variant:", {label(v): (probe.regs[v], probe.spills[v]) for v in VARIANTS})
    rows = []
    for T in a.tokens:
        row = measure(cupy, torch, cupyffn, probe, T, a.reps)
        rows.append(row)
        print(f"\nT = {T}")
        for part in ("check", "finite", "nan outputs", "gemm1", "gemm3", "plan stages ms"):
            print(f"  {part}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in row[part].items()))
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "command": "python3 dev/tf32_rs_probe.py " + " ".join(argv or sys.argv[1:]),
               "registers": {label(v): probe.regs[v] for v in VARIANTS},
               "spill_bytes": {label(v): probe.spills[v] for v in VARIANTS}, "rows": rows}, a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
