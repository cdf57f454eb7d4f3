"""torch.compile(mode="reduce-overhead", fullgraph=True) of a training step of the torch layer in every
configuration (tests/torch_capture_cases.py), after a history of other calls in the same process: inductor records
the step as CUDA graphs (no cudagraph skip), and every step, with new input values and parameters updated in
place, gives that step's results against float64 (checked before the next step overwrites them)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
import torch_capture_cases as C  # noqa: E402  (tests/ is on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch and leaves no compiled graph behind (a compiled graph keeps its example
    tensors, and with them autograd graphs of the layer, alive)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("config", list(C.CONFIGS))
def test_reduce_overhead_training_steps(config, bias, fresh_dynamo):
    from torch._dynamo.utils import counters

    ffn = C.make_layer(torch, config, bias)
    C.history(torch, ffn, config)
    counters.clear()
    compiled = torch.compile(ffn, mode="reduce-overhead", fullgraph=True)
    for seed in range(5):  # warm-up, recording, then replays
        x, r = C.fresh_inputs(torch, seed)
        x.requires_grad_()
        C.nudge(torch, ffn, seed)
        ffn.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        y = C.step(torch, compiled, config, x, r)
        torch.cuda.synchronize()
        C.check(torch, ffn, config, x, r, y)
    assert counters["inductor"]["cudagraph_skips"] == 0
