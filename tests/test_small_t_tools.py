"""tools/small_t.py and tools/fused_epilogue_cost.py without a GPU: they load without cupy, answer --help,
and small_t's GEMM shapes are the backward's (cupyffn/_precision.py)."""

import pytest
from tool_loader import load_tool  # tests/ is on sys.path

from cupyffn import _precision as P


@pytest.mark.parametrize("name", ["small_t", "fused_epilogue_cost"])
def test_loads_without_cupy_and_answers_help(name, capsys):
    tool = load_tool(name)
    with pytest.raises(SystemExit) as info:
        tool.main(["--help"])
    assert info.value.code == 0 and "--out" in capsys.readouterr().out


@pytest.mark.parametrize("tokens", [1, 256, 3142])
def test_small_t_gemm_shapes_are_the_backwards(tokens):
    tool = load_tool("small_t")
    for g, letters in P.GEMM_MNK.items():
        m, n, k, a_trans = tool.gemm_layout(g, tokens)
        assert (m, n, k) == P.dims(letters, tokens, tool.D, tool.H), g
        assert a_trans == (g in ("gemm2", "gemm4")), g  # the weight gradients read A (T rows) transposed
