"""Times the forms the fp16+fp8 plan chooses between, per token count T and backward GEMM (the form table of
docs/decisions/023-fp16-fp8-pair-form.md):

    PYTHONPATH=. python3 dev/gemm_forms_bench.py --out $OUT/gemm-forms-h200.json [--reps 30] [--budget-s 80]

Forms (C fp32 [M, N], fp32 compute, alpha/beta device pointers, on one private handle and stream):
  bf16x3     bf16 cublasGemmEx, K tripled, the engine's bf16x3 layouts (cupyffn/f32/launches.py Gemms)
  fp16       fp16 cublasGemmEx, natural layouts (the "tf32" plan's GEMM, the pair's hi*hi product)
  e4m3       e4m3 cuBLASLt, K' = 2 * round_up(K, 16), both operands K-major ("TN"), A_SCALE 8 (f16e4m3 plan)
  pair       e4m3 with beta 0, then fp16 with beta 1 onto the same output (the "f16+e4m3" form)
  lt_fp16    fp16 through cuBLASLt, the fp16 form's layouts
  lt_bf16x3  bf16 K-tripled through cuBLASLt, the bf16x3 form's layouts
  sm90_pair  the pair as one launch of our sm90 kernel (gemm_sm90_pair_kernel: the e4m3 stages, then the fp16
             ones, into one accumulator, one fp32 output), on the fp16 and e4m3 operands above; the fastest of its
             schedules (PAIR_SCHEDULES x --pair-rasters; each one's ms under "sm90_pair_configs"), its rel. L2
             against the cuBLAS pair's output on the same operands under "sm90_pair_rel_l2" (Hopper only)

Shapes (D = 1536, H = 6144; row-major C[M,N] = op(A) @ op(B); p = planes: 3 for bf16x3, 1 for fp16):
  gemm1 grad_gelu    M=T N=H K=D   A [T, pD]             B [pD, H]
  gemm2 grad_weight2 M=D N=H K=T   A [pT, D] transposed  B [pT, H]
  gemm3 grad_hidden  M=T N=D K=H   A [T, pH]             B [pH, D]
  gemm4 grad_weight1 M=H N=D K=T   A [pT, H] transposed  B [pT, D]
  e4m3: A [M, K'], B [N, K'] (b_trans), lda = ldb = K', ldc = N.
A form cuBLASLt refuses (e4m3 needs N, K and the leading dimensions multiples of 16) is recorded
with the reason, and the pair with it.

Protocol: operands random (never zero: normal values, e4m3 codes of magnitude 2^-3..2^4 with random signs),
made once per (T, GEMM); before each timed call the L2 is flushed (2x its size of zeros written to a scratch
buffer); CUDA events around the call only; median of --reps (>= 30 by default) after --warmup calls. Host cost:
microseconds per enqueue of _cublas.Gemm vs LtMatmul (fp16 and e4m3, M = N = K = 128, so the GPU keeps up),
the mean over 2000 calls, in 8 rounds of 250 with a stream sync between rounds (outside the timed loops).

The JSON (--out, default $OUT/gemm-forms.json) is rewritten after each (T, GEMM): per T, per GEMM the ms of
each form, pair / bf16x3, the winner of the two ("f16+e4m3" or "bf16x3") and the fastest form overall; device,
driver, runtime, cuBLAS and cuBLASLt versions, CuPy version, date. When --budget-s is spent (checked between
items) the rest are listed as skipped. A table is printed at the end.
"""

import argparse
import datetime
import itertools
import os
import sys
import time

from _json_out import save_json  # dev/ (the script's folder is on sys.path)

from benchmarks.timing import flushed_median_ms_batched  # the repo root (PYTHONPATH=.)

