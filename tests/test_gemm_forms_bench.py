"""dev/gemm_forms_bench.py without a GPU: arguments, the shape and layout table, which e4m3 GEMMs cuBLASLt
refuses, the summary and the printed table."""

import json

import pytest
from tool_loader import load_tool  # tests/ is on sys.path


@pytest.fixture(scope="module")
def bench():
    return load_tool("gemm_forms_bench")


def test_help_and_arguments(bench, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--help"])
    assert info.value.code == 0 and "--out" in capsys.readouterr().out
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args([])
    assert (args.reps, args.warmup, args.budget_s, args.host_calls) == (30, 3, 80.0, 2000)
    assert args.tokens == (256, 512, 1024, 2048, 3142, 4096, 4904, 8192)
    assert args.out == str(tmp_path / "gemm-forms.json")
    args = bench.parse_args(["--out", "x.json", "--reps", "31", "--tokens", "256, 8192", "--budget-s", "5"])
    assert (args.out, args.reps, args.tokens, args.budget_s) == ("x.json", 31, (256, 8192), 5.0)
    for bad in (["--reps", "0"], ["--warmup", "-1"], ["--budget-s", "0"], ["--tokens", "a,b"], ["--tokens", "0"],
                ["--host-calls", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_layouts_are_the_engines(bench):
    """The 16-bit layouts as cupyffn/f32/launches.py Gemms builds them (p planes: K = p * K, activations
    [T, p * cols] read as [p * T, cols] by the weight-gradient GEMMs), e4m3 as the f16e4m3 plan lays it out."""
    t, d, h = 3142, 1536, 6144
    keys = ("m", "n", "k", "a_trans", "b_trans", "lda", "ldb", "ldc", "a_shape", "b_shape", "dtype")

    def row(*values):
        return dict(zip(keys, values))

    assert bench.layout("gemm1", t, "bf16x3") == row(t, h, 3 * d, False, False, 3 * d, h, h, (t, 3 * d), (3 * d, h),
                                                     "bf16")
    assert bench.layout("gemm2", t, "bf16x3") == row(d, h, 3 * t, True, False, d, h, h, (3 * t, d), (3 * t, h), "bf16")
    assert bench.layout("gemm3", t, "bf16x3") == row(t, d, 3 * h, False, False, 3 * h, d, d, (t, 3 * h), (3 * h, d),
                                                     "bf16")
    assert bench.layout("gemm4", t, "bf16x3") == row(h, d, 3 * t, True, False, h, d, d, (3 * t, h), (3 * t, d), "bf16")
    assert bench.layout("gemm1", t, "fp16") == row(t, h, d, False, False, d, h, h, (t, d), (d, h), "fp16")
    assert bench.layout("gemm4", t, "fp16") == row(h, d, t, True, False, h, d, d, (t, h), (t, d), "fp16")
    tp = 3152  # T padded to 16
    assert bench.layout("gemm2", t, "e4m3") == row(d, h, 2 * tp, False, True, 2 * tp, 2 * tp, h, (d, 2 * tp),
                                                   (h, 2 * tp), "e4m3")
    assert bench.layout("gemm3", t, "e4m3") == row(t, d, 2 * h, False, True, 2 * h, 2 * h, d, (t, 2 * h), (d, 2 * h),
                                                   "e4m3")
    # every stored operand holds its op(A) [M, K] / op(B) [K, N] with ld = its row length
    for t in bench.TOKENS:
        for gemm in bench.GEMMS:
            for fmt in ("bf16x3", "fp16", "e4m3"):
                lay = bench.layout(gemm, t, fmt)
                a_rows, a_cols = lay["a_shape"]
                b_rows, b_cols = lay["b_shape"]
                assert (a_cols, b_cols) == (lay["lda"], lay["ldb"])
                assert (a_rows, a_cols) == ((lay["k"], lay["m"]) if lay["a_trans"] else (lay["m"], lay["k"]))
                assert (b_rows, b_cols) == ((lay["n"], lay["k"]) if lay["b_trans"] else (lay["k"], lay["n"]))


def test_cublaslt_refuses_no_e4m3_gemm_of_the_workloads(bench):
    pytest.importorskip("cupy")
    from cupyffn.gemm import cublas as _cublas, cublaslt as _cublaslt

    refused = {}
    for t in bench.TOKENS:
        for gemm in bench.GEMMS:
            for fmt in ("bf16x3", "fp16", "e4m3"):
                lay = bench.layout(gemm, t, fmt)
                code = {"bf16": _cublas.R_16BF, "fp16": _cublas.R_16F, "e4m3": _cublas.R_8F_E4M3}[lay["dtype"]]
                ok, why = _cublaslt.supports(lay["m"], lay["n"], lay["k"], code, code, _cublas.R_32F, lay["a_trans"],
                                             lay["b_trans"], lay["lda"], lay["ldb"], lay["ldc"])
                if not ok:
                    refused[(t, gemm, fmt)] = why
    assert refused == {}  # N and K are D or H (multiples of 16) and K is padded; any M runs (measured)


def test_summary(bench):
    full = dict(bf16x3=1.0, fp16=0.4, e4m3=0.45, pair=0.8, lt_fp16=0.39, lt_bf16x3=1.1, sm90_pair=None)
    none = dict(sm90_pair_over_pair=None)
    assert bench.summarize(full) == dict(pair_over_bf16x3=0.8, winner="f16+e4m3", fastest="lt_fp16", **none)
    slow = dict(full, pair=1.25)
    assert bench.summarize(slow) == dict(pair_over_bf16x3=1.25, winner="bf16x3", fastest="lt_fp16", **none)
    refused = dict(full, e4m3=None, pair=None)
    assert bench.summarize(refused) == dict(pair_over_bf16x3=None, winner="bf16x3", fastest="lt_fp16", **none)
    assert bench.summarize({f: None for f in bench.FORMS}) == dict(pair_over_bf16x3=None, winner=None, fastest=None,
                                                                   **none)
    # the one-kernel pair: its ratio to the cuBLAS pair, and it can be the fastest form
    one = dict(full, sm90_pair=0.2)
    assert bench.summarize(one) == dict(pair_over_bf16x3=0.8, winner="f16+e4m3", fastest="sm90_pair",
                                        sm90_pair_over_pair=0.25)


def test_table_and_json(bench, tmp_path):
    ms = dict(bf16x3=0.6, fp16=0.25, e4m3=0.25, pair=0.45, lt_fp16=0.24, lt_bf16x3=0.61)
    ok = dict(shape=dict(M=1536, N=6144, K=8192), ms=ms, unsupported={}, finite={f: True for f in ms},
              **bench.summarize(ms))
    ms2 = dict(ms, e4m3=None, pair=None)
    refused = dict(shape=dict(M=3142, N=6144, K=1536), ms=ms2, finite={f: f != "lt_fp16" for f in ms},
                   unsupported={"e4m3": "cuBLASLt cannot run ...: got M=3142", "pair": "its e4m3 GEMM is unsupported"},
                   **bench.summarize(ms2))
    result = dict(results={"8192": {"gemm2": ok}, "3142": {"gemm1": refused}}, errors=["T=256 gemm1 x: boom"],
                  skipped=["T=8192 gemm4"], host_us={"calls": 2000, "gemmEx_fp16": 3.25, "lt_e4m3": 4.5})
    text = bench.format_table(result)
    lines = text.splitlines()
    assert lines.index(next(line for line in lines if line.startswith(" 3142"))) < \
        lines.index(next(line for line in lines if line.startswith(" 8192")))  # sorted by T
    row = next(line for line in lines if line.startswith(" 8192 gemm2"))
    assert "0.4500" in row and "0.75" in row and row.endswith("f16+e4m3 (lt_fp16)")
    row = next(line for line in lines if line.startswith(" 3142 gemm1"))
    assert row.split()[4:6] == ["-", "-"] and row.endswith("bf16x3 (lt_fp16)")
    assert "NON-FINITE output (the timing of these is suspect): T=3142 gemm1 lt_fp16" in text
    assert "got M=3142" in text and "gemmEx_fp16 3.25" in text and "lt_e4m3 4.50" in text
    assert "boom" in text and "skipped (budget): T=8192 gemm4" in text
    path = tmp_path / "sub" / "r.json"
    bench.save(result, str(path))
    assert json.loads(path.read_text())["results"]["8192"]["gemm2"]["winner"] == "f16+e4m3"
