"""bench.py --suite train-fp32 (benchmarks/training_fp32.py, benchmarks/training_jax.py) on the CPU: its rows and
twins, its two measures on known values (the loss curve's distance, the gradients' error against float64), the
float64 references against float64 autograd, tiny runs of the torch models (eager and compiled, one after the other
and paired) and of the JAX loop with every row's values checked, the table, the targets, the README section (and the
README's room for it), and bench.py's options."""

import copy
import json
import math

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: framework tests are opt-in, "
                                            "pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")
pytest.importorskip("transformers", reason="transformers not installed: pip install '.[test-frameworks]'")

import bench  # noqa: E402
from benchmarks import report as R  # noqa: E402
from benchmarks import training_fp32 as F  # noqa: E402

EXAMPLE = F._example()
GPT2_TINY = dict(dim=32, layers=2, heads=2, vocab=64, seq=16, batch=4)
SD35_TINY = dict(dim=32, layers=2, seq=8, batch=4)
STEPS = 25


# ---------------------------------------------------------------------------------------- rows and measures
def test_rows_are_the_issues_and_each_cupyffn_row_sits_beside_its_torch_twin():
    names = [r.name for r in F.ROWS]
    assert len(names) == len(set(names)) == 13
    for group in F.groups():
        lead = group[0]
        assert lead.precision is None and all(r.precision is not None for r in group[1:])
        for row in group:
            assert (row.mode, row.tf32) == (lead.mode, lead.tf32)
            # fp16+fp8 and ieee beside strict fp32, tf32 beside torch with TF32 allowed
            assert row.precision is None or row.tf32 == (row.precision == "tf32")
            assert row.precision is None or F.TWINS[row.name] == lead.name
    assert F.TWINS["cupyffn fp16+fp8 + torch.compile"] == "torch.compile strict"
    assert F.TWINS["cupyffn tf32 + torch.compile reduce-overhead"] == "torch.compile reduce-overhead TF32"
    assert F.TWINS["cupyffn ieee"] == "torch strict" and F.REFERENCE == "torch strict"
    assert {r.mode for r in F.ROWS if r.precision == "ieee"} == {None}  # the control: eager only


def test_loss_distance_is_the_largest_relative_gap_over_the_common_steps():
    assert F.loss_distance([1.0, 2.2, 2.9], [1.0, 2.0, 3.0]) == pytest.approx(0.1)
    assert F.loss_distance([1.0, 2.0], [1.0, 2.0, 3.0]) == 0.0  # a run that stopped: the steps it has
    assert F.loss_distance([-2.0], [-1.0]) == pytest.approx(1.0)
    assert F.loss_distance([], [1.0]) is None


def test_grad_errors_on_known_values():
    reference = {"a": torch.tensor([3.0, 4.0], dtype=torch.float64), "b": torch.tensor([1.0, 0.0], dtype=torch.float64),
                 "zero": torch.zeros(2, dtype=torch.float64)}
    grads = {"a": torch.tensor([3.0, 4.5]), "b": None, "zero": torch.tensor([0.0, 0.0])}
    e = F.grad_errors(grads, reference, ["a"])
    assert e["mlp_weights"] == pytest.approx(0.5 / 5)  # |(0, 0.5)| / |(3, 4)|
    assert e["all"] == pytest.approx(math.sqrt((0.25 + 1.0) / (25.0 + 1.0)))  # a missing gradient counts as zero
    assert e["worst"] == ["b", pytest.approx(1.0)]  # "zero" (no float64 gradient) is left out of the worst
    assert F.grad_errors({"a": reference["a"].float()}, {"a": reference["a"]}, [])["mlp_weights"] is None


