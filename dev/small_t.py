"""Where the time of a small-T backward goes, and what the alternatives to its GEMMs cost (GPU only):

    PYTHONPATH=. python3 dev/small_t.py [--tokens 256,512,1024] [--reps 20] [--out PATH]

  1. each backward GEMM (D = 1536, H = 6144, row-major as the engine issues them, _precision.GEMMS) as
     cublasGemmEx on fp16 operands (the tf32 plan's f16s form), as cublasLtMatmul on the same operands
     (the algorithm of cuBLASLt's heuristic: its GPU time, beside part 4's cheaper enqueue) and on the
     fp32 operands with CUBLAS_COMPUTE_32F_FAST_TF32 (TF32 tensor cores, no conversion pass);
  2. GEMM3 (M = T, N = D, K = H: at T = 256 only 24 output tiles of 128 x 128 for 132 SMs) split along K
     into S slices as one cublasGemmStridedBatchedEx into fp32 partials, then the partials summed
     (cupy.sum over the slice axis): both parts timed, fp16 and TF32;
  3. the kernel timeline of one tf32 plan call (CUPTI activity records, L2 flushed before the call):
     every kernel's stream, start and duration, the host's API calls that launched them; the call as it
     is and with the engine's serial enqueue (everything on the caller's stream, no events), each with
     input sets rotated so that no address repeats within --rotate calls;
  4. host cost: microseconds per plan call without CUPTI (queue drained first), and per enqueue of each
     GEMM as cublasGemmEx vs cublasLtMatmul (cupyffn._cublaslt.LtMatmul) at the call's shapes;
  5. (--parts batched, not in the default set) each GEMM as cublasGemmEx against cublasGemmBatchedEx of one
     matrix whose pointers are read from a device table (what a replayed CUDA graph of the call needs): GPU
     time (the two alternating, one flushed sample each per round), host time per enqueue, same bits?

Protocol for 1 and 2: fresh random operands (normal, weights 0.02 N(0, 1) as the benchmark's), the L2
flushed (256 MiB written) before each sample, CUDA events around the call only, median of --reps after
3 warm-ups. Each result is checked once against a float64 product of the same fp32 data (rel. L2, output
NaN-poisoned before the call). Results: JSON at --out (default $OUT/small_t.json, OUT or .).
"""

import argparse
import ctypes
import os
import statistics
import sys

import numpy

from _event_timing import flushed_median_ms  # dev/_event_timing.py (the script's folder is on sys.path)
from _json_out import save_json

D, H = 1536, 6144
SPLITS = (2, 3, 4, 6, 8)


def gemm_layout(g, T):
    """(M, N, K, a_trans) of backward GEMM g, row-major C[M,N] = op(A) @ B[K,N] (cupyffn/_precision.py)."""
    return {"gemm1": (T, H, D, False), "gemm2": (D, H, T, True),
            "gemm3": (T, D, H, False), "gemm4": (H, D, T, True)}[g]


def rel_l2(x, ref):
    x, ref = numpy.asarray(x, numpy.float64), numpy.asarray(ref, numpy.float64)
    return float(numpy.linalg.norm(x - ref) / numpy.linalg.norm(ref))


