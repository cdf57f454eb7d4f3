"""What converting a weight inside the sm90 GEMM (b_layout "kn32") saves against converting it first (GPU only):

    PYTHONPATH=. python3 dev/kn32_cost.py [--tokens 256,512,1024,2048] [--reps 10] [--probe N] [--out PATH]

The two backward GEMMs that read a weight, at the benchmark's D = 1536, H = 6144:
GEMM1 grad_gelu = grad_output [T, D] @ weight2 [D, H] with the tf32 plan's fp16 dgelu epilogue, and
GEMM3 grad_hidden = grad_linear1 [T, H] @ weight1 [H, D] with fp32 out. For each weight: the engine's conversion
pass of it alone (convert.cu's convert_kernel<FMT_F16S>, gathering its max as the engine does), the GEMM on the
converted fp16 codes ("kn", our kernel; GEMM3 also cuBLAS gemmEx, which the engine runs today), and the GEMM reading
the fp32 weight and converting each tile in the kernel ("kn32"), at each schedule "kn32" has (KN32_CONFIGS) and, for
"kn", the engine's choice too. Protocol: random operands, L2 flushed (1 GiB written) before each sample, CUDA
events around the call, median of --reps after 2 warm-ups (the flush, 1 GiB, also keeps the GPU busy while the host
checks the call's arguments). Output checked: "kn32" against "kn" on the same codes,
bit for bit, before timing (not with --probe N: every kernel compiled with _sm90_gemm.set_trace(True, N), which leaves
a part out: 3 the wgmma, 4 the kn32 conversion, 5 its proxy fence; wrong results, timing only; 6: "kn" at 128 x 128
with kn32's pipeline depth). JSON at --out (default $OUT/kn32_cost.json, OUT or .).
"""

import argparse
import ctypes
import os
import sys

from _event_timing import flushed_median_ms  # dev/_event_timing.py (the script's folder is on sys.path)
from _json_out import save_json