D, H = 1536, 6144
TOKENS = (256, 512, 1024, 2048, 3142, 4096, 4904, 8192)
GEMMS = ("gemm1", "gemm2", "gemm3", "gemm4")
NAMES = {"gemm1": "grad_gelu", "gemm2": "grad_weight2", "gemm3": "grad_hidden", "gemm4": "grad_weight1"}
FORMS = ("bf16x3", "fp16", "e4m3", "pair", "lt_fp16", "lt_bf16x3", "sm90_pair")
A_SCALE = 8.0  # the e4m3 GEMM's A scale in the f16e4m3 plan
HOST_SHAPE = 128


def pad16(k):
    return (k + 15) // 16 * 16


def mnk(gemm, t):
    """(M, N, K) of a backward GEMM at T tokens."""
    return {"gemm1": (t, H, D), "gemm2": (D, H, t), "gemm3": (t, D, H), "gemm4": (H, D, t)}[gemm]


def layout(gemm, t, fmt):
    """The call of one form's GEMM: dict(m, n, k, a_trans, b_trans, lda, ldb, ldc, a_shape, b_shape, dtype).
    fmt: "bf16x3" (p = 3, bf16), "fp16" (p = 1) as the engine builds them (cupyffn/f32/launches.py), or "e4m3"."""
    m, n, k = mnk(gemm, t)
    if fmt == "e4m3":
        kk = 2 * pad16(k)
        return dict(m=m, n=n, k=kk, a_trans=False, b_trans=True, lda=kk, ldb=kk, ldc=n, a_shape=(m, kk),
                    b_shape=(n, kk), dtype="e4m3")
    p = {"bf16x3": 3, "fp16": 1}[fmt]
    dtype = "bf16" if fmt == "bf16x3" else "fp16"
    if gemm in ("gemm2", "gemm4"):  # A = the [T, p*M] activation planes read as [p*T, M], transposed
        return dict(m=m, n=n, k=p * k, a_trans=True, b_trans=False, lda=m, ldb=n, ldc=n, a_shape=(p * k, m),
                    b_shape=(p * k, n), dtype=dtype)
    return dict(m=m, n=n, k=p * k, a_trans=False, b_trans=False, lda=p * k, ldb=n, ldc=n, a_shape=(m, p * k),
                b_shape=(p * k, n), dtype=dtype)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/gemm-forms.json, OUT or .)")
    p.add_argument("--reps", type=int, default=30, help="timed samples per form (median; default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before the samples")
    p.add_argument("--budget-s", type=float, default=80.0,
                   help="wall-clock seconds from the start after which no new (T, GEMM) starts (default 80)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help="comma-separated token counts (default: the official ones)")
    p.add_argument("--pair-rasters", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                   help="tile orders of the sm90 pair to time, comma-separated (0: down each column; R: bands of R "
                        "tile rows); default 0")
    p.add_argument("--host-calls", type=int, default=2000, help="enqueues per host-cost measurement (default 2000)")
    args = p.parse_args(argv)
    try:
        args.tokens = tuple(int(x) for x in args.tokens.split(",") if x.strip())
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        p.error(f"--tokens must list positive token counts, got {args.tokens}")
    if args.reps < 1 or args.warmup < 0 or args.host_calls < 1:
        p.error(f"--reps and --host-calls must be >= 1 and --warmup >= 0, got {args.reps}, {args.host_calls}, "
                f"{args.warmup}")
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "."), "gemm-forms.json")
    return args


def summarize(ms):
    """From {form: ms or None}: pair / bf16x3, the winner of the two, the fastest measured form."""
    out = {"pair_over_bf16x3": None, "winner": None, "fastest": None, "sm90_pair_over_pair": None}
    measured = {f: v for f, v in ms.items() if v is not None}
    if ms.get("sm90_pair") is not None and ms.get("pair") is not None:
        out["sm90_pair_over_pair"] = ms["sm90_pair"] / ms["pair"]
    if measured:
        out["fastest"] = min(measured, key=measured.get)
    if ms.get("bf16x3") is not None:
        if ms.get("pair") is not None:
            out["pair_over_bf16x3"] = ms["pair"] / ms["bf16x3"]
            out["winner"] = "f16+e4m3" if ms["pair"] < ms["bf16x3"] else "bf16x3"
        else:
            out["winner"] = "bf16x3"
    elif ms.get("pair") is not None:
        out["winner"] = "f16+e4m3"
    return out


