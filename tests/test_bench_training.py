"""bench.py --suite train-bf16 (benchmarks/training.py, examples/train_gpt2.py): every run of the suite (eager,
torch.compile and torch.compile reduce-overhead, each plain and with cupyffn's MLPs) trained on the CPU at a tiny
size, its summary, table and files; a run that raises is recorded and the others still run; GPT-2 medium's depth
comes down where GPU memory is short."""

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: framework tests are opt-in, "
                                            "pip install '.[test-frameworks]'")
pytest.importorskip("ml_dtypes")

from benchmarks import training  # noqa: E402

EXAMPLE = training._example()
TINY = dict(dim=32, layers=2, seq=8, batch=4)
PLAIN = ("torch eager", "torch.compile", "torch.compile reduce-overhead")
COMPILED_CUPYFFN = ("cupyffn + torch.compile", "cupyffn + torch.compile reduce-overhead")


@pytest.fixture(scope="module")
def cpu_run():
    """Every run of the suite for the SD3.5 stack on the CPU (torch.compile needs the C++ compiler), errors kept."""
    return EXAMPLE.main("sd35", steps=40, device="cpu", compile=True, tolerance=0.05, lr=1e-3, keep_going=True,
                        **TINY)


def test_summary_markdown_and_files_from_a_cpu_run(cpu_run, tmp_path):
    r = cpu_run
    entry = training.summarize(r)
    assert list(entry["runs"]) == [name for name, _, _ in EXAMPLE.RUNS]
    assert entry["sizes"] == dict(TINY, heads=12, vocab=512, hidden=128)
    for name in PLAIN + ("cupyffn",):  # these run on the CPU today (compiled cupyffn: the next test)
        run = entry["runs"][name]
        assert "error" not in run, run
        assert run["losses"] == r[name]["losses"] and len(run["losses"]) == 40
        eager = r["torch eager"]
        assert run["agree"] and run["final_loss_vs_eager"] == pytest.approx(run["final_loss"] / eager["final_loss"])
        assert entry["speedup_vs_eager"][name] == pytest.approx(eager["median_step_ms"] / run["median_step_ms"])
    assert entry["runs"]["torch.compile"]["graph_breaks"] == 0 and "graph_breaks" not in entry["runs"]["torch eager"]
    assert entry["speedup_vs_twin"]["cupyffn"] == pytest.approx(
        r["torch eager"]["median_step_ms"] / r["cupyffn"]["median_step_ms"])
    assert entry["final_loss_ratio"] == r["cupyffn"]["final_loss_vs_eager"] and entry["agree"] and entry["learned"]

    # the table, with one run failed as a compiled cupyffn run fails before the fix of its bf16 view under Dynamo
    failed = dict(entry, runs=dict(entry["runs"], **{COMPILED_CUPYFFN[0]: {"error": "TorchRuntimeError: a | b"}}))
    result = {"env": {"device": "CPU", "cupy": "-", "torch": "-"}, "date": "2026-12-03T00:00:00+00:00",
              "git_commit": "abcdef0", "command": "python bench.py --suite train-bf16", "steps": 40,
              "tolerance": 0.05, "models": {"sd35": failed}}
    text = training.markdown(result)
    rows = {line.split(" | ")[1]: line.split(" | ") for line in text.splitlines() if line.startswith("| sd35 | ")}
    assert list(rows) == [name for name, _, _ in EXAMPLE.RUNS]
    eager = rows["torch eager"]
    assert float(eager[2]) == pytest.approx(r["torch eager"]["median_step_ms"], abs=0.01) and eager[3] == "1.00x"
    assert rows["cupyffn"][5] == f"{r['cupyffn']['final_loss_vs_eager']:.4f}"
    assert rows["cupyffn"][4] == f"{entry['speedup_vs_twin']['cupyffn']:.2f}x"
    assert rows[COMPILED_CUPYFFN[0]][2] == "failed (1)"
    assert "- sd35, cupyffn + torch.compile: TorchRuntimeError: a \\| b" in text.splitlines()
    assert "sd35 dim 32, 2 layers, seq 8, batch 4" in text
    training.write(result, tmp_path, lambda device: device.lower())
    assert (tmp_path / "train-bf16-cpu.md").read_text() == text
    assert '"speedup_vs_twin"' in (tmp_path / "train-bf16-cpu.json").read_text()


