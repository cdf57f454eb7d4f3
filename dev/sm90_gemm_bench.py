"""Times the sm_90a fused GEMM1 + GELU derivative (cupyffn/gemm/sm90 gemm_tn_dgelu) against cuBLAS, most important
measurements first, within a time budget:

    PYTHONPATH=. python3 dev/sm90_gemm_bench.py [--budget-s 55] [--reps 10] [--out PATH] [--only TEXT]

  1. GEMM1 with the fused GELU derivative (fp16 operands, scaled fp16 out) vs cuBLAS GEMM1 alone and
     cuBLAS GEMM1 + the engine's dgelu pass, T = 2048, 4096, 8192 (fused <= 1.05x cuBLAS GEMM1 alone at
     T >= 2048): the staged epilogue in every schedule (bn256, bn128, then ping-pong bn128pp), the direct
     epilogue in bn256 and, at T = 8192, bn128pp;
  2. the epilogue warps (bn128) at T = 2048 ... 8192 and the small T (256, 512, 1024) with their cuBLAS references;
  3. the rest: memory mode, the bf16x3 planes (vs cuBLAS bf16 + the engine's dgelu kernel), cuBLAS + a CuPy
     elementwise pass, host cost.
(A pipeline bug traps after 2 s, which ends the CUDA context and so the run; everything before is already
measured and saved. The fused ping-pong rows of 1 come after the cooperative ones for that reason.)

Shapes (D = 1536, H = 6144): GEMM1 grad_gelu M = T, N = H, K = D; A [T, D], B [D, H] as stored (a weight).
Protocol: fresh random inputs; each kernel variant compiled on first use, in the check call; L2
flushed (256 MiB written) before each sample; CUDA events around the call only; median of --reps
after --warmup. Each of our results is first checked once against cuBLAS on the same operands
(rel. L2; output NaN-poisoned before the call) and the check is printed.

One line is printed (flushed) per measurement as it is made, and the JSON (default
$OUT/sm90_gemm_bench.json, OUT or .) is rewritten after each one; when the budget is spent (checked
between measurements) the remaining ones are listed as skipped. The tables come last.
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy

from _json_out import save_json  # dev/_json_out.py (the script's folder is on sys.path)

D, H = 1536, 6144
FUSED_TS = (2048, 4096, 8192)
ALPHA = 0.25  # the fp16 epilogue's power-of-two scale
# rel. L2 of ours vs cuBLAS above which a check is marked BAD: fp16 (a rounding step on a few elements), the bf16x3
# hi plane (the same, 8 bits)
TARGET = 1.05  # fused GEMM1 + dgelu <= 1.05x cuBLAS GEMM1 alone at T >= 2048 (docs/decisions/025-sm90-gemm1-dgelu-fusion.md)
TOLERANCE = {"f16": 2.0 ** -10, "f16_mem": 2.0 ** -10, "bf16x3": 2.0 ** -8}


def config_name(block_n, pingpong):
    return f"bn{block_n}{'pp' if pingpong else ''}"


def shape(gemm, t):
    """(M, N, K) of GEMM1 at T tokens."""
    assert gemm == "gemm1", gemm
    return t, H, D


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=55.0,
                   help="wall-clock seconds from the start (compile included) after which no new measurement starts")
    p.add_argument("--reps", type=int, default=10, help="timed samples per measurement (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before the samples")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/sm90_gemm_bench.json, OUT or .)")
    p.add_argument("--only", default=None, metavar="TEXT[|TEXT...]",
                   help="only the measurements whose name contains one of the |-separated TEXTs")
    args = p.parse_args(argv)
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps}, {args.warmup}")
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "."), "sm90_gemm_bench.json")
    return args


class Runner:
    """Runs (name, fn) items in order while the budget lasts; fn returns a record (dict) or a list of
    them. Saves the JSON after every item. A failing item is recorded; `fatal(exc)` true stops the run
    (a dead CUDA context makes every later item fail)."""

    def __init__(self, budget_s, path, clock=time.perf_counter, start=None, emit=print, fatal=lambda exc: False):
        self.budget_s, self.path, self.clock, self.emit, self.fatal = budget_s, path, clock, emit, fatal
        self.start = clock() if start is None else start
        self.result = dict(budget_s=budget_s, records=[], errors=[], skipped=[], complete=False, stopped=None)

    def elapsed(self):
        return self.clock() - self.start

    def save(self):
        self.result["elapsed_s"] = round(self.elapsed(), 3)
        save_json(self.result, self.path)

    def run(self, items):
        items = list(items)
        for i, (name, fn) in enumerate(items):
            if self.elapsed() >= self.budget_s:
                self.result["skipped"] = [n for n, _ in items[i:]]
                self.result["stopped"] = f"budget of {self.budget_s:g} s spent after {self.elapsed():.1f} s"
                self.emit(f"[{self.elapsed():5.1f}s] budget spent: {len(items) - i} measurements skipped", flush=True)
                break
            try:
                got = fn()
            except Exception as e:  # record and go on: one run should tell as much as it can
                text = f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                self.result["errors"].append(text)
                self.emit(f"[{self.elapsed():5.1f}s] ERROR {text}", flush=True)
                if self.fatal(e):
                    self.result["skipped"] = [n for n, _ in items[i + 1:]]
                    self.result["stopped"] = "the CUDA context is unusable after: " + text
                    self.emit(f"[{self.elapsed():5.1f}s] stopping: the CUDA context is unusable", flush=True)
                    self.save()
                    break
                self.save()
                continue
            for record in got if isinstance(got, list) else [got]:
                record["name"] = name
                self.result["records"].append(record)
                self.emit(f"[{self.elapsed():5.1f}s] {describe(record)}", flush=True)
            self.save()
        else:
            self.result["complete"] = True
        self.save()
        return self.result


def describe(r):
    """One line for a record."""
    what = f"{r['section']:5} {r.get('gemm', 'gemm1'):5} T={r['T']:<5} {r['impl']:<30}"
    if r["impl"] == "host":
        return f"{what} " + ", ".join(f"{k} {v:.1f} us" for k, v in r.items() if k.endswith("_us"))
    text = f"{what} {r['ms']:8.4f} ms {r['tflops']:6.1f} TFLOP/s"
    if "err" in r:
        text += f"  check vs cuBLAS: rel L2 {r['err']:.2e} finite={r['finite']} {'ok' if r['ok'] else 'BAD'}"
    return text


class Bench:
    """The CUDA side: operands and cuBLAS references made on first use and kept, timing, checks."""

    def __init__(self, reps, warmup):
        import cupy

        from cupyffn.cuda import kernels as _kernels
        from cupyffn.gemm import cublas as _cublas
        from cupyffn.gemm import sm90

        self.cupy, self.cublas, self.kernels, self.sm90 = cupy, _cublas, _kernels, sm90
        self.reps, self.warmup = reps, warmup
        self.device = cupy.cuda.Device()
        self.stream = cupy.cuda.get_current_stream()
        self.flush = cupy.empty(256 << 20, dtype=cupy.uint8)
        self.events = cupy.cuda.Event(), cupy.cuda.Event()
        self.handle = _cublas.acquire(self.device.id)
        self.handle.bind(self.stream.ptr)
        self.one = cupy.ones(1, cupy.float32)
        self.zero = cupy.zeros(1, cupy.float32)
        self._fused = {}
        self._pass_f16 = None

    def close(self):
        self.stream.synchronize()
        self.cublas.release(self.handle)

    # ---- helpers ---------------------------------------------------------------------------------
    def timed(self, fn):
        cupy, (start, stop) = self.cupy, self.events
        samples = []
        for i in range(self.warmup + self.reps):
            self.flush.fill(i & 0xFF)
            start.record(self.stream)
            fn()
            stop.record(self.stream)
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
        return statistics.median(samples[self.warmup:])

    def rel_l2(self, x, ref):
        cupy = self.cupy
        ref = ref.astype(cupy.float64)
        return float(cupy.linalg.norm(x.astype(cupy.float64) - ref) / cupy.linalg.norm(ref))

    def random16(self, rows, cols):
        cupy = self.cupy
        return cupy.random.standard_normal((rows, cols), dtype=cupy.float32).astype(cupy.float16)

    @staticmethod
    def to_bf16_bits(x16):
        """bf16 bit patterns of the fp16 values (truncated: any finite values do for timing)."""
        import cupy

        return (x16.astype(cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)

    def bf16_value(self, bits):
        cupy = self.cupy
        return (bits.astype(cupy.uint32) << 16).view(cupy.float32)

    def cublas_tn(self, a, b, c):
        """c[M, N] fp32 = a[M, K] @ b[N, K]^T through cublasGemmEx (fp16 or bf16 in, fp32 out), as the engine calls it."""
        m, k = a.shape
        n = b.shape[0]
        cb = self.cublas
        code = cb.R_16F if a.dtype == numpy.float16 else cb.R_16BF
        g = cb.Gemm(m, n, k, code, code, cb.R_32F, b_trans=True, lda=k, ldb=k, ldc=n, name="bench")
        g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c.data.ptr
        g.alpha.value, g.beta.value = self.one.data.ptr, self.zero.data.ptr
        handle = self.handle
        return lambda: g(handle)

    def check(self, out, ref, fmt, call, compared=None):
        """NaN-poison out, call once, compare `compared` (default out; the bf16x3 planes: the hi plane) with ref:
        dict(err, finite, ok)."""
        cupy = self.cupy
        out.fill(0x7FC0 if out.dtype == numpy.uint16 else numpy.nan)
        call()
        self.stream.synchronize()
        compared = out if compared is None else compared
        got = self.bf16_value(compared) if compared.dtype == numpy.uint16 else compared
        finite = bool(cupy.isfinite(got).all())
        ref_v = self.bf16_value(ref) if ref.dtype == numpy.uint16 else ref
        err = self.rel_l2(got, ref_v)
        return dict(err=err, finite=finite, ok=bool(finite and err <= TOLERANCE[fmt]))

    def record(self, section, gemm, t, impl, ms, **extra):
        m, n, k = shape(gemm, t)
        return dict(section=section, gemm=gemm, T=t, M=m, N=n, K=k, impl=impl, ms=ms,
                    tflops=2.0 * m * n * k / ms * 1e-9, **extra)

    # ---- GEMM1 + GELU derivative -----------------------------------------------------------------
    def fused_state(self, t):
        if t not in self._fused:
            cupy = self.cupy
            m, n, k = shape("gemm1", t)
            a, b = self.random16(m, k), self.random16(n, k)
            x = 2 * cupy.random.standard_normal((m, n), dtype=cupy.float32)
            # cupy arrays first, Python floats (weak scalars): every step stays float32
            tt = cupy.tanh((x + x * x * x * 0.044715) * 0.7978845608028654)
            acc = cupy.full((m, n), cupy.nan, cupy.float32)
            run = self.cublas_tn(a, b, acc)
            run()
            self.stream.synchronize()
            # the reference of the fp16 epilogue: cuBLAS's fp32 product * gelu'(x, t) * alpha, rounded to fp16
            grad = (tt + 1) * 0.5 + x * (1 - tt * tt) * (x * x * 0.134145 + 1) * (0.5 * 0.7978845608028654)
            ref16 = (acc * grad * ALPHA).astype(cupy.float16)
            assert grad.dtype == cupy.float32 and ref16.dtype == cupy.float16
            self._fused[t] = dict(a=a, b=b, x=x, t=tt, acc=acc, grad=grad, run_cublas=run, ref16=ref16,
                                  out16=cupy.empty((m, n), cupy.float16))
        return self._fused[t]

    def fused_bf16_state(self, t):
        s = self.fused_state(t)
        if "a_bf" not in s:
            cupy = self.cupy
            s["a_bf"], s["b_bf"] = self.to_bf16_bits(s["a"]), self.to_bf16_bits(s["b"])
            acc_bf = cupy.full(s["acc"].shape, cupy.nan, cupy.float32)
            s["acc_bf"] = acc_bf
            s["run_cublas_bf"] = self.cublas_tn(s["a_bf"], s["b_bf"], acc_bf)
            s["run_cublas_bf"]()
            self.stream.synchronize()
            # round to nearest even, as common.cuh's bf16_bits (finite values here)
            u = (acc_bf * s["grad"]).view(cupy.uint32).astype(cupy.uint64)
            s["ref_bf"] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)
            s["outbf"] = cupy.empty(s["acc"].shape, cupy.uint16)  # the engine's dgelu kernel's bf16 out
            s["out3"] = cupy.empty((s["acc"].shape[0], 3 * s["acc"].shape[1]), cupy.uint16)  # the bf16x3 planes
        return s

    def fused_cublas(self, t):
        s = self.fused_state(t)
        return self.record("fused", "gemm1", t, "cublas_gemm1_f16_f32out", self.timed(s["run_cublas"]))

    def pass_f16(self):
        if self._pass_f16 is None:
            self._pass_f16 = self.cupy.ElementwiseKernel(
                "float32 g, float32 x, float32 t, float32 alpha", "float16 y",
                "const float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * "
                "(1.0f + 0.134145f * x * x); y = (float16)(g * d * alpha);", "sm90_bench_dgelu_pass")
        return self._pass_f16

    def fused_cublas_pass(self, t):
        s = self.fused_state(t)
        kernel, run, alpha = self.pass_f16(), s["run_cublas"], numpy.float32(ALPHA)
        acc, x, tt, out16 = s["acc"], s["x"], s["t"], s["out16"]
        return self.record("fused", "gemm1", t, "cublas+cupy_pass_f16",
                           self.timed(lambda: (run(), kernel(acc, x, tt, alpha, out16))))

    def engine_pass_bf16(self, t):
        """cuBLAS bf16 GEMM1 + the engine's dgelu kernel (bf16 out), and that kernel alone."""
        s = self.fused_bf16_state(t)
        launch = self.engine_dgelu(s["acc_bf"], s, t)
        ptr, run = self.stream.ptr, s["run_cublas_bf"]
        return [self.record("fused", "gemm1", t, "cublas_bf16+engine_pass_bf16", self.timed(lambda: (run(), launch(ptr)))),
                self.record("fused", "gemm1", t, "engine_pass_bf16_alone", self.timed(lambda: launch(ptr)))]

    def fused_cublas_bf16(self, t):
        s = self.fused_bf16_state(t)
        return self.record("fused", "gemm1", t, "cublas_gemm1_bf16_f32out", self.timed(s["run_cublas_bf"]))

    def fused_cublas_engine_f16(self, t):
        """cuBLAS fp16 GEMM1 + the engine's dgelu kernel (bf16 out: the bytes of the scaled-fp16 pass, which
        needs the engine's scale state) on its fp32 product: what the fused kernel replaces."""
        s = self.fused_bf16_state(t)
        launch = self.engine_dgelu(s["acc"], s, t)
        ptr, run = self.stream.ptr, s["run_cublas"]
        return self.record("fused", "gemm1", t, "cublas_f16+engine_pass", self.timed(lambda: (run(), launch(ptr))))

    def engine_dgelu(self, acc, s, t):
        """A launch of the engine's dgelu kernel (bf16 out) reading acc, x, t, writing s["outbf"]."""
        k, device = self.kernels, self.device.id
        m, n, _ = shape("gemm1", t)
        dgelu = k.get_function("dgelu", "dgelu_kernel<1>", device)
        job = k.DgeluJob()
        job.grad_gelu, job.x, job.t, job.dst = acc.data.ptr, s["x"].data.ptr, s["t"].data.ptr, s["outbf"].data.ptr
        job.grad_gelu_ld = job.x_ld = job.t_ld = job.dst_ld = n
        job.rows, job.cols, job.vec = m, n, 1
        launch = k.KernelLaunch(dgelu, job, ctypes.c_void_p(0), ctypes.c_void_p(0))
        items = m * -(-n // (8 * k.BLOCK))  # the engine's grid (cupyffn/f32/launches.py)
        launch.grid = max(1, min(items, k.sm_count(device) * k.blocks_per_sm("dgelu", "dgelu_kernel<1>", device) * 2))
        return launch

    def fused_ours(self, t, fmt, block_n, pingpong, epilogue="staged"):
        """fmt: f16 (scaled fp16 out), f16_mem (the same, t recomputed), bf16x3 (bf16 operands, three bf16 planes
        out; the hi plane checked); epilogue: one of sm90.EPILOGUES. B is weight2 as stored ([K, N])."""
        s = self.fused_bf16_state(t) if fmt == "bf16x3" else self.fused_state(t)
        fn = self.sm90.gemm_tn_dgelu
        if fmt == "bf16x3":
            a, b, x, tt, out, ref, kw = s["a_bf"], s["b_bf"], s["x"], s["t"], s["out3"], s["ref_bf"], dict(planes=3)
            compared = out[:, :ref.shape[1]]
        else:
            a, b, x, out, ref, kw = s["a"], s["b"], s["x"], s["out16"], s["ref16"], dict(alpha=ALPHA)
            tt, compared = (None if fmt == "f16_mem" else s["t"]), None
        b = self.cupy.ascontiguousarray(b.T)

        def call():
            fn(a, b, x, tt, out, block_n=block_n, pingpong=pingpong, epilogue=epilogue, **kw)

        checked = self.check(out, ref, fmt, call, compared)
        return self.record("fused", "gemm1", t, f"ours_dgelu_{fmt}_{epilogue}_" + config_name(block_n, pingpong),
                           self.timed(call), cfg=config_name(block_n, pingpong), fmt=fmt, epi=epilogue, **checked)

    # ---- host cost -------------------------------------------------------------------------------
    def host(self):
        s = self.fused_state(4096)
        a, b, x, tt, out = s["a"], self.cupy.ascontiguousarray(s["b"].T), s["x"], s["t"], s["out16"]
        g = self.sm90
        t0 = time.perf_counter()
        for _ in range(100):
            g.encode_tensor_map(a.data.ptr, a.shape[0], a.shape[1], a.shape[1] * 2, g.OP_F16, g.BLOCK_M)
        encode = (time.perf_counter() - t0) / 100 * 1e6
        g.gemm_tn_dgelu(a, b, x, tt, out)
        self.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            g.gemm_tn_dgelu(a, b, x, tt, out)
        call = (time.perf_counter() - t0) / 100 * 1e6
        self.stream.synchronize()
        return dict(section="host", T=4096, impl="host", encode_tensor_map_us=encode,
                    gemm_tn_dgelu_call_cached_maps_us=call)


def work_items(bench):
    """(name, fn) in order of importance (see the module docstring)."""
    items = []

    def add(name, fn, *args):
        items.append((name, lambda: fn(*args)))

    for t in FUSED_TS:  # 1. the target: cooperative schedules first (see the module docstring)
        add(f"fused T={t} cublas gemm1", bench.fused_cublas, t)
        add(f"fused T={t} ours f16 staged bn256", bench.fused_ours, t, "f16", 256, False, "staged")
        add(f"fused T={t} cublas+engine pass f16", bench.fused_cublas_engine_f16, t)
        add(f"fused T={t} ours f16 staged bn128", bench.fused_ours, t, "f16", 128, False, "staged")
        add(f"fused T={t} ours f16 direct bn256", bench.fused_ours, t, "f16", 256, False, "direct")
    for t in FUSED_TS:
        add(f"fused T={t} ours f16 staged bn128pp", bench.fused_ours, t, "f16", 128, True, "staged")
    add("fused T=8192 ours f16 direct bn128pp", bench.fused_ours, 8192, "f16", 128, True, "direct")
    for t in FUSED_TS:  # 2. the epilogue warps, then the small T
        add(f"fused T={t} ours f16 warps bn128", bench.fused_ours, t, "f16", 128, False, "warps")
    for t in (256, 512, 1024):
        add(f"fused T={t} cublas gemm1", bench.fused_cublas, t)
        add(f"fused T={t} cublas+engine pass f16", bench.fused_cublas_engine_f16, t)
        for bn, pp in ((256, False), (128, False), (128, True)):
            add(f"fused T={t} ours f16 staged {config_name(bn, pp)}", bench.fused_ours, t, "f16", bn, pp, "staged")
    for t in FUSED_TS:  # 3. the rest
        add(f"fused T={t} cublas+pass f16", bench.fused_cublas_pass, t)
        add(f"fused T={t} ours f16 memory mode staged bn128", bench.fused_ours, t, "f16_mem", 128, False, "staged")
        add(f"fused T={t} cublas bf16 gemm1", bench.fused_cublas_bf16, t)
        add(f"fused T={t} ours bf16x3 staged bn256", bench.fused_ours, t, "bf16x3", 256, False, "staged")
        add(f"fused T={t} cublas bf16 + engine pass", bench.engine_pass_bf16, t)
    add("host cost", bench.host)
    return items


def context_is_dead(exc):
    """True when the CUDA context can no longer run anything (after a trap: every call fails)."""
    try:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        return False
    except Exception:
        return True


def main(argv=None):
    start = time.perf_counter()
    args = parse_args(argv)
    import cupy

    from cupyffn.gemm import sm90

    device = cupy.cuda.Device()
    if not sm90.device_supported(device.id):
        print(f"sm90 GEMM bench: device {device.id} is compute capability {device.compute_capability}, not 9.0; "
              "nothing to do")
        return 2
    runner = Runner(args.budget_s, args.out, start=start, fatal=context_is_dead)
    runner.result.update(device=cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode(),
                         cupy=cupy.__version__, reps=args.reps, warmup=args.warmup)
    print(f"sm90 GEMM bench: budget {args.budget_s:g} s, {args.reps} reps (median) after {args.warmup} warm-ups; "
          f"json: {args.out}", flush=True)
    t0 = time.perf_counter()
    try:
        # the two variants of the first measurements; the others compile on first use, in their check call
        for epilogue in ("staged", "direct"):
            sm90.function(sm90.Sm90Config(sm90.OP_F16, 256, False, sm90.EPI_DGELU_F16, epilogue), device.id)
    except Exception as e:
        runner.result["errors"].append(f"compile: {type(e).__name__}: {e}")
        runner.save()
        print(f"compile failed: {type(e).__name__}: {e}", flush=True)
        return 1
    runner.result["compile_s"] = time.perf_counter() - t0
    print(f"[{runner.elapsed():5.1f}s] fp16 bn256 kernels (staged and direct dgelu-f16 epilogues) ready in "
          f"{runner.result['compile_s']:.1f} s (NVRTC or CuPy's disk cache)", flush=True)
    bench = Bench(args.reps, args.warmup)
    wanted = None if args.only is None else args.only.split("|")
    items = [item for item in work_items(bench) if wanted is None or any(w in item[0] for w in wanted)]
    result = runner.run(items)
    if not context_is_dead(None):
        bench.close()
    print_tables(result, args.out)
    bad = [r["name"] for r in result["records"] if r.get("ok") is False]
    if bad:
        print("CHECK FAILED (ours vs cuBLAS): " + "; ".join(bad))
    if result["errors"]:
        print("ERRORS:\n  " + "\n  ".join(result["errors"]))
    return 1 if bad or result["errors"] else 0


def print_tables(result, path):
    """The compact tables (stdout, last), from the JSON result alone."""
    recs = result["records"]
    print(f"\n== sm90 GEMM bench ({result.get('device', '?')}; compile {result.get('compile_s', float('nan')):.1f} s; "
          f"{len(recs)} measurements in {result.get('elapsed_s', 0):.1f} s; "
          f"{'complete' if result['complete'] else 'INCOMPLETE: ' + str(result['stopped'])}; json: {path})")
    if result["skipped"]:
        print(f"skipped ({len(result['skipped'])}): " + ", ".join(result["skipped"][:6])
              + (" ..." if len(result["skipped"]) > 6 else ""))

    fused = {(r["T"], r["impl"]): r for r in recs if r["section"] == "fused"}
    if fused:
        print("GEMM1 + GELU derivative, ms. ratio = best fused fp16 / cuBLAS GEMM1 alone (target <= 1.05 at T >= 2048); "
              "err = worst rel L2 vs cuBLAS + pass")
        print(f"{'T':>5} | {'cuBLAS':>7} | {'+pass':>7} | {'fused f16':>15} | {'ratio':>5} | {'f16 mem':>15} | "
              f"{'cuBLAS bf16':>11} | {'+engine':>7} | {'bf16x3':>15} | err f16, bf16x3")
        for t in sorted({t for t, _ in fused}):
            def ms(impl):
                r = fused.get((t, impl))
                return f"{r['ms']:.3f}" if r else "-"

            def best(fmt):
                rs = [r for (tt, _), r in fused.items() if tt == t and r.get("fmt") == fmt]
                return min(rs, key=lambda r: r["ms"]) if rs else None

            def cell(r):
                return f"{r['ms']:.3f} {r['cfg']:>7}" if r else "-"

            def worst(fmt):
                e = [r["err"] for (tt, _), r in fused.items() if tt == t and r.get("fmt") == fmt]
                bad = any(not r["ok"] for (tt, _), r in fused.items() if tt == t and r.get("fmt") == fmt)
                return (f"{max(e):.1e}" + (" BAD" if bad else "")) if e else "-"

            f16, base = best("f16"), fused.get((t, "cublas_gemm1_f16_f32out"))
            ratio = f"{f16['ms'] / base['ms']:5.2f}" if f16 and base else "    -"
            print(f"{t:5d} | {ms('cublas_gemm1_f16_f32out'):>7} | {ms('cublas+cupy_pass_f16'):>7} | {cell(f16):>15} | "
                  f"{ratio} | {cell(best('f16_mem')):>15} | {ms('cublas_gemm1_bf16_f32out'):>11} | "
                  f"{ms('cublas_bf16+engine_pass_bf16'):>7} | {cell(best('bf16x3')):>15} | {worst('f16')}, {worst('bf16x3')}")

    if fused:
        print(f"Fused GEMM1 + dgelu (fp16 out) per epilogue and schedule, ms (x cuBLAS GEMM1 alone; target <= "
              f"{TARGET:.2f}). cuBLAS + engine pass = what the fusion replaces")
        kinds = [(e, c) for e in ("staged", "direct", "warps") for c in ("bn256", "bn128", "bn128pp")
                 if any(r.get("fmt") == "f16" and r.get("epi") == e and r.get("cfg") == c for r in fused.values())]
        print(f"{'T':>5} | {'cuBLAS':>7} | {'+engine':>15} | " + " | ".join(f"{e + ' ' + c:>20}" for e, c in kinds)
              + " | target")
        for t in sorted({t for t, _ in fused}):
            base = fused.get((t, "cublas_gemm1_f16_f32out"))

            def rel(r):
                if r is None:
                    return "-"
                text = f"{r['ms']:.3f}"
                if base:
                    text += f" ({r['ms'] / base['ms']:.2f}x)"
                return text + ("" if r.get("ok", True) else " BAD")

            cells = []
            best = None
            for e, c in kinds:
                r = next((q for q in fused.values() if q["T"] == t and q.get("fmt") == "f16" and q.get("epi") == e
                          and q.get("cfg") == c), None)
                if r is not None and r.get("ok", True) and (best is None or r["ms"] < best["ms"]):
                    best = r
                cells.append(f"{rel(r):>20}")
            verdict = "-"
            if best and base:
                ratio = best["ms"] / base["ms"]
                verdict = f"{'MET' if ratio <= TARGET else 'missed'} ({ratio:.2f}x, {best['epi']} {best['cfg']})"
            base_ms = f"{base['ms']:.3f}" if base else "-"
            print(f"{t:5d} | {base_ms:>7} | "
                  f"{rel(fused.get((t, 'cublas_f16+engine_pass'))):>15} | " + " | ".join(cells) + f" | {verdict}")

    pp = [r for r in recs if r.get("cfg", "").endswith("pp")]
    if pp:
        print("ping-pong bn128pp, ms (ratio to the same measurement's bn256 where there is one):")
        for i in range(0, len(pp), 4):
            cells = []
            for r in pp[i:i + 4]:
                twin = next((q for q in recs if q.get("cfg") == "bn256" and q["T"] == r["T"] and q["gemm"] == r["gemm"]
                             and q.get("fmt") == r.get("fmt") and q.get("epi") == r.get("epi")), None)
                cells.append(f"{r['gemm']} {r.get('fmt', 'f32')}{' ' + r['epi'] if 'epi' in r else ''} T={r['T']} "
                             f"{r['ms']:.3f}"
                             + (f" ({r['ms'] / twin['ms']:.2f})" if twin else "") + ("" if r["ok"] else " BAD"))
            print("  " + "; ".join(cells))
    for r in recs:
        if r["section"] == "host":
            print(f"host: encode_tensor_map {r['encode_tensor_map_us']:.1f} us, gemm_tn_dgelu call (maps cached) "
                  f"{r['gemm_tn_dgelu_call_cached_maps_us']:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