def format_table(result):
    """The printed table: one line per (T, GEMM), ms per form, pair/bf16x3, the winner."""
    head = f"{'T':>5} {'gemm':<6}" + "".join(f"{f:>10}" for f in FORMS) + f"{'pair/x3':>9}  winner (fastest)"
    lines = [head, "-" * len(head)]
    for t in sorted(result["results"], key=int):
        for gemm, rec in result["results"][t].items():
            cells = "".join(f"{rec['ms'][f]:>10.4f}" if rec["ms"].get(f) is not None else f"{'-':>10}" for f in FORMS)
            ratio = rec["pair_over_bf16x3"]
            ratio = f"{ratio:>9.2f}" if ratio is not None else f"{'-':>9}"
            lines.append(f"{int(t):>5} {gemm:<6}{cells}{ratio}  {rec['winner']} ({rec['fastest']})")
    notes = sorted({f"{f}: {why}" for recs in result["results"].values() for rec in recs.values()
                    for f, why in rec["unsupported"].items()})
    bad = [f"T={t} {gemm} {f}" for t, recs in result["results"].items() for gemm, rec in recs.items()
           for f, ok in rec.get("finite", {}).items() if not ok]
    if bad:
        lines.append("NON-FINITE output (the timing of these is suspect): " + ", ".join(bad))
    if notes:
        lines.append("not measured:")
        lines += [f"  {n}" for n in notes]
    host = result.get("host_us")
    if host:
        lines.append("host us per enqueue (M=N=K=%d): " % HOST_SHAPE
                     + ", ".join(f"{k} {v:.2f}" for k, v in host.items() if isinstance(v, float)))
    if result.get("errors"):
        lines.append(f"errors ({len(result['errors'])}):")
        lines += [f"  {e}" for e in result["errors"]]
    if result.get("skipped"):
        lines.append(f"skipped (budget): {', '.join(result['skipped'])}")
    return "\n".join(lines)


def save(result, path):
    save_json(result, path, sort_keys=True)


