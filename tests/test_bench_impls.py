"""bench's implementations (benchmarks/impls.py) on the CPU, with a stand-in for torch: what a torch
implementation's call leaves behind."""

import types

import pytest

from benchmarks import impls as I


def fake_torch():
    matmul = types.SimpleNamespace(allow_tf32=False)
    return types.SimpleNamespace(backends=types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=matmul)),
                                 from_dlpack=lambda a: a)


@pytest.mark.parametrize("name,during", [("torch-compile-tf32", True), ("torch-compile-fp32", False)])
@pytest.mark.parametrize("before", [False, True])
def test_torch_call_sets_tf32_for_itself_only(name, during, before):
    cupy = pytest.importorskip("cupy")
    torch = fake_torch()
    torch.backends.cuda.matmul.allow_tf32 = before
    factory = I.Implementations(cupy, torch, compile_=False)
    seen = []

    def compiled(*args):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        if len(seen) == 2:
            raise RuntimeError("a failing call")
        return args

    factory.compiled[name] = compiled
    run = factory.build([name], 4, 8, 16)[name].bind(["a", "b"], None)
    assert run() == ("a", "b")
    with pytest.raises(RuntimeError, match="a failing call"):
        run()
    assert seen == [during, during]
    assert torch.backends.cuda.matmul.allow_tf32 is before  # put back, also after the failure


def test_every_twin_is_kept_out_of_the_headline():
    """Each A/B twin (a plan with one mechanism of its options turned off) is listed in report.A_B_TWINS, and names a
    public precision."""
    import dataclasses

    import cupyffn
    from benchmarks import report
    from cupyffn.f32.options import SWITCHES, EngineOptions

    assert set(report.A_B_TWINS) == set(I.TWIN_OPTIONS) | {I.TF32_MEMORY_MODE}
    for name, (options, precision) in I.TWIN_OPTIONS.items():
        assert precision in cupyffn.PRECISIONS and name.startswith(f"cupyffn-{precision}-"), name
        assert isinstance(options, EngineOptions)
        changed = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                   if getattr(options, f.name) != f.default}
        assert len(changed) == 1 and set(changed) <= set(SWITCHES) and set(changed.values()) <= {True, False}, name
    assert set(I.SM90_TWINS) <= set(I.TWIN_OPTIONS)


def test_twins_are_built_with_their_options_not_the_environment(monkeypatch):
    """A twin's plan gets its options through plan_with_options; the environment is never edited."""
    import os

    cupy = pytest.importorskip("cupy")
    built = []

    def plan(*shape, precision=None):
        built.append((shape, precision, None, dict(os.environ)))

    def plan_with_options(*shape, precision=None):
        built.append((shape[:3], precision, shape[3], dict(os.environ)))

    monkeypatch.setattr(I.cupyffn, "GeluFFNBackward", plan)
    monkeypatch.setattr(I, "plan_with_options", plan_with_options)
    before = dict(os.environ)
    factory = I.Implementations(cupy, None, compile_=False)
    for name, (options, precision) in I.TWIN_OPTIONS.items():
        factory.build([name], 4, 8, 16)
        assert built[-1][:3] == ((4, 8, 16), precision, options)
        assert built[-1][3] == before, name
    factory.build(["cupyffn-tf32"], 4, 8, 16)
    assert built[-1][:3] == ((4, 8, 16), "tf32", None)  # the headline plan: the defaults
    assert dict(os.environ) == before