class Bench:
    def __init__(self, reps):
        import cupy

        from cupyffn import _cublas

        self.cupy, self.cb, self.reps = cupy, _cublas, reps
        self.flush_buf = cupy.empty(256 << 20, dtype=cupy.uint8)
        self.handle = _cublas.acquire(cupy.cuda.Device().id)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.handle.bind(self.stream.ptr)
        self.consts = cupy.asarray([0.0, 1.0], dtype=cupy.float32)
        self.rng = numpy.random.default_rng(7)

    def time(self, run):
        return flushed_median_ms(self.cupy, self.stream, run, lambda: self.flush_buf.fill(0), self.reps, warmup=3)

    def operands(self, g, T):
        """fp32 A (as stored: [K, M] if a_trans) and B [K, N] with the benchmark's scales."""
        m, n, k, a_trans = gemm_layout(g, T)
        a_shape = (k, m) if a_trans else (m, k)
        a = self.rng.standard_normal(a_shape, dtype=numpy.float32)
        b = self.rng.standard_normal((k, n), dtype=numpy.float32)
        if g in ("gemm1", "gemm3"):
            b *= numpy.float32(0.02)  # the weight
        return a, b

    def gemm(self, a, b, m, n, k, a_trans, dtype, compute, lt=False):
        """A prebuilt _cublas.Gemm (or, `lt`, a cuBLASLt matmul with its heuristic's algorithm: the engine's
        other GEMM backend) over device copies of a, b in `dtype`, and its output."""
        cupy, cb = self.cupy, self.cb
        code = cb.R_16F if dtype == numpy.float16 else cb.R_32F
        da, db = cupy.asarray(a.astype(dtype)), cupy.asarray(b.astype(dtype))
        c = cupy.full((m, n), numpy.nan, dtype=cupy.float32)
        if lt:
            from cupyffn import _cublaslt

            plan = _cublaslt.LtMatmul(m, n, k, code, code, cb.R_32F, a_trans=a_trans, name="small_t",
                                      device_id=cupy.cuda.Device().id)
        else:
            plan = cb.Gemm(m, n, k, code, code, cb.R_32F, a_trans=a_trans, compute=compute, name="small_t")
        plan.a.value, plan.b.value, plan.c.value = da.data.ptr, db.data.ptr, c.data.ptr
        plan.alpha.value, plan.beta.value = self.consts.data.ptr + 4, self.consts.data.ptr
        return (lambda: plan(self.handle)), c, (da, db)

    def split_k(self, a, b, m, n, k, s, dtype, compute):
        """GEMM3's form split along K into s slices (one strided-batched call into partials [s, m, n]),
        then summed; returns (gemm only, gemm + sum, output)."""
        cupy, cb = self.cupy, self.cb
        code = cb.R_16F if dtype == numpy.float16 else cb.R_32F
        da, db = cupy.asarray(a.astype(dtype)), cupy.asarray(b.astype(dtype))
        kc = k // s
        parts = cupy.full((s, m, n), numpy.nan, dtype=cupy.float32)
        c = cupy.full((m, n), numpy.nan, dtype=cupy.float32)
        lib = cb.library()
        i32, i64 = ctypes.c_int, ctypes.c_longlong
        one, zero = ctypes.c_void_p(self.consts.data.ptr + 4), ctypes.c_void_p(self.consts.data.ptr)
        # row-major C[m,n] = A[m,k] @ B[k,n] is column-major C^T = B^T A^T: cuBLAS's A is our B.
        args = (self.handle.ptr, i32(cb.OP_N), i32(cb.OP_N), i32(n), i32(m), i32(kc), one,
                ctypes.c_void_p(db.data.ptr), i32(code), i32(n), i64(kc * n),
                ctypes.c_void_p(da.data.ptr), i32(code), i32(k), i64(kc),
                zero, ctypes.c_void_p(parts.data.ptr), i32(cb.R_32F), i32(n), i64(m * n),
                i32(s), i32(compute), i32(cb.GEMM_DEFAULT))

        def gemm():
            cb.check(lib.cublasGemmStridedBatchedEx(*args), "cublasGemmStridedBatchedEx")

        def both():
            gemm()
            cupy.sum(parts, axis=0, out=c)
        return gemm, both, c, (da, db, parts)


def part_gemms(bench, tokens, results):
    cb = bench.cb
    forms = (("f16", numpy.float16, cb.COMPUTE_32F), ("tf32", numpy.float32, cb.COMPUTE_32F_FAST_TF32))
    for T in tokens:
        for g in ("gemm1", "gemm2", "gemm3", "gemm4"):
            m, n, k, a_trans = gemm_layout(g, T)
            a, b = bench.operands(g, T)
            ref = (a.astype(numpy.float64).T if a_trans else a.astype(numpy.float64)) @ b.astype(numpy.float64)
            for form, dtype, compute in forms + (("f16-lt", numpy.float16, cb.COMPUTE_32F),):
                run, c, keep = bench.gemm(a, b, m, n, k, a_trans, dtype, compute, lt=form.endswith("-lt"))
                with bench.stream:
                    run()
                bench.stream.synchronize()
                err = rel_l2(c.get(), ref)
                ms = bench.time(run)
                row = {"part": "gemm", "T": T, "gemm": g, "form": form, "ms": ms, "rel_l2": err,
                       "tflops": 2 * m * n * k / ms / 1e9}
                results.append(row)
                print(f"T={T:5d} {g} {form:5s} {ms:8.4f} ms {row['tflops']:6.1f} TFLOP/s rel.L2 {err:.1e}", flush=True)
            if g != "gemm3":
                continue
            for form, dtype, compute in forms:
                for s in SPLITS:
                    if k % (8 * s):
                        continue
                    gemm, both, c, keep = bench.split_k(a, b, m, n, k, s, dtype, compute)
                    with bench.stream:
                        both()
                    bench.stream.synchronize()
                    err = rel_l2(c.get(), ref)
                    ms_gemm, ms_both = bench.time(gemm), bench.time(both)
                    results.append({"part": "split_k", "T": T, "gemm": g, "form": form, "splits": s,
                                    "ms_gemm": ms_gemm, "ms": ms_both, "rel_l2": err})
                    print(f"T={T:5d} {g} {form:5s} split {s}: gemm {ms_gemm:.4f} + sum = {ms_both:.4f} ms "
                          f"rel.L2 {err:.1e}", flush=True)