def test_float64_references_match_float64_autograd():
    from benchmarks import training_jax

    g = torch.Generator().manual_seed(3)
    x, w1, w2, target = (torch.randn(*s, generator=g) for s in ((16, 8), (32, 8), (8, 32), (16, 8)))
    got = training_jax.float64_gradients(x.numpy(), w1.numpy(), w2.numpy(), target.numpy())
    p1, p2 = (w.double().requires_grad_() for w in (w1, w2))
    y = torch.nn.functional.gelu(x.double() @ p1.T, approximate="tanh") @ p2.T
    (0.5 * ((y - target.double()) ** 2).sum() / x.shape[0]).backward()
    for a, b in zip(got, (p1.grad, p2.grad)):
        assert torch.allclose(torch.from_numpy(a), b, rtol=1e-12, atol=1e-14)

    # the torch models' reference: one float64 step of a float64 copy, the model itself untouched
    model = EXAMPLE.build("sd35", dict(SD35_TINY, heads=2, vocab=64), "cpu")
    item = next(EXAMPLE.batches("sd35", 1, 4, 8, 32, 64, "cpu"))
    ref = F.float64_gradients(EXAMPLE, model, "sd35", item)
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())
    plain = copy.deepcopy(model)
    EXAMPLE.loss_of(plain, "sd35", item).backward()
    assert set(ref) == {n for n, _ in model.named_parameters()} and all(v.dtype == torch.float64 for v in ref.values())
    e = F.grad_errors({n: p.grad for n, p in plain.named_parameters()}, ref, list(ref))
    assert 0 < e["all"] < 1e-6  # float32 autograd against float64: fp32 rounding, no more


def test_train_together_steps_in_turn_and_goes_on_past_a_failure(capsys):
    order = []

    def runner(name, fail_at=None):
        run = EXAMPLE._Run(name, None, iter(range(10)))

        def step(item):
            if item == fail_at:
                raise RuntimeError("boom")
            order.append(name)
            return float(item), 1.0
        run.step = step
        return run

    runs = [runner("a"), runner("b", fail_at=1), runner("c")]
    EXAMPLE.train_together(runs, 3, "m", keep_going=True)
    assert order == ["a", "b", "c", "c", "a", "c", "a"]  # step i starts with run i mod 3; b fails at its 2nd
    assert runs[1].error == "RuntimeError: boom" and runs[1].losses == [0.0]
    assert runs[0].losses == [0.0, 1.0, 2.0] and runs[2].times == [1.0] * 3
    with pytest.raises(RuntimeError, match="boom"):
        EXAMPLE.train_together([runner("b", fail_at=0)], 1, "m", keep_going=False)


# ---------------------------------------------------------------------------------------- runs on the CPU
@pytest.fixture(scope="module")
def gpt2_eager():
    """The eager rows for a tiny GPT-2, one after the other."""
    return F.summarize(F.run_model("gpt2", STEPS, device="cpu", modes=(None,), sizes=GPT2_TINY, lr=1e-3))


def test_eager_rows_of_a_tiny_gpt2_train_and_measure_against_float64(gpt2_eager):
    r = gpt2_eager
    assert list(r["runs"]) == [row.name for row in F.ROWS if row.mode is None]
    assert r["mlp_weights"] == [f"transformer.h.{i}.mlp.{n}.weight" for i in range(2) for n in ("c_fc", "c_proj")]
    for name, e in r["runs"].items():
        assert "error" not in e, e
        assert len(e["losses"]) == STEPS and e["median_step_ms"] > 0 and "graph_breaks" not in e
    strict = r["runs"]["torch strict"]
    assert strict["loss_distance"] == 0.0 and strict["losses"][-1] < 0.8 * strict["losses"][0]  # it learns
    # each precision's first-step gradients within its class of float64's, its loss curve near strict fp32's
    bounds = {"torch strict": 1e-6, "torch TF32": 1e-6, "cupyffn ieee": 1e-6, "cupyffn fp16+fp8": 1e-4,
              "cupyffn tf32": 1e-3}
    for name, bound in bounds.items():
        e = r["runs"][name]
        assert 0 < e["grad_error"]["mlp_weights"] < bound and 0 < e["grad_error"]["all"] < bound, (name, e["grad_error"])
        assert e["loss_distance"] < (1e-4 if name == "cupyffn tf32" else 1e-5), name
    assert r["runs"]["cupyffn tf32"]["grad_error"]["mlp_weights"] > 10 * r["runs"]["cupyffn fp16+fp8"][
        "grad_error"]["mlp_weights"]
    assert r["speedup_vs_twin"]["cupyffn tf32"] == pytest.approx(
        r["runs"]["torch TF32"]["median_step_ms"] / r["runs"]["cupyffn tf32"]["median_step_ms"])
    assert r["paired_speedup_vs_twin"] == {}