def test_compiled_cupyffn_runs_train_like_torch_on_cpu(cpu_run):
    # cupyffn's MLPs under torch.compile, default mode and reduce-overhead, compiled exactly as the plain model
    for name in COMPILED_CUPYFFN:
        run = cpu_run[name]
        assert "error" not in run, f"{name}: {run.get('error', '')[:600]}"
        assert run["agree"] and len(run["losses"]) == 40, run["final_loss_vs_eager"]


def test_a_run_that_raises_is_recorded_and_the_others_still_run(monkeypatch):
    import cupyffn.torch as ct

    stepper = EXAMPLE.stepper

    def failing_for_cupyffn(model, *args, **kwargs):
        step = stepper(model, *args, **kwargs)

        def checked(item):
            if ct.swapped_mlps(model):
                raise RuntimeError("no cupyffn today\nsecond line")
            return step(item)
        return checked

    monkeypatch.setattr(EXAMPLE, "stepper", failing_for_cupyffn)
    for paired in (False, True):  # paired: the plain twin trains on alone
        r = EXAMPLE.main("sd35", steps=20, device="cpu", compile=False, keep_going=True, paired=paired, **TINY)
        assert r["cupyffn"] == {"error": "RuntimeError: no cupyffn today second line"}
        assert len(r["torch eager"]["losses"]) == 20 and r["final_loss_ratio"] is None and r["agree"] is False
        entry = training.summarize(r)
        assert entry["speedup_vs_twin"] == {} and entry["paired_speedup_vs_twin"] == {}
    with pytest.raises(RuntimeError, match="no cupyffn today"):
        EXAMPLE.main("sd35", steps=20, device="cpu", compile=False, **TINY)


def test_paired_twins_alternate_steps_and_train_as_one_after_the_other(monkeypatch, cpu_run):
    import cupyffn.torch as ct

    stepper, order = EXAMPLE.stepper, []

    def timed_by_rule(model, *args, **kwargs):  # the plain model's steps take 3 ms, the swapped one's 2
        step, swapped = stepper(model, *args, **kwargs), bool(ct.swapped_mlps(model))

        def ruled(item):
            loss, _ = step(item)
            order.append(swapped)
            return loss, 2.0 if swapped else 3.0
        return ruled

    monkeypatch.setattr(EXAMPLE, "stepper", timed_by_rule)
    said = []
    r = EXAMPLE.main("sd35", steps=40, device="cpu", compile=False, tolerance=0.05, lr=1e-3, keep_going=True,
                     paired=True, say=said.append, **TINY)
    # each twin goes first every other step, the two in lockstep on the same batches
    assert order == [False, True, True, False] * 20
    assert said[0] == "sd35: run 1/1, torch eager and cupyffn: 40 steps on cpu, steps alternating"
    # the same training as one run after the other (cpu_run: the same sizes, seeds and learning rate)
    for name in ("torch eager", "cupyffn"):
        assert r[name]["losses"] == pytest.approx(cpu_run[name]["losses"], rel=1e-6, abs=1e-7)
    assert r["cupyffn"]["paired_speedup_vs_twin"] == 1.5 and "paired_speedup_vs_twin" not in r["torch eager"]
    entry = training.summarize(r)
    assert entry["paired_speedup_vs_twin"] == {"cupyffn": 1.5} and entry["speedup_vs_twin"]["cupyffn"] == 1.5
    text = training.markdown({"env": {"device": "CPU", "cupy": "-", "torch": "-"}, "date": "2026-12-06",
                              "git_commit": "abcdef0", "command": "python bench.py --paired", "steps": 40,
                              "compiled": "module", "paired": True, "models": {"sd35": entry}, "tolerance": 0.05})
    assert "| sd35 | cupyffn | 2.00 | 1.50x | 1.50x (step by step 1.50x) |" in text and "Paired: " in text


