"""The door's call flow, followed by grad_output (issue 49): validate, route, execute, each entered once per call;
a repeated call skips the route; at most a quarter of the steps double back into a file already entered
(tests/door_trace.py says what a step is). The NumPy route runs for real; the GPU route's door with fakes is in
tests/test_host_path.py."""

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


def test_a_repeated_signature_is_not_routed_again():
    """NumPy arrays have no signature (they are validated every call) but the route is asked per call then; the
    door's stages are still entered once each."""
    args = _args(1)
    cupyffn.gelu_ffn_backward(*args, precision="ieee")
    _, files, entries, doubled, _ = trace(lambda: cupyffn.gelu_ffn_backward(*args, precision="ieee"), _follow(args[0]))
    assert entries["api/validate.py"] == 1 and entries["api/execute.py"] == 1 and entries["api/routes.py"] <= 1
    assert doubled <= 0.25 * len(files), files