def test_the_gradient_column_is_the_first_steps(gpt2_eager):
    import cupyffn.torch as ct

    model = EXAMPLE.build("gpt2", GPT2_TINY, "cpu")
    item = next(EXAMPLE.batches("gpt2", 1, 4, 16, 32, 64, "cpu"))
    reference = F.float64_gradients(EXAMPLE, model, "gpt2", item)
    ct.replace_mlps(model, precision="fp16+fp8")
    EXAMPLE.loss_of(model, "gpt2", item).backward()
    want = F.grad_errors({n: p.grad for n, p in model.named_parameters()}, reference, gpt2_eager["mlp_weights"])
    got = gpt2_eager["runs"]["cupyffn fp16+fp8"]["grad_error"]
    assert got["mlp_weights"] == pytest.approx(want["mlp_weights"], rel=1e-6)
    assert got["all"] == pytest.approx(want["all"], rel=1e-6) and got["worst"][0] == want["worst"][0]


def test_compiled_rows_of_a_tiny_sd35_stack_train_paired_without_a_graph_break():
    said = []
    r = F.summarize(F.run_model("sd35", STEPS, device="cpu", paired=True, modes=(None, "default"), sizes=SD35_TINY,
                                lr=1e-3, say=said.append))
    assert list(r["runs"]) == [row.name for row in F.ROWS if row.mode in (None, "default")]
    assert said[0] == ("sd35: run 1/4, torch strict and cupyffn fp16+fp8 and cupyffn ieee: 25 steps on cpu, "
                       "steps in turn")
    eager = r["runs"]
    for row in F.ROWS:
        if row.mode != "default":
            continue
        e = r["runs"][row.name]
        assert "error" not in e, e
        assert e["graph_breaks"] == 0
        twin_eager = {None: "torch strict", "fp16+fp8": "cupyffn fp16+fp8", "tf32": "cupyffn tf32"}[row.precision]
        if row.precision is None and row.tf32:
            twin_eager = "torch TF32"
        # compiled, the same training as eager (inductor's reassociation only)
        assert e["losses"] == pytest.approx(eager[twin_eager]["losses"], rel=1e-5)
        assert e["grad_error"]["mlp_weights"] == pytest.approx(eager[twin_eager]["grad_error"]["mlp_weights"],
                                                               rel=0.1, abs=2e-7)
    for name in F.TWINS:
        if name in r["runs"]:
            assert r["paired_speedup_vs_twin"][name] > 0
    assert [t[3] for t in F.targets(r) if t[0].startswith("graph breaks")] == [True]


def test_a_row_that_raises_is_recorded_and_the_others_still_run(monkeypatch):
    import cupyffn.torch as ct

    stepper = EXAMPLE.stepper

    def failing_for_tf32(model, *args, **kwargs):  # cupyffn's model in the TF32 group
        step = stepper(model, *args, **kwargs)
        swapped = bool(ct.swapped_mlps(model)) and torch.get_float32_matmul_precision() == "high"

        def checked(item):
            if swapped:
                raise RuntimeError("no tf32 today")
            return step(item)
        return checked

    monkeypatch.setattr(EXAMPLE, "stepper", failing_for_tf32)
    monkeypatch.setattr(F, "_example", lambda: EXAMPLE)
    r = F.summarize(F.run_model("sd35", STEPS, device="cpu", paired=True, modes=(None,), sizes=SD35_TINY))
    assert r["runs"]["cupyffn tf32"] == {"error": "RuntimeError: no tf32 today"}
    assert len(r["runs"]["torch TF32"]["losses"]) == STEPS and "cupyffn tf32" not in r["speedup_vs_twin"]
    assert "error" not in r["runs"]["cupyffn fp16+fp8"] and "cupyffn tf32" not in r["paired_speedup_vs_twin"]
    assert torch.get_float32_matmul_precision() == "highest"  # restored after the TF32 group