def part_batched(bench, tokens, results, calls=200):
    """Each backward GEMM on fp16 operands as cublasGemmEx and as cublasGemmBatchedEx of one matrix with its
    pointers in a device table (the form a replayed graph needs, cupyffn/_replay.py): GPU time (the two timed in
    alternation, --reps rounds, median of each) and host enqueue time, and whether the outputs are bit-identical."""
    import time

    cupy, cb = bench.cupy, bench.cb
    for T in tokens:
        for g in ("gemm1", "gemm2", "gemm3", "gemm4"):
            m, n, k, a_trans = gemm_layout(g, T)
            a, b = bench.operands(g, T)
            run, c, (da, db) = bench.gemm(a, b, m, n, k, a_trans, numpy.float16, cb.COMPUTE_32F)
            c2 = cupy.full((m, n), numpy.nan, dtype=cupy.float32)
            table = cupy.asarray([da.data.ptr, db.data.ptr, c2.data.ptr], dtype=cupy.uint64)
            cupy.cuda.Device().synchronize()  # the table (copied on the null stream) before bench.stream reads it
            gemm = cb.Gemm(m, n, k, cb.R_16F, cb.R_16F, cb.R_32F, a_trans=a_trans, name="batched")
            gemm.alpha.value, gemm.beta.value = bench.consts.data.ptr + 4, bench.consts.data.ptr
            indirect = lambda: gemm.indirect(bench.handle, table.data.ptr)  # noqa: E731
            with bench.stream:
                run()
                indirect()
            bench.stream.synchronize()
            same = bool(cupy.array_equal(c, c2))
            finite = bool(cupy.isfinite(c2).all())
            direct_ms, indirect_ms = [], []
            for _ in range(bench.reps):
                direct_ms.append(flushed_median_ms(cupy, bench.stream, run, lambda: bench.flush_buf.fill(0), 1, 0))
                indirect_ms.append(flushed_median_ms(cupy, bench.stream, indirect, lambda: bench.flush_buf.fill(0),
                                                     1, 0))
            host = {}
            for label, fn in (("direct", run), ("indirect", indirect)):
                with bench.stream:
                    bench.stream.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    host[label] = (time.perf_counter() - t0) / calls * 1e6
                    bench.stream.synchronize()
            row = {"part": "batched", "T": T, "gemm": g, "gemmex_ms": statistics.median(direct_ms),
                   "batched1_ms": statistics.median(indirect_ms), "bit_identical": same, "finite": finite,
                   "gemmex_host_us": host["direct"], "batched1_host_us": host["indirect"]}
            results.append(row)
            print(f"T={T:5d} {g} GemmEx {row['gemmex_ms']:.4f} ms / batched(1) {row['batched1_ms']:.4f} ms "
                  f"({row['batched1_ms'] / row['gemmex_ms']:.3f}), host {host['direct']:.1f} / {host['indirect']:.1f} us, "
                  f"identical {same}", flush=True)


def _api_name(cupti, kind, cbid):
    try:
        domain = cupti.CallbackDomain.RUNTIME_API if kind == cupti.ActivityKind.RUNTIME else cupti.CallbackDomain.DRIVER_API
        return str(cupti.get_callback_name(domain, cbid))
    except Exception:
        return f"{'rt' if kind == cupti.ActivityKind.RUNTIME else 'drv'}:{cbid}"