D, H = 1536, 6144


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,512,1024,2048")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--probe", type=int, default=0, help="compile with set_trace(True, N): 3 no wgmma, 4 no kn32 "
                        "conversion, 5 no proxy fence after it (timing only), 6 kn with kn32's pipeline depth")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kn32_cost.json"))
    args = parser.parse_args(argv)
    import cupy
    import numpy

    from cupyffn import _cublas, _gpu_engine, _kernels, _precision, _sm90_gemm as G

    if args.probe:
        G.set_trace(True, args.probe)

    dev = cupy.cuda.Device().id
    sms = _kernels.sm_count(dev)
    # 1 GiB: besides flushing L2, ~0.3 ms of GPU work in front of each sample, so that the host's argument checks of
    # gemm_tn / gemm_tn_dgelu (tens of us) are done before the GPU reaches the start event
    flush = cupy.empty(1 << 30, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = _cublas.acquire(dev)
    handle.bind(stream.ptr)
    consts = cupy.asarray([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=cupy.float32)
    state = cupy.zeros(4 * _kernels.STATE_SLOTS, dtype=cupy.int32)
    rng = numpy.random.default_rng(7)
    rows = []

    def timed(run):
        return flushed_median_ms(cupy, stream, run, lambda: flush.fill(0), args.reps, warmup=2)

    def conversion(w32, w16, slot):
        """The engine's conversion pass of one weight (gathering pass: codes at 2^state[slot], max into the state)."""
        kernel = _kernels.get_function("convert", f"convert_kernel<{_precision.FMT_F16S}>", dev)
        op = _gpu_engine._Operand("w", w32.shape[0], w32.shape[1], interleaved=False, planes=1)
        full = sms * _kernels.blocks_per_sm("convert", f"convert_kernel<{_precision.FMT_F16S}>", dev) * 2
        launch = _gpu_engine.convert_launch(kernel, [(op, w16.data.ptr, 0, slot)], full, rescue=0, counter=0,
                                            alpha_mask=0, state_ptr=ctypes.c_void_p(state.data.ptr),
                                            consts_ptr=ctypes.c_void_p(consts.data.ptr))
        job = launch.args[0].job[0]
        job.src, job.src_ld, job.vec = w32.data.ptr, w32.shape[1], 1
        return lambda: launch(stream.ptr)

    def record(T, gemm, case, schedule, ms, flops=0.0, nbytes=0):
        row = {"T": T, "gemm": gemm, "case": case, "schedule": schedule, "ms": ms}
        if flops:
            row["tflops"] = flops / ms / 1e9
        if nbytes:
            row["gbps"] = nbytes / ms / 1e6
        rows.append(row)
        rate = f"{row['tflops']:6.1f} TFLOP/s" if flops else (f"{row['gbps']:6.0f} GB/s" if nbytes else "")
        print(f"T={T:5d} {gemm:6s} {case:34s} {schedule:8s} {ms:8.4f} ms {rate}", flush=True)
        return ms

    def sched(cfg):
        return f"bn{cfg[0]}{'pp' if cfg[1] else ''}"

    def check_same(kn, k32, out, what):
        """kn32 gives kn's bits on the same codes (not with --probe: the probes leave parts of the kernel out)."""
        kn()
        want = out.copy()
        out.fill(numpy.nan)
        k32()
        stream.synchronize()
        bits = cupy.uint16 if out.dtype == cupy.float16 else cupy.uint32
        if not args.probe and not bool((out.view(bits) == want.view(bits)).all()):
            raise AssertionError(f"{what}: kn32 differs from kn on the same codes")

    w2 = cupy.asarray((0.02 * rng.standard_normal((D, H))).astype(numpy.float32))
    w1 = cupy.asarray((0.02 * rng.standard_normal((H, D))).astype(numpy.float32))
    w2_16, w1_16 = cupy.empty((D, H), cupy.float16), cupy.empty((H, D), cupy.float16)
    with stream:
        for w32, w16, slot, name in ((w2, w2_16, 1, "weight2"), (w1, w1_16, 4, "weight1")):
            run = conversion(w32, w16, slot)
            run()  # decides the slot's exponent from this weight's max (as the engine's first call would)
            stream.synchronize()
            state[2 * _kernels.STATE_SLOTS + slot] = 0
    e2, e1 = (int(v) for v in state[[1, 4]].get())
    print(f"exponents: weight2 2^{e2}, weight1 2^{e1}")
    summary = {}
    for T in (int(t) for t in args.tokens.split(",")):
        go = cupy.asarray(rng.standard_normal((T, D), dtype=numpy.float32).astype(numpy.float16))
        gl = cupy.asarray(rng.standard_normal((T, H), dtype=numpy.float32).astype(numpy.float16))
        x = cupy.asarray(rng.standard_normal((T, H), dtype=numpy.float32))
        t = cupy.tanh(x)
        out1 = cupy.empty((T, H), cupy.float16)
        out3 = cupy.empty((T, D), cupy.float32)
        amax = cupy.zeros(1, cupy.uint32)
        flops1, flops3 = 2 * T * D * H, 2 * T * H * D
        res = {}
        with stream:
            res["convert weight2"] = record(T, "GEMM1", "convert weight2 (convert.cu)", "-", timed(conversion(w2, w2_16, 1)),
                                            nbytes=6 * D * H)
            res["convert weight1"] = record(T, "GEMM3", "convert weight1 (convert.cu)", "-", timed(conversion(w1, w1_16, 4)),
                                            nbytes=6 * D * H)
            stream.synchronize()
            state[2 * _kernels.STATE_SLOTS:3 * _kernels.STATE_SLOTS] = 0
            chosen1 = G.choose_config(T, H, sms)
            for cfg in dict.fromkeys(G.KN32_CONFIGS + (chosen1,)):
                kw = dict(block_n=cfg[0], pingpong=cfg[1], stream=stream, alpha=2.0 ** -e2, amax=amax)
                kn = lambda kw=kw: G.gemm_tn_dgelu(go, w2_16, x, t, out1, b_layout="kn", **kw)
                res["GEMM1 kn " + sched(cfg)] = record(T, "GEMM1", "dgelu, fp16 weight2 (kn)", sched(cfg), timed(kn),
                                                       flops1)
                if cfg not in G.KN32_CONFIGS:
                    continue
                k32 = lambda kw=kw: G.gemm_tn_dgelu(go, w2, x, t, out1, b_layout=G.KN32, b_scale=2.0 ** e2, **kw)
                check_same(kn, k32, out1, f"T={T} GEMM1 {sched(cfg)}")
                res["GEMM1 kn32 " + sched(cfg)] = record(T, "GEMM1", "dgelu, fp32 weight2 converted (kn32)",
                                                         sched(cfg), timed(k32), flops1)
            g3 = _cublas.Gemm(T, D, H, _cublas.R_16F, _cublas.R_16F, _cublas.R_32F, name="gemm3")
            g3.a.value, g3.b.value, g3.c.value = gl.data.ptr, w1_16.data.ptr, out3.data.ptr
            g3.alpha.value, g3.beta.value = consts.data.ptr + 4, consts.data.ptr
            res["GEMM3 cublas"] = record(T, "GEMM3", "cuBLAS gemmEx, fp16 weight1", "cublas", timed(lambda: g3(handle)),
                                         flops3)
            for cfg in G.KN32_CONFIGS:
                kw = dict(block_n=cfg[0], pingpong=cfg[1], stream=stream)
                kn = lambda kw=kw: G.gemm_tn(gl, w1_16, out3, b_layout="kn", **kw)
                res["GEMM3 kn " + sched(cfg)] = record(T, "GEMM3", "fp32 out, fp16 weight1 (kn)", sched(cfg), timed(kn),
                                                       flops3)
                k32 = lambda kw=kw: G.gemm_tn(gl, w1, out3, b_layout=G.KN32, b_scale=2.0 ** e1, **kw)
                check_same(kn, k32, out3, f"T={T} GEMM3 {sched(cfg)}")
                res["GEMM3 kn32 " + sched(cfg)] = record(T, "GEMM3", "fp32 out, fp32 weight1 converted (kn32)",
                                                         sched(cfg), timed(k32), flops3)
        best1 = min(v for k, v in res.items() if k.startswith("GEMM1 kn "))
        best1_32 = min(v for k, v in res.items() if k.startswith("GEMM1 kn32"))
        best3 = min(res["GEMM3 cublas"], *(v for k, v in res.items() if k.startswith("GEMM3 kn ")))
        best3_32 = min(v for k, v in res.items() if k.startswith("GEMM3 kn32"))
        summary[T] = {"GEMM1: convert + best kn": res["convert weight2"] + best1, "GEMM1: best kn32": best1_32,
                      "GEMM3: convert + best 16-bit": res["convert weight1"] + best3, "GEMM3: best kn32": best3_32}
        print(f"T={T:5d} GEMM1 convert + kn {res['convert weight2'] + best1:.4f} ms vs kn32 {best1_32:.4f}; "
              f"GEMM3 convert + 16-bit {res['convert weight1'] + best3:.4f} ms vs kn32 {best3_32:.4f}", flush=True)
    _cublas.release(handle)
    save_json({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "command": " ".join(sys.argv),
               "reps": args.reps, "probe": args.probe, "results": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