def test_the_jax_loop_trains_every_row_and_skips_without_its_gpu():
    pytest.importorskip("jax", reason="JAX not installed: pip install '.[test-frameworks]'")
    from benchmarks import training_jax

    said = []
    r = F.summarize(training_jax.run(STEPS, device="cpu", paired=True, sizes=dict(dim=32, hidden=128, tokens=64),
                                     say=said.append))
    assert said == ["jax-mlp: jax.jit highest and cupyffn fp16+fp8 and cupyffn ieee and jax.jit default and cupyffn "
                    f"tf32: {STEPS} steps on cpu, steps in turn"]
    assert list(r["runs"]) == [n for n, _ in training_jax.ROWS]
    bounds = {"jax.jit highest": 1e-6, "cupyffn ieee": 1e-6, "cupyffn fp16+fp8": 1e-4, "cupyffn tf32": 1e-3}
    for name, bound in bounds.items():
        e = r["runs"][name]
        assert len(e["losses"]) == STEPS and e["median_step_ms"] > 0
        assert 0 < e["grad_error"]["mlp_weights"] < bound and 0 < e["grad_error"]["all"] < bound, (name, e)
    assert r["runs"]["jax.jit highest"]["loss_distance"] == 0.0
    assert r["runs"]["cupyffn fp16+fp8"]["loss_distance"] < 1e-5 < r["runs"]["cupyffn tf32"]["loss_distance"] < 1e-3
    losses = r["runs"]["jax.jit highest"]["losses"]
    assert losses[-1] < 0.5 * losses[0]  # it learns
    assert set(r["paired_speedup_vs_twin"]) == set(training_jax.TWINS) == set(r["speedup_vs_twin"])

    from cupyffn.cuda import device

    if device.gpu_unavailable_reason(run_kernel=True) is not None:
        skipped = training_jax.run(STEPS, device="cuda")
        assert list(skipped) == ["skipped"] and "--device cuda, but" in skipped["skipped"]


# ---------------------------------------------------------------------------------------- tables, README, bench.py
def _entry(names, ms, twins=None, jax=False):
    """A summarized model entry with run `names` at `ms` per step, made-up measures."""
    runs = {n: {"losses": [2.0, 1.0], "median_step_ms": t, "loss_distance": 1e-7 * (i + 1),
                "grad_error": {"mlp_weights": 2e-5 * (i + 1), "all": 1e-5, "worst": ["w", 3e-5]}}
            for i, (n, t) in enumerate(zip(names, ms))}
    for n in runs:
        if not jax and {r.name: r for r in F.ROWS}[n].mode is not None:
            runs[n]["graph_breaks"] = 0
    entry = {"sizes": dict(dim=32, layers=2, seq=8, batch=4) if not jax else dict(dim=32, hidden=128, tokens=64),
             "runs": runs}
    if twins is not None:
        entry["twins"] = twins
    return F.summarize(entry)


def _result(models):
    return {"suite": F.SUITE, "env": {"device": "NVIDIA H100 80GB HBM3", "cupy": "14.2.0", "torch": "2.11.0"},
            "date": "2026-12-08T00:00:00+00:00", "git_commit": "abcdef0123", "command": "python bench.py --suite "
            "train-fp32 --paired", "steps": 40, "paired": True, "models": models}


def _full_result():
    from benchmarks import training_jax

    names = [r.name for r in F.ROWS]
    ms = [40.0, 20.0, 41.0, 14.0, 10.0, 37.0, 18.0, 10.5, 8.0, 36.0, 17.0, 9.0, 7.5]
    models = {m: _entry(names, ms) for m in F.TORCH_MODELS}
    models["jax-mlp"] = _entry([n for n, _ in training_jax.ROWS], [8.0, 3.0, 8.5, 2.0, 1.0],
                               twins=training_jax.TWINS, jax=True)
    return _result(models)


