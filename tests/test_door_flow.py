"""The door's call flow, followed by grad_output (issue 49): validate, route, execute, each entered once per call;
a repeated call skips validation and the route; at most a quarter of the steps double back into a file already entered
(tests/door_trace.py says what a step is). The NumPy route runs for real; the GPU routes' with the device stubbed
are in tests/test_door_gpu_route.py (through the real executor) and tests/test_host_path.py."""

import numpy

import cupyffn
from cupyffn import workloads as W

from door_trace import trace


def _args(seed):
    inputs = W.make_inputs((16,), 8, 32, xp=numpy, seed=seed)
    return tuple(inputs[n] for n in W.INPUT_NAMES)


def _follow(grad_output):
    ptr = grad_output.__array_interface__["data"][0]

    def carries(obj):
        if obj is grad_output:
            return True
        if isinstance(obj, numpy.ndarray):
            return obj.__array_interface__["data"][0] == ptr and obj.size
        return getattr(obj, "ptr", None) == ptr or (type(obj) is int and obj == ptr)

    return carries


def test_validate_route_execute_each_entered_once():
    args = _args(0)
    _, files, entries, doubled, _ = trace(lambda: cupyffn.gelu_ffn_backward(*args, precision="ieee"), _follow(args[0]))
    for stage in ("api/validate.py", "api/routes.py", "api/execute.py"):
        assert entries[stage] == 1, (stage, files)
    assert doubled <= 0.25 * len(files), files


def test_a_repeated_configuration_is_neither_validated_nor_routed_again():
    """NumPy arrays are remembered by configuration as the GPU's are (docs/decisions/070): a repeat, with new outputs
    too, enters validate.py once (the lookup) and neither validates nor routes."""
    args = _args(1)
    out = [numpy.empty_like(args[n]) for n in (1, 2, 3)]
    first = cupyffn.gelu_ffn_backward(*args, precision="ieee", out=out)
    new_out = [numpy.empty_like(a) for a in out]
    flow = trace(lambda: cupyffn.gelu_ffn_backward(*args, precision="ieee", out=new_out), _follow(args[0]))
    assert flow.entries["api/validate.py"] == 1 and flow.entries["api/execute.py"] == 1, flow.files
    assert flow.functions["api/validate.py:validate"] == 0 and "api/routes.py" not in flow.entries
    assert flow.doubled <= 0.25 * len(flow.files), flow.files
    assert all(numpy.array_equal(a, b) for a, b in zip(first, flow.result))