# ------------------------------------------------------------------ GPU part (cupy imported here only)
class Bench:
    """self.cupy, args (with reps and warmup), device, a non-blocking stream, props, the L2 flush (flush_bytes of
    flush_buf: a memset of twice the L2, as the benchmark flushes), one cuBLAS handle on the stream."""

    def __init__(self, args):
        import cupy

        self.cupy = cupy
        self.args = args
        self.device = cupy.cuda.Device()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.props = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        self.flush_bytes = 2 * int(self.props["l2CacheSize"])
        with self.stream:
            self.flush_buf = cupy.empty(self.flush_bytes, dtype=cupy.uint8)
        from cupyffn.gemm import cublas as _cublas, cublaslt as _cublaslt

        self._cublas, self._cublaslt = _cublas, _cublaslt
        self.handle = _cublas.acquire(self.device.id)
        self.handle.bind(self.stream.ptr)
        with self.stream:
            # beta 0, alpha = beta 1, then a_scale on a 16-byte boundary (cuBLASLt needs it there)
            self.consts = cupy.asarray([0.0, 1.0, 0.0, 0.0, A_SCALE], dtype=cupy.float32)
        self.zero, self.one, self.scale8 = (self.consts.data.ptr + 4 * i for i in (0, 1, 4))
        self.rng = cupy.random.RandomState(1234)

    def info(self):
        """The device, versions, date and protocol fields of the result."""
        cupy = self.cupy
        name = self.props["name"]
        return dict(device=name.decode() if isinstance(name, bytes) else str(name),
                    cc=f"{self.props['major']}.{self.props['minor']}", driver=cupy.cuda.runtime.driverGetVersion(),
                    runtime=cupy.cuda.runtime.runtimeGetVersion(), cupy_version=cupy.__version__,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    l2_flush_bytes=self.flush_bytes, reps=self.args.reps, warmup=self.args.warmup,
                    cublas_version=self.handle.version(), cublaslt_version=self._cublaslt.version(), D=D, H=H)

    def operand(self, shape, dtype):
        """Random, never-zero contents of a 16-bit (normal values) or e4m3 (codes 0x20..0x5F, random sign) matrix."""
        cupy = self.cupy
        n = shape[0] * shape[1]
        with self.stream:
            if dtype == "e4m3":
                code = (self.rng.random_sample(n, dtype=cupy.float32) * 64).astype(cupy.uint8) % 64 + 0x20
                sign = (self.rng.random_sample(n, dtype=cupy.float32) < 0.5).astype(cupy.uint8) * 0x80
                return (code | sign).reshape(shape)
            x = self.rng.standard_normal(n, dtype=cupy.float32)
            if dtype == "fp16":
                return x.astype(cupy.float16).reshape(shape)
            return (x.view(cupy.uint32) >> 16).astype(cupy.uint16).reshape(shape)  # bf16 bits (truncated)

    def build(self, lay, api, name):
        _cublas, _cublaslt = self._cublas, self._cublaslt
        code = {"bf16": _cublas.R_16BF, "fp16": _cublas.R_16F, "e4m3": _cublas.R_8F_E4M3}[lay["dtype"]]
        kw = dict(a_trans=lay["a_trans"], b_trans=lay["b_trans"], lda=lay["lda"], ldb=lay["ldb"], ldc=lay["ldc"])
        if api == "gemmEx":
            return _cublas.Gemm(lay["m"], lay["n"], lay["k"], code, code, _cublas.R_32F, name=name, **kw)
        scale = self.scale8 if lay["dtype"] == "e4m3" else None
        return _cublaslt.LtMatmul(lay["m"], lay["n"], lay["k"], code, code, _cublas.R_32F, a_scale=scale,
                                  device_id=self.device.id, name=name, **kw)

    def time(self, calls):
        """Median ms of `calls()` (enqueued on self.stream) over args.reps samples after args.warmup unflushed calls,
        the L2 flushed (a memset of flush_buf) before each sample, events around the call only, every sample
        enqueued before one wait (benchmarks/timing.py flushed_median_ms_batched)."""
        runtime = self.cupy.cuda.runtime

        def flush():
            runtime.memsetAsync(self.flush_buf.data.ptr, 0, self.flush_bytes, self.stream.ptr)
        return flushed_median_ms_batched(self.cupy, self.stream, calls, flush, self.args.reps, self.args.warmup)

    def measure(self, t, gemm):
        """{ms, unsupported, shape, ...} of every form of one GEMM at T tokens; errors are raised per form into
        `errors` (a list of strings) of the record."""
        cupy = self.cupy
        m, n, k = mnk(gemm, t)
        rec = dict(shape=dict(M=m, N=n, K=k), ms={f: None for f in FORMS}, unsupported={}, errors=[])
        with self.stream:
            c = self.rng.standard_normal(m * n, dtype=cupy.float32)
        ops, plans = {}, {}
        for fmt in ("bf16x3", "fp16", "e4m3"):
            lay = layout(gemm, t, fmt)
            ops[fmt] = (self.operand(lay["a_shape"], lay["dtype"]), self.operand(lay["b_shape"], lay["dtype"]))
        wanted = {"bf16x3": ("bf16x3", "gemmEx"), "fp16": ("fp16", "gemmEx"), "e4m3": ("e4m3", "lt"),
                  "lt_fp16": ("fp16", "lt"), "lt_bf16x3": ("bf16x3", "lt")}
        for form, (fmt, api) in wanted.items():
            try:
                g = self.build(layout(gemm, t, fmt), api, f"T={t} {gemm} {form}")
            except self._cublaslt.LtUnsupported as e:
                rec["unsupported"][form] = str(e)
                continue
            except Exception as e:  # noqa: BLE001 -- recorded, the other forms still run
                rec["errors"].append(f"{form} build: {type(e).__name__}: {e}")
                continue
            a, b = ops[fmt]
            g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c.data.ptr
            g.alpha.value, g.beta.value = self.one, self.zero
            plans[form] = g
        if "e4m3" in plans and "fp16" in plans:
            fp8, f16 = plans["e4m3"], self.build(layout(gemm, t, "fp16"), "gemmEx", f"T={t} {gemm} pair fp16")  # its own fp16 GEMM: beta 1
            a, b = ops["fp16"]
            f16.a.value, f16.b.value, f16.c.value = a.data.ptr, b.data.ptr, c.data.ptr
            f16.alpha.value, f16.beta.value = self.one, self.one
            h = self.handle

            def pair():
                fp8(h)  # beta 0
                f16(h)  # beta 1
            plans["pair"] = pair
        elif "e4m3" in rec["unsupported"]:
            rec["unsupported"]["pair"] = "its e4m3 GEMM is unsupported (above)"
        for form in FORMS:
            if form not in plans:
                continue
            g, h = plans[form], self.handle
            call = g if form == "pair" else (lambda g=g: g(h))
            try:
                rec["ms"][form] = self.time(call)
                with self.stream:
                    rec.setdefault("finite", {})[form] = bool(cupy.isfinite(c).all())  # a sanity check of the output
            except Exception as e:  # noqa: BLE001
                rec["errors"].append(f"{form}: {type(e).__name__}: {e}")
        if "pair" in plans and rec["ms"]["pair"] is not None:
            try:
                self.measure_sm90_pair(rec, t, gemm, ops, c, plans["pair"])
            except Exception as e:  # noqa: BLE001
                rec["errors"].append(f"sm90_pair: {type(e).__name__}: {e}")
        for form in ("e4m3", "lt_fp16", "lt_bf16x3"):
            if form in plans:
                rec.setdefault("lt_workspace_bytes", {})[form] = plans[form].workspace_size
                plans[form].close()
        rec.update(summarize(rec["ms"]))
        return rec

    def measure_sm90_pair(self, rec, t, gemm, ops, c, pair):
        """sm90_pair: each schedule of the one-kernel pair on the same operands as the cuBLAS pair `pair` (run
        once more here into c), its ms, and its output's rel. L2 against the cuBLAS pair's."""
        cupy = self.cupy
        pair()
        self.stream.synchronize()
        from cupyffn.gemm import sm90

        if not sm90.device_supported(self.device.id):
            rec["unsupported"]["sm90_pair"] = "not a compute capability 9.0 GPU"
            return
        m, n, k = mnk(gemm, t)
        lay16, lay8 = layout(gemm, t, "fp16"), layout(gemm, t, "e4m3")
        (a, b), (a8, b8) = ops["fp16"], ops["e4m3"]
        want = c.astype(cupy.float64)
        out = cupy.full(m * n, cupy.nan, dtype=cupy.float32)
        rec["sm90_pair_configs"], rec["sm90_pair_rel_l2"] = {}, {}
        for (block_n, pingpong), raster in itertools.product(sm90.PAIR_SCHEDULES, self.args.pair_rasters):
            name = f"bn{block_n}" + ("pp" if pingpong else "") + (f"r{raster}" if raster else "")
            launch = sm90.PairLaunch(a.data.ptr, lay16["lda"], "km" if lay16["a_trans"] else "mk", b.data.ptr,
                                     lay16["ldb"], "kn", a8.data.ptr, lay8["lda"], b8.data.ptr, lay8["ldb"],
                                     m, n, k, lay8["k"], device_id=self.device.id, alpha=1.0,
                                     pair_scale=A_SCALE, block_n=block_n, pingpong=pingpong,
                                     out_ptr=out.data.ptr, ldc=n, raster=raster)
            with self.stream:
                out.fill(cupy.nan)
            rec["sm90_pair_configs"][name] = self.time(lambda: launch(self.stream.ptr))
            with self.stream:
                err = cupy.linalg.norm(out.astype(cupy.float64) - want) / cupy.linalg.norm(want)
                rec["sm90_pair_rel_l2"][name] = float(err) if bool(cupy.isfinite(out).all()) else None
        rec["ms"]["sm90_pair"] = min(rec["sm90_pair_configs"].values())

    def host_cost(self):
        """Microseconds per enqueue (host side) of Gemm vs LtMatmul at M = N = K = HOST_SHAPE."""
        cupy = self.cupy
        s = HOST_SHAPE
        out = {"calls": self.args.host_calls}
        with self.stream:
            c = cupy.empty((s, s), dtype=cupy.float32)
            a16, b16 = self.operand((s, s), "fp16"), self.operand((s, s), "fp16")
            a8, b8 = self.operand((s, s), "e4m3"), self.operand((s, s), "e4m3")
        lay16 = dict(m=s, n=s, k=s, a_trans=False, b_trans=False, lda=s, ldb=s, ldc=s, dtype="fp16")
        lay8 = dict(m=s, n=s, k=s, a_trans=False, b_trans=True, lda=s, ldb=s, ldc=s, dtype="e4m3")
        for name, lay, api, (a, b) in (("gemmEx_fp16", lay16, "gemmEx", (a16, b16)), ("lt_fp16", lay16, "lt", (a16, b16)),
                                       ("lt_e4m3", lay8, "lt", (a8, b8))):
            g = self.build(lay, api, f"host cost {name}")
            g.a.value, g.b.value, g.c.value = a.data.ptr, b.data.ptr, c.data.ptr
            g.alpha.value, g.beta.value = self.one, self.zero
            h = self.handle
            for _ in range(100):
                g(h)
            self.stream.synchronize()
            rounds, per = 8, max(1, self.args.host_calls // 8)
            total = 0.0
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(per):
                    g(h)
                total += time.perf_counter() - t0
                self.stream.synchronize()  # keeps the launch queue short; not timed
            out[name] = total / (rounds * per) * 1e6
            if api == "lt":
                g.close()
        out["calls"] = rounds * per
        return out


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    bench = Bench(args)
    result = dict(tool="gemm_forms_bench", **bench.info(), results={}, errors=[], skipped=[], complete=False)
    print(f"{result['device']} cc {result['cc']}, driver {result['driver']}, cuBLAS {result['cublas_version']}, "
          f"cuBLASLt {result['cublaslt_version']}, CuPy {result['cupy_version']}; reps {args.reps}, "
          f"L2 flush {bench.flush_bytes >> 20} MiB -> {args.out}", flush=True)
    try:
        result["host_us"] = bench.host_cost()
        print("host us per enqueue: " + ", ".join(f"{k} {v:.2f}" for k, v in result["host_us"].items()
                                                  if isinstance(v, float)), flush=True)
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"host cost: {type(e).__name__}: {e}")
    items = [(t, g) for t in args.tokens for g in GEMMS]
    for i, (t, gemm) in enumerate(items):
        if time.perf_counter() - start > args.budget_s:
            result["skipped"] = [f"T={tt} {gg}" for tt, gg in items[i:]]
            break
        try:
            rec = bench.measure(t, gemm)
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory: recorded, the next item still runs
            result["errors"].append(f"T={t} {gemm}: {type(e).__name__}: {e}")
            continue
        result["errors"] += [f"T={t} {gemm} {e}" for e in rec.pop("errors")]
        result["results"].setdefault(str(t), {})[gemm] = rec
        cells = " ".join(f"{f} {v:.4f}" for f, v in rec["ms"].items() if v is not None)
        print(f"T={t:<5} {gemm}: {cells}; winner {rec['winner']}", flush=True)
        result["elapsed_s"] = round(time.perf_counter() - start, 2)
        save(result, args.out)
    result["complete"] = not result["skipped"]
    result["elapsed_s"] = round(time.perf_counter() - start, 2)
    save(result, args.out)
    print(format_table(result))
    print(f"wrote {args.out} ({result['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
