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
    """Each A/B twin (a plan with one engine switch) is listed in report.A_B_TWINS, and names a public precision."""
    import cupyffn
    from benchmarks import report

    assert set(report.A_B_TWINS) == set(I.TWIN_SWITCHES) | {I.TF32_MEMORY_MODE}
    for name, (variable, value, precision) in I.TWIN_SWITCHES.items():
        assert precision in cupyffn.PRECISIONS and name.startswith(f"cupyffn-{precision}-"), name
        assert variable.startswith("CUPYFFN_") and value in ("0", "1")
    assert set(I.SM90_TWINS) <= set(I.TWIN_SWITCHES)
