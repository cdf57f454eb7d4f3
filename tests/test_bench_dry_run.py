"""bench's whole GPU run (benchmarks.gpu.run_gpu) driven on the CPU: NumPy stands in for CuPy, cupyffn
plans run on their NumPy backend, the sizes are small. This checks the glue (check rounds, NaN
poisoning, input rotation, timing records, stage rows, summary, JSON, Markdown) before the one GPU
run; the GPU-only parts (CUPTI, cuBLAS, kernels) are exercised there."""

import argparse
import contextlib
import importlib.util
import json
import types

import numpy
import pytest

import cupyffn
from benchmarks import gpu as G
from benchmarks import impls as I
from benchmarks import report as R
from cupyffn import workloads as W


class _Stream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def _fake_cupy():
    np = numpy
    cuda = types.SimpleNamespace(
        Stream=lambda non_blocking=True: _Stream(),
        Event=lambda *a, **k: types.SimpleNamespace(record=lambda stream=None: None),
        get_elapsed_time=lambda a, b: 0.5,
        get_current_stream=lambda: _Stream(),
        Device=lambda *a: types.SimpleNamespace(id=0, compute_capability="80"),
        runtime=types.SimpleNamespace(deviceSynchronize=lambda: None,
                                      getDeviceProperties=lambda dev: {"l2CacheSize": 1 << 16}))

    def elementwise(*args):  # the bench's naive dgelu, in NumPy
        return lambda gg, x, t: (gg * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654
                                       * (1 + 0.134145 * x * x))).astype(np.float32)

    return types.SimpleNamespace(
        ndarray=np.ndarray, empty=np.empty, full=np.full, float32=np.float32, float64=np.float64, uint8=np.uint8,
        abs=np.abs, isfinite=np.isfinite, tanh=np.tanh, linalg=np.linalg, random=np.random, from_dlpack=np.from_dlpack,
        cuda=cuda, ElementwiseKernel=elementwise,
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))


class _CpuPlan(cupyffn.GeluFFNBackward):
    """A CPU plan, whose GPU-only stage profile (benchmarks/stages.py) the fixture replaces by fixed stage times."""

    def __init__(self, *a, **k):
        super().__init__(*a, device="cpu", **k)
        self.profiled = 0


def _fixed_stages(plan, *arrays, out, stream=None, reps=5, before_each=None):
    plan.profiled += 1
    before_each()
    return {"GEMM1 grad_gelu": {"ms": 0.1}, "dgelu": {"ms": 0.05, "bytes": 10_000_000},
            "GEMM3 grad_hidden": {"ms": 0.1}}


class _NumpyFloor:
    """benchmarks.floor.GemmFloor's four products in NumPy float16 -> float32 (the glue, not cuBLAS)."""

    def __init__(self, cupy, T, D, H):
        self.closed = False

    def bind(self, args2d):
        dy, x, w1, w2, _, _, g = (a.astype(numpy.float16) for a in args2d)

        def run():
            dz = (dy.astype(numpy.float32) @ w2.astype(numpy.float32)).astype(numpy.float16)
            return tuple((a.T.astype(numpy.float32) @ b.astype(numpy.float32)) if t else
                         (a.astype(numpy.float32) @ b.astype(numpy.float32)) for a, b, t in
                         ((dy, g, True), (dz, w1, False), (dz, x, True)))
        return run

    def close(self):
        self.closed = True


@pytest.fixture
def small(monkeypatch):
    dim, hidden = 32, 64
    monkeypatch.setattr(W, "DIM", dim)
    monkeypatch.setattr(W, "HIDDEN_DIM", hidden)
    official = [w for w in W.WORKLOADS if w.label in ("B2xS128", "B1xS512")]
    monkeypatch.setattr(W, "WORKLOADS", tuple(official))
    monkeypatch.setattr(I.cupyffn, "GeluFFNBackward", _CpuPlan)
    monkeypatch.setattr(G.S, "profile", _fixed_stages)
    monkeypatch.setattr(I, "plan_with_options", lambda t, d, h, options, **k: _CpuPlan(t, d, h, **k))  # no engine
    monkeypatch.setattr(G, "environment", lambda cupy, torch: {k: "fake" for k in (
        "device", "driver", "cuda_runtime", "cublas", "cupy", "torch", "nvrtc")})
    monkeypatch.setattr(I, "torch_or_none", lambda in_process_compile=False: None)
    monkeypatch.setattr(G.F, "GemmFloor", _NumpyFloor)
    monkeypatch.setattr(G, "copy_rate", lambda cupy, flush: {"bytes": 151_000_000, "ms": 0.1, "gbps": 3020.0})
    if importlib.util.find_spec("cupy") is None:  # a CPU-only install: the plain-CuPy baseline's TF32 switch is
        monkeypatch.setattr(I.Implementations, "_naive", _naive_without_cupy)  # a CuPy internal; the same math
    return dim, hidden