def test_markdown_table_and_targets():
    result = _full_result()
    result["models"]["sd35"]["runs"]["cupyffn tf32"] = {"error": "RuntimeError: a | b"}
    result["models"]["sd35"] = F.summarize(result["models"]["sd35"])
    result["models"]["late"] = {"skipped": "JAX has no CUDA device"}
    result["models"]["broken"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    text = F.markdown(result)
    assert "- broken: failed: OutOfMemoryError: CUDA out of memory" in text
    assert "broken" not in F.readme_section(result) and "late" not in F.readme_section(result)
    rows = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in text.splitlines() if line.startswith("| gpt2 |")}
    fp8 = rows[("| gpt2", "cupyffn fp16+fp8 + torch.compile")]
    assert fp8[2:] == ["18.00", "2.06x", "7.0e-07", "1.4e-04", "1.0e-05", "0 |"]
    assert rows[("| gpt2", "torch strict")][3] == ""  # no twin of its own
    assert "| sd35 | cupyffn tf32 | failed (1) |" in text and "- sd35, cupyffn tf32: RuntimeError: a \\| b" in text
    assert "- late: skipped: JAX has no CUDA device" in text
    assert "| jax-mlp | cupyffn tf32 | 1.00 | 2.00x |" in text  # beside jax.jit default (2.0 ms)
    targets = {t[0]: t for t in F.targets(result["models"]["gpt2"])}
    assert targets["fp16+fp8 compiled over torch.compile strict"][1:] == (pytest.approx(37 / 18), ">= 1.6x", True)
    assert targets["tf32 compiled over torch.compile TF32"][1:] == (pytest.approx(10.5 / 8), ">= 1.2x", True)
    assert targets["fp16+fp8's loss distance over torch TF32's"][1] == pytest.approx(2 / 4) and \
        targets["fp16+fp8's loss distance over torch TF32's"][3] is False
    assert targets["fp16+fp8's MLP weight gradients vs float64"][1:] == (pytest.approx(4e-5), "<= 0.0001", True)
    assert targets["graph breaks in the compiled cupyffn rows"][1:] == (0, "0", True)
    assert "| gpt2 | fp16+fp8 compiled over torch.compile strict | 2.06 | >= 1.6x | met |" in text
    assert "| gpt2 | fp16+fp8's loss distance over torch TF32's | 0.5 | <= 0.25 | MISSED |" in text


def test_readme_section_with_and_without_a_run_fits_the_readme(tmp_path):
    import shutil

    text = F.readme_section(None)
    assert "python bench.py --suite train-fp32 --paired" in text and text.count("\n") == 1
    section = F.readme_section(_full_result())
    lines = section.splitlines()
    assert lines[0] == ("| NVIDIA H100 80GB HBM3, 2026-12-08, commit abcdef0, 40 steps; cupyffn over torch | gpt2 | "
                        "gpt2-medium | sd35 | jax-mlp |")
    fp8, tf32 = (line.split(" | ") for line in lines[2:])
    assert fp8[1] == "2.00x, 2.06x; 2.0e-07, 4.0e-05"  # 40/20 eager, 37/18 compiled
    assert tf32[1] == "1.40x, 1.31x; 4.0e-07, 1.0e-04"  # 14/10, 10.5/8; torch TF32's distance, tf32's gradients
    assert fp8[4] == "-, 2.67x; 2.0e-07, 4.0e-05 |"  # jax: jitted, beside jax.jit highest (8 / 3)
    assert tf32[4] == "-, 2.00x; 4.0e-07, 1.0e-04 |"  # beside jax.jit default (2 / 1), its distance
    # the README regenerated from results/ with this run added stays a front door (<= 200 lines)
    for path in R.RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "train-fp32-nvidia-h100-80gb-hbm3.json").write_text(json.dumps(_full_result()))
    readme = R.README.read_text()
    assert F.readme_section(None) in readme or F.newest(R.RESULTS) is not None
    regenerated = R.render_readme(readme, tmp_path)
    assert section in regenerated and len(regenerated.splitlines()) <= 200