def test_paired_compiled_twins_train_and_count_their_own_graph_breaks(cpu_run):
    r = EXAMPLE.main("sd35", steps=40, device="cpu", compile=True, tolerance=0.05, lr=1e-3, keep_going=True,
                     paired=True, **TINY)
    for name, _, mode in EXAMPLE.RUNS:
        assert "error" not in r[name], f"{name}: {r[name].get('error', '')[:600]}"
        assert r[name]["losses"] == pytest.approx(cpu_run[name]["losses"], rel=1e-4, abs=1e-6), name
        if mode is not None:
            assert r[name]["graph_breaks"] == cpu_run[name]["graph_breaks"] == 0
    for twin in EXAMPLE.TWINS:
        assert r[twin]["paired_speedup_vs_twin"] > 0


def test_gpt2_medium_comes_down_to_the_layers_that_fit(monkeypatch, capsys):
    sizes = EXAMPLE.PRESETS["gpt2-medium"]
    assert (sizes["dim"], sizes["layers"], sizes["seq"]) == (1024, 24, 1024) and "gpt2-medium" in training.MODELS
    built = []

    def build(kind, sizes, device):  # a stand-in model: its depth
        built.append(sizes["layers"])
        return sizes["layers"]

    def train(layers, *args, **kwargs):  # a GPU whose memory holds 6 layers at these sizes
        if layers > 6:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return [1.0], [1.0]

    monkeypatch.setattr(EXAMPLE, "build", build)
    monkeypatch.setattr(EXAMPLE, "train", train)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1 << 30, 24 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert EXAMPLE.layers_that_fit("gpt2", sizes, "cuda") == 6 and built == [24, 12, 6]
    notes = capsys.readouterr().out.splitlines()
    assert notes == ["note: gpt2 with 24 layers (dim 1024, seq 1024, batch 8) does not fit in GPU memory (24 GiB); "
                     "trying 12 layers",
                     "note: gpt2 with 12 layers (dim 1024, seq 1024, batch 8) does not fit in GPU memory (24 GiB); "
                     "trying 6 layers"]
    assert EXAMPLE.layers_that_fit("gpt2", sizes, "cpu") == 24 and built == [24, 12, 6]  # the CPU: no probe


def test_compiled_option_is_train_bf16s_and_reaches_the_swap(capsys):
    import bench

    import cupyffn.torch as ct

    # bench.py parses without torch, so it spells the choices out: they must stay replace_mlps' own
    choices = next(a.choices for a in bench._parser()._actions if a.dest == "compiled")
    assert tuple(choices) == ct.COMPILED
    from tool_loader import load_tool  # tests/ is on sys.path

    breakdown = load_tool("step_breakdown")  # the same in dev/step_breakdown.py, whose default is the operators
    assert breakdown.parse([]).compiled == "cupyffn"
    assert all(breakdown.parse(["--compiled", c]).compiled == c for c in ct.COMPILED)
    assert bench.parse_args(["--suite", "train-bf16"]).compiled == "module"  # replace_mlps' default
    assert bench.parse_args(["--suite", "train-bf16", "--compiled", "cupyffn"]).compiled == "cupyffn"
    with pytest.raises(SystemExit):
        bench.parse_args(["--compiled", "cupyffn"])  # the official suite swaps no model
    assert "--paired are options of --suite train-bf16" in capsys.readouterr().err
    assert bench.parse_args(["--suite", "train-bf16", "--paired"]).paired is True
    assert bench.parse_args(["--suite", "train-bf16"]).paired is False
    r = EXAMPLE.main("sd35", steps=20, device="cpu", compile=False, keep_going=True, compiled="cupyffn", **TINY)
    assert r["compiled"] == "cupyffn"
    note = training.markdown({"env": {"device": "CPU", "cupy": "-", "torch": "-"}, "date": "2026-12-06",
                              "git_commit": "abcdef0", "command": "python bench.py", "steps": 20, "compiled": "module",
                              "models": {}, "tolerance": 0.03})
    assert "Compiled swapped runs: the MLP modules' own forward" in note