def part_timeline(tokens, results, iters=16, rotate=4):
    """Kernel records of the tf32 plan's calls (the median call's are kept), L2 flushed before each, the inputs
    rotated over `rotate` sets: the plan's call graph ("graph"), its launches from the host ("streams": the plan
    built with EngineOptions(call_graph=False)) and the engine's serial enqueue of them ("serial")."""
    import cupy
    from cupti import cupti

    import cupyffn
    from cupyffn import workloads as W
    from cupyffn._options import EngineOptions

    K = cupti.ActivityKind
    kernels, apis = [], []

    def requested():
        return 8 << 20, 0

    def completed(records):
        for a in records:
            if a.kind == K.CONCURRENT_KERNEL:
                kernels.append((a.correlation_id, a.start, a.end, str(a.name), int(a.stream_id)))
            elif a.kind in (K.RUNTIME, K.DRIVER):
                apis.append((a.correlation_id, a.start, a.end, a.kind, int(a.cbid)))

    flush = cupy.empty(256 << 20, dtype=cupy.uint8)
    for T in tokens:
        pool = []
        for k in range(rotate):
            inputs = W.make_inputs((T,), xp=cupy, seed=11 + k)
            pool.append([inputs[n] for n in W.INPUT_NAMES])
        out = (cupy.empty((T, D), cupy.float32), cupy.empty((H, D), cupy.float32), cupy.empty((D, H), cupy.float32))
        plans = {"graph": cupyffn.GeluFFNBackward(T, D, H, precision="tf32")}
        plans["streams"] = plans["serial"] = cupyffn.GeluFFNBackward(T, D, H, precision="tf32",
                                                                   _options=EngineOptions(call_graph=False))
        stream = cupy.cuda.Stream(non_blocking=True)

        def serial(i):  # the same call with the engine's serial enqueue (set_io through a normal call first)
            plan(*pool[i % rotate], out=out, stream=stream)
            stream.synchronize()
            return lambda: plan._engine.enqueue(stream.ptr, serial=True)

        for mode in ("graph", "streams", "serial"):
            plan = plans[mode]
            for i in range(rotate):
                plan(*pool[i], out=out, stream=stream)
            stream.synchronize()
            kernels.clear()
            apis.clear()
            windows = []
            enabled = [K.CONCURRENT_KERNEL, K.RUNTIME, K.DRIVER]
            for k in enabled:
                cupti.activity_enable(k)
            cupti.activity_register_callbacks(requested, completed)
            try:
                for i in range(iters):
                    run = serial(i) if mode == "serial" else (lambda i=i: plan(*pool[i % rotate], out=out, stream=stream))
                    with stream:
                        flush.fill(0)
                    stream.synchronize()
                    t0 = cupti.get_timestamp()
                    run()
                    t1 = cupti.get_timestamp()
                    stream.synchronize()
                    windows.append((t0, t1))
                cupti.activity_flush_all(0)
            finally:
                for k in enabled:
                    cupti.activity_disable(k)
            spans = []
            for w, (t0, t1) in enumerate(windows):
                launch = {a[0]: a for a in apis if t0 <= a[1] <= t1}
                mine = sorted((s_, e, name, sid, launch[corr]) for corr, s_, e, name, sid in kernels if corr in launch)
                spans.append(((max(m[1] for m in mine) - mine[0][0]) / 1e3, w, mine, launch))
            spans.sort()
            span, w, mine, launch = spans[len(spans) // 2]  # the median iteration
            t0, t1 = windows[w]
            base = mine[0][0]
            rows = [{"kernel": name[:60], "stream": sid, "start_us": (s_ - base) / 1e3, "us": (e - s_) / 1e3,
                     "launched_at_us": (la[1] - t0) / 1e3} for s_, e, name, sid, la in mine]
            calls = sorted(launch.values(), key=lambda a: a[1])
            api_rows = [{"api": _api_name(cupti, kind, cbid), "at_us": (st - t0) / 1e3, "us": (en - st) / 1e3}
                        for _, st, en, kind, cbid in calls]
            results.append({"part": "timeline", "T": T, "mode": mode, "rotate": rotate, "span_us": span,
                            "spans_us": sorted(x[0] for x in spans), "host_us": (t1 - t0) / 1e3,
                            "api_calls": len(api_rows), "api_us": sum(r["us"] for r in api_rows),
                            "kernels": rows, "apis": api_rows})
            print(f"T={T} tf32 plan, {mode}: span median {span:.1f} us (min {spans[0][0]:.1f}, max {spans[-1][0]:.1f}), "
                  f"host call {(t1 - t0) / 1e3:.1f} us, {len(api_rows)} API calls, {sum(r['us'] for r in api_rows):.1f} us in them")
            for r in rows:
                print(f"   stream {r['stream']:3d} launched {r['launched_at_us']:7.1f}  start {r['start_us']:7.1f}  "
                      f"{r['us']:7.1f} us  {r['kernel']}")
        plans["graph"].close()
        plans["streams"].close()
    try:
        cupti.finalize()
    except Exception:
        pass


def part_host(tokens, results, calls=200):
    """Host microseconds per plan call (CUPTI off) and per GEMM enqueue, gemmEx vs cuBLASLt."""
    import cupy

    import cupyffn
    from cupyffn import _cublas, _cublaslt
    from cupyffn import workloads as W

    from host_ab import host_us  # dev/host_ab.py: queue drained before each timed call

    def per_call(run, stream):
        return host_us(run, stream, calls)

    stream = cupy.cuda.Stream(non_blocking=True)
    for T in tokens:
        pool = [[W.make_inputs((T,), xp=cupy, seed=40 + k)[n] for n in W.INPUT_NAMES] for k in range(2)]
        out = (cupy.empty((T, D), cupy.float32), cupy.empty((H, D), cupy.float32), cupy.empty((D, H), cupy.float32))
        plan = cupyffn.GeluFFNBackward(T, D, H, precision="tf32")
        same = per_call(lambda: plan(*pool[0], out=out, stream=stream), stream)
        flip = [0]

        def alternating():
            flip[0] ^= 1
            plan(*pool[flip[0]], out=out, stream=stream)
        other = per_call(alternating, stream)
        plan.close()
        row = {"part": "host", "T": T, "plan_call_same_inputs_us": same, "plan_call_alternating_inputs_us": other}
        handle = _cublas.acquire(cupy.cuda.Device().id)
        handle.bind(stream.ptr)
        consts = cupy.asarray([0.0, 1.0], dtype=cupy.float32)
        for g in ("gemm1", "gemm2", "gemm3", "gemm4"):
            m, n, k, a_trans = gemm_layout(g, T)
            a = cupy.ones((k, m) if a_trans else (m, k), cupy.float16)
            b = cupy.ones((k, n), cupy.float16)
            c = cupy.empty((m, n), cupy.float32)
            for label, cls in (("gemmEx", _cublas.Gemm), ("lt", _cublaslt.LtMatmul)):
                kw = {"device_id": cupy.cuda.Device().id} if cls is _cublaslt.LtMatmul else {}
                p = cls(m, n, k, _cublas.R_16F, _cublas.R_16F, _cublas.R_32F, a_trans=a_trans, name=g, **kw)
                p.a.value, p.b.value, p.c.value = a.data.ptr, b.data.ptr, c.data.ptr
                p.alpha.value, p.beta.value = consts.data.ptr + 4, consts.data.ptr
                row[f"{g}_{label}_us"] = per_call(lambda: p(handle), stream)
        _cublas.release(handle)
        results.append(row)
        print(f"T={T} host: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_us")), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,512,1024", help="comma-separated token counts")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--parts", default="gemms,timeline,host", help="comma-separated: gemms, batched, timeline, host")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "small_t.json"))
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    parts = args.parts.split(",")
    import cupy

    results = []
    meta = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "tokens": tokens,
            "reps": args.reps, "command": " ".join(sys.argv), "results": results}
    try:
        if "gemms" in parts:
            part_gemms(Bench(args.reps), tokens, results)
        if "batched" in parts:
            part_batched(Bench(args.reps), tokens, results)
        if "timeline" in parts:
            part_timeline(tokens, results)
        if "host" in parts:
            part_host(tokens, results)
    finally:
        save_json(meta, args.out)


if __name__ == "__main__":
    main()