def _naive_without_cupy(self, args, tf32):
    """Implementations._naive's four matmuls and dgelu, without CuPy's compute-type switch (NumPy has no TF32)."""
    dy, x, w1, w2, z, t, g = args
    dz = self._naive_dgelu(dy @ w2, z, t)
    return dz @ w1, dz.T @ x, dy.T @ g


def _args(**kw):
    base = dict(quick=False, compile=False, rounds=2, impls="cupyffn-*,cupy-naive-fp32", timer="events",
                iters=4, warmup=2, loop=False, loop_only=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_full_run_glue_on_the_cpu(small, monkeypatch):
    calls = []
    real = W.check

    def spy(out, ref32, ref64=None, xp=numpy, **kw):
        c = real(out, ref32, ref64, xp=xp, **kw)
        calls.append((kw.get("tokens"), c.atol))
        return c

    monkeypatch.setattr(W, "check", spy)
    result = G.run_gpu(_args(), _fake_cupy())
    rows = result["workloads"]
    assert [r["label"] for r in rows] == ["B2xS128", "B1xS512"]
    names = [f"cupyffn-{p}" for p in cupyffn.PRECISIONS] + ["cupyffn-tf32-launches", "cupyffn-tf32-convert-apart",
                                                         "cupyffn-tf32-memory-mode", "cupy-naive-fp32"]
    assert list(rows[0]["results"]) == names
    # every implementation, every round, every output, with the workload's official atol
    assert len(calls) == 2 * len(names) * 2 * 3
    assert {(t, a) for t, a in calls} == {(256, 0.025), (512, 0.037)}
    for r in rows:
        for n, res in r["results"].items():
            assert res["check"]["rounds"] == 2 and res["timing"] == "cuda-events"
            assert res["median_ms"] == 0.5 and res["iters"] == 4
            if n.startswith("cupyffn"):
                assert [s["stage"] for s in res["stages"]] == ["GEMM1 grad_gelu", "dgelu", "GEMM3 grad_hidden"]
                assert res["stages"][1]["gbps"] == pytest.approx(200.0) and res["gemm_sum_ms"] == pytest.approx(0.2)
    per = result["summary"]["implementations"]
    assert per["cupyffn-ieee"]["passes"] and per["cupyffn-ieee"]["rounds_total"] == 4
    assert per["cupyffn-ieee"]["max_rel_l2"] <= cupyffn.PRECISIONS["ieee"].contract
    assert result["protocol"]["rounds"] == 2 and result["protocol"]["input_sets"] == 3
    text = json.dumps(result)  # what write_results stores
    again = R.normalize(json.loads(text))
    md = R.markdown(again)
    assert "PASS 4/4" in md and "✗" not in md  # nothing failed at these sizes: no marks, no legend
    assert "| `ieee` |" in R.precision_table(again) and "2 workloads x 2 rounds" in R.precision_table(again)
    # the GEMM floor: timed per workload beside the implementations, never checked, out of the headline
    assert all(r["floor"]["median_ms"] == 0.5 and "check" not in r["floor"] for r in rows)
    assert again["summary"]["floor"]["geomean_ms"] == pytest.approx(0.5)
    assert "gemm-floor-fp16" not in again["summary"]["implementations"]
    assert "**GEMM floor**" in md and "| B2xS128 | 256 | 0.500 | 1.00x |" in md
    assert "Copy rate in this run: 3020 GB/s" in md


def test_nan_poisoning_and_rotation(small, monkeypatch):
    seen = []
    real_bind = I.Implementations._build

    def build(self, name, T, D, H):
        impl = real_bind(self, name, T, D, H)
        bind = impl.bind

        def spying_bind(args, out):
            run = bind(args, out)

            def wrapped():
                if out is not None:
                    seen.append(("poisoned" if all(numpy.isnan(o).all() for o in out) else "not", id(args[0])))
                else:
                    seen.append(("none", id(args[0])))
                return run()
            return wrapped
        impl.bind = spying_bind
        return impl

    monkeypatch.setattr(I.Implementations, "_build", build)
    G.run_gpu(_args(impls="cupyffn-ieee", rounds=2), _fake_cupy())
    # per workload: 2 check rounds (poisoned outputs), then 2 warm-up + 4 timed over the 3 input sets
    per_workload = seen[:8]
    assert [s for s, _ in per_workload[:2]] == ["poisoned", "poisoned"]
    timed = [a for _, a in per_workload[2:]]
    assert len(set(timed)) == 3 and all(x != y for x, y in zip(timed, timed[1:]))


def test_impls_patterns_must_match(small):
    with pytest.raises(SystemExit, match="matches none"):
        G.run_gpu(_args(impls="torch-compile-*"), _fake_cupy())


# ---------------------------------------------------------------------------------------------
# bench.py without a GPU: every flag honoured by the CPU smoke run or refused (exit status 2)
# ---------------------------------------------------------------------------------------------
NO_GPU = "no NVIDIA GPU visible (a test's stand-in)"


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench.main on the CPU path (whatever this machine has), counting the backward calls it makes."""
    import bench
    from benchmarks import cpu as C

    monkeypatch.setattr(G, "gpu_or_reason", lambda: (None, NO_GPU))
    calls = []
    real = cupyffn.gelu_ffn_backward

    def counting(*args, **kwargs):
        calls.append((args[0].shape[0], kwargs["precision"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(C.cupyffn, "gelu_ffn_backward", counting)
    return bench.main, calls


@pytest.mark.parametrize("argv,flag", [
    (["--compile"], "--compile"),
    (["--loop"], "--loop"),
    (["--loop-only"], "--loop-only"),
    (["--loop-calls", "50"], "--loop-calls"),  # given, even with its default value
    (["--timer", "events"], "--timer events"),
    (["--timer", "events-idle"], "--timer events-idle"),
    (["--impls", "torch-*"], "--impls: 'torch-*'"),
    (["--impls", "cupyffn-ieee,cupy-naive-*"], "--impls: 'cupy-naive-*'"),
    (["--quick", "--compile", "--loop"], "--compile"),
])
def test_cpu_run_refuses_gpu_only_flags(cpu_bench, capsys, argv, flag):
    main, calls = cpu_bench
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"bench.py: {flag}" in err, err
    assert f"there is no usable GPU here: {NO_GPU}" in err, err
    assert calls == []  # refused before anything ran


def test_cpu_run_honours_its_flags(cpu_bench, capsys, tmp_path):
    main, calls = cpu_bench
    path = tmp_path / "cpu.json"
    argv = ["--quick", "--rounds", "2", "--iters", "2", "--warmup", "1", "--impls", "cupyffn-ieee,cupyffn-bf16",
            "--timer", "auto", "--no-write", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == NO_GPU and "NOT the benchmark" in out
    # --quick: T = 64 and 256; per size and implementation 2 check rounds, then 1 warm-up + 2 timed calls
    assert sorted(set(calls)) == [(64, "bf16"), (64, "ieee"), (256, "bf16"), (256, "ieee")]
    assert all(calls.count(c) == 2 + 1 + 2 for c in set(calls))
    assert "PASS 2/2" in out
    result = json.loads(path.read_text())
    assert result["protocol"] | {"timing": None, "check": None} == {
        "timing": None, "check": None, "warmup": 1, "iters": 2, "rounds": 2, "quick": True,
        "implementations": ["cupyffn-ieee", "cupyffn-bf16"]}
    assert result["gpu_unavailable"] == NO_GPU
    rows = result["sizes"][0]["results"]
    assert len(rows["cupyffn-ieee"]["times_ms"]) == 2 and rows["cupyffn-ieee"]["rounds_passed"] == 2
    from benchmarks import cpu as C
    assert result["env"]["cpu"] == C.host_cpu()  # CPU figures depend on the host: its model and ISA go in


INTEL_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 2
flags\t\t: fpu sse sse2 sse4_2 avx fma avx2 hypervisor avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: another entry, not read
flags\t\t: fpu
"""


def test_host_cpu_reads_model_and_instruction_set(tmp_path):
    """benchmarks.cpu.host_cpu, which every CPU results file records: the first processor's model, its family /
    model / stepping, and the vector ISA flags it has, in ISA_FLAGS' order; none invented where cpuinfo is missing."""
    from benchmarks import cpu as C

    path = tmp_path / "cpuinfo"
    path.write_text(INTEL_CPUINFO)
    cpu = C.host_cpu(path)
    assert cpu["model"] == "Intel(R) Xeon(R) Processor" and cpu["vendor"] == "GenuineIntel"
    assert cpu["cpuid"] == "family 6 model 207 stepping 2"
    assert cpu["isa"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                          "amx_tile", "amx_bf16"]
    assert cpu["virtual"] is True
    path.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU part\t: 0xd40\n")  # an ARM host's shape
    arm = C.host_cpu(path)
    assert arm["isa"] == ["asimd", "sve"] and arm["virtual"] is False and arm["cpuid"] is None
    missing = C.host_cpu(tmp_path / "absent")
    assert missing["isa"] is None and missing["virtual"] is None and missing["vendor"] is None


def test_cpu_run_defaults(cpu_bench, capsys):
    """Without --iters / --warmup the CPU uses its own defaults (3 timed, no warm-up), --rounds its usual 3."""
    main, calls = cpu_bench
    assert main(["--quick", "--impls", "cupyffn-ieee"]) == 0
    assert calls.count((64, "ieee")) == 3 + 0 + 3 and calls.count((256, "ieee")) == 6
    assert "(CPU default)" in capsys.readouterr().out


def test_help_describes_flags_plainly(capsys):
    import re

    import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    text = capsys.readouterr().out
    for word in (r"\bsession", r"\bissues?\b", r"round \d+ of", r"\bs\d+[a-z]?\b", r"#\d+", r"\bcommitted\b"):
        assert not re.search(word, text, re.IGNORECASE), (word, text)
    for flag in ("--compile", "--loop", "--timer events", "--impls", "--rounds", "--json", "--quick"):
        assert flag in text.split("options:")[0], flag  # the CPU behaviour of each is described


def test_cpu_run_line_says_what_passed(cpu_bench, capsys, tmp_path):
    """A passing bf16 row whose worst element is beyond atol (|err|/atol > 1) reads without contradiction: the line
    gives the fraction of elements within tolerance and the fraction the check needs, beside the worst element."""
    import re

    main, _ = cpu_bench
    path = tmp_path / "cpu.json"
    assert main(["--quick", "--rounds", "1", "--iters", "1", "--impls", "cupyffn-bf16", "--json", str(path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cupyffn-bf16")]
    rows = [r["results"]["cupyffn-bf16"] for r in json.loads(path.read_text())["sizes"]]
    assert len(lines) == len(rows) == 2
    pattern = re.compile(r"check (PASS|FAIL) (\d)/1 \(within tolerance: ([\d.]+)% of the elements at worst, "
                         r"([\d.]+)% needed; worst element \|err\|/atol ([\d.]+)\)")
    for line, row in zip(lines, rows):
        verdict, _, within, needed, worst = pattern.search(line).groups()
        assert float(needed) == 100 * W.REQUIRED_MATCH
        assert (verdict == "PASS") == (float(within) >= float(needed)) == row["passes"]
        assert float(within) == pytest.approx(100 * row["least_matched"], abs=0.01)
        assert float(worst) == pytest.approx(row["max_err_over_atol"], abs=1e-3)
    assert any(r["passes"] and r["max_err_over_atol"] > 1 for r in rows)  # the case the line used to blur
