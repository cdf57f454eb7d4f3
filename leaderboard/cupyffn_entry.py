"""cupyffn's entry points for NVIDIA SOL-ExecBench's L2/068 (gelu_approximate_feedforward_backward).

The evaluator calls an entry in destination-passing style: the definition's seven float32 inputs in its order,
then the three outputs it allocated, written in place; nothing is returned. `run_tf32` and `run_fp16_fp8` differ
only in cupyffn's precision (docs/precisions.md); each solution's `spec.entry_point` names one of them
(leaderboard/build.py writes the solutions, docs/leaderboard.md says how to run them).

CUDA tensors are handed to cupyffn as they are: read by pointer (zero-copy), the work enqueued on torch's current
stream of their device, so the evaluator's synchronize and its CUPTI window see every kernel. CPU tensors (and
NumPy arrays) run cupyffn's NumPy backend, which reproduces each precision's rounding.
"""

import cupyffn
from cupyffn.core import views as _views


def run_tf32(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out,
             grad_hidden_states, grad_weight1, grad_weight2):
    _backward("tf32", (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out),
              (grad_hidden_states, grad_weight1, grad_weight2))


def run_fp16_fp8(grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out,
                 grad_hidden_states, grad_weight1, grad_weight2):
    _backward("fp16+fp8", (grad_output, hidden_states, weight1, weight2, linear1_out, tanh_inner, gelu_out),
              (grad_hidden_states, grad_weight1, grad_weight2))


def _backward(precision, inputs, outputs):
    if not getattr(inputs[0], "is_cuda", False):
        cupyffn.gelu_ffn_backward(*inputs, precision=precision, out=outputs)
        return
    import cupy
    import torch

    device = inputs[0].get_device()
    with cupy.cuda.Device(device):
        stream = _views.external_stream(torch.cuda.current_stream(device).cuda_stream, device)
        cupyffn.gelu_ffn_backward(*inputs, precision=precision, out=outputs, stream=stream)