def test_bench_options_of_the_float32_suite(capsys):
    args = bench.parse_args(["--suite", "train-fp32"])
    assert args.steps == F.STEPS and args.models is None and args.paired is False
    assert bench.parse_args(["--suite", "train-fp32", "--models", "gpt2", "jax-mlp", "--steps", "30",
                             "--paired"]).models == ["gpt2", "jax-mlp"]
    assert bench.parse_args(["--suite", "train-bf16"]).steps == 300
    for argv, message in ((["--suite", "train-fp32", "--compiled", "cupyffn"], "--compiled is an option of --suite "
                                                                              "train-bf16"),
                          (["--suite", "train-bf16", "--models", "jax-mlp"], "jax-mlp is a model of --suite train-fp32"),
                          (["--steps", "40"], "options of --suite train-bf16 and train-fp32"),
                          (["--suite", "train-fp32", "--steps", "10"], "--steps must be >= 25")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err
    assert set(F.MODELS) == set(next(a.choices for a in bench._parser()._actions if a.dest == "models"))


def test_step_breakdown_runs_the_float32_rows():
    from tool_loader import load_tool  # tests/ is on sys.path

    tool = load_tool("step_breakdown")
    runs = tool.runs_of(tool.parse(["--float32", "--modes", "eager", "reduce-overhead", "--seq", "1024"]))
    assert runs == [("torch strict eager", False, None, "eager", False),
                    ("cupyffn fp16+fp8 eager", True, "fp16+fp8", "eager", False),
                    ("torch TF32 eager", False, None, "eager", True),
                    ("cupyffn tf32 eager", True, "tf32", "eager", True),
                    ("torch strict reduce-overhead", False, None, "reduce-overhead", False),
                    ("cupyffn fp16+fp8 reduce-overhead", True, "fp16+fp8", "reduce-overhead", False),
                    ("torch TF32 reduce-overhead", False, None, "reduce-overhead", True),
                    ("cupyffn tf32 reduce-overhead", True, "tf32", "reduce-overhead", True)]
    # the settings pair torch's TF32 flag with the cupyffn precision beside it, as the suite's groups do
    for tf32, precision in tool.SETTINGS.values():
        assert any(r.tf32 == tf32 and r.precision == precision for r in F.ROWS)
    assert [r[0] for r in tool.runs_of(tool.parse(["--float32", "--settings", "tf32"]))] == [
        "torch TF32 default", "cupyffn tf32 default"]
    assert [r[0] for r in tool.runs_of(tool.parse([]))] == ["torch default", "cupyffn + default"]  # bf16: as before
    with pytest.raises(SystemExit):
        tool.parse(["--seq", "0"])


def test_run_suite_assembles_every_model_and_writes_the_files(monkeypatch, tmp_path):
    from benchmarks import gpu, training_jax

    names = [r.name for r in F.ROWS]
    monkeypatch.setattr(F, "run_model", lambda model, steps, device, **k: dict(
        _entry(names, [10.0 + i for i in range(len(names))]), steps=steps, device=device, paired=k["paired"]))

    def jax_fails(*args, **kwargs):
        raise RuntimeError("XLA could not start\nsecond line")

    monkeypatch.setattr(training_jax, "run", jax_fails)
    monkeypatch.setattr(gpu, "environment", lambda cupy, torch: {"device": "NVIDIA H100 80GB HBM3", "cupy": "-",
                                                                 "torch": "-"})
    args = bench.parse_args(["--suite", "train-fp32", "--paired", "--steps", "30"])
    result = F.run_suite(args, cupy=None)
    assert list(result["models"]) == list(F.MODELS) and result["steps"] == 30 and result["paired"] is True
    assert all(result["models"][m]["device"] == "cuda" and result["models"][m]["paired"] for m in F.TORCH_MODELS)
    assert result["models"]["jax-mlp"] == {"error": "RuntimeError: XLA could not start second line"}
    assert result["models"]["gpt2"]["speedup_vs_twin"]["cupyffn ieee"] == pytest.approx(10 / 12)
    F.write(result, tmp_path, R.slug)
    assert json.loads((tmp_path / "train-fp32-nvidia-h100-80gb-hbm3.json").read_text())["models"]["jax-mlp"]
    assert "- jax-mlp: failed: RuntimeError" in (tmp_path / "train-fp32-nvidia-h100-80gb-hbm3.md").read_text()
    assert F.newest(tmp_path)["steps"] == 30 and F.newest(tmp_path / "none") is None
