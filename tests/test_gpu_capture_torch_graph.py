"""torch.cuda.graph of a training step of the torch layer in every configuration (float32 engine, bf16 / fp16
activations with fp32 master or 16-bit weights, biases or not, Conv1D [in, out] weights), captured after a history
of other calls in the same process (tests/torch_capture_cases.py), by torch's recipe (a warm-up on a side stream).
Each replay, with new input values and parameters updated in place, gives that step's results against float64;
outputs and gradients are NaN-poisoned before each replay. Afterwards the layer still runs eagerly."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
import torch_capture_cases as C  # noqa: E402  (tests/ is on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available")]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("config", list(C.CONFIGS))
def test_captured_training_step_replays_new_values(config, bias):
    ffn = C.make_layer(torch, config, bias)
    C.history(torch, ffn, config)
    static_x = torch.zeros(*C.LEAD, C.DIM, device="cuda", requires_grad=True)
    static_r = torch.zeros(*C.LEAD, C.DIM, device="cuda")
    x0, r0 = C.fresh_inputs(torch, 0)
    with torch.no_grad():
        static_x.copy_(x0)
        static_r.copy_(r0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            ffn.zero_grad(set_to_none=True)
            static_x.grad = None
            C.step(torch, ffn, config, static_x, static_r)
    torch.cuda.current_stream().wait_stream(side)
    ffn.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = C.step(torch, ffn, config, static_x, static_r)
    for seed in range(1, 4):
        x, r = C.fresh_inputs(torch, seed)
        C.nudge(torch, ffn, seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_r.copy_(r)
            for t in [static_y] + [g for g in C.grads(ffn, static_x) if g is not None]:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        C.check(torch, ffn, config, static_x, static_r, static_y)
    del graph
    # the process's CUDA state is intact: an eager step on the default stream
    ffn.zero_grad(set_to_none=True)
    x, r = C.fresh_inputs(torch, 9)
    x.requires_grad_()
    y = C.step(torch, ffn, config, x, r)
    torch.cuda.synchronize()
    C.check(torch, ffn, config, x, r, y)
