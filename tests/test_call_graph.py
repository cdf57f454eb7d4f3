"""The call graph's host side without a GPU: the driver struct it fills, the batched GEMM's argument order, and
the default windows (the GPU behaviour: tests/test_gpu_call_graph.py, tests/test_gpu_convert_ab.py)."""

import ctypes

import pytest

from cupyffn.cuda import kernels as _kernels
from cupyffn.core import precision as P
from cupyffn.cuda import call_graph as _call_graph
from cupyffn.f32 import plan as E
from cupyffn.f32.options import EngineOptions
from cupyffn.gemm import cublas as _cublas


def test_kernel_node_params_match_cuda_h():
    """CUDA_KERNEL_NODE_PARAMS_v2: func, grid[3], block[3], sharedMemBytes, kernelParams, extra, kern, ctx."""
    p = _call_graph._KernelNodeParams
    offsets = {name: getattr(p, name).offset for name, _ in p._fields_}
    assert offsets == {"func": 0, "grid": 8, "block": 20, "shared_mem_bytes": 32, "kernel_params": 40, "extra": 48,
                       "kern": 56, "ctx": 64}
    assert ctypes.sizeof(p) == 72


def test_call_table_holds_three_pointers_per_gemm():
    assert ctypes.sizeof(_kernels.GemmPointers) == 24
    assert ctypes.sizeof(_kernels.CallTable) == 24 * _kernels.CALL_GEMMS == 96


class _FakeLib:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args):
            self.calls.append((name, args))
            return 0
        return record


def _value(arg):
    return arg.value if hasattr(arg, "value") else arg


def test_indirect_gemm_passes_the_table_entries_in_cublas_order(monkeypatch):
    """Row-major C[M,N] = A @ B is column-major C^T = B^T A^T: cublasGemmBatchedEx's A array must be our B's
    entry (table + 8), its B array our A's (table), C at table + 16, batch 1; everything else as cublasGemmEx."""
    fake = _FakeLib()
    monkeypatch.setattr(_cublas, "library", lambda: fake)
    gemm = _cublas.Gemm(300, 520, 128, _cublas.R_16F, _cublas.R_16F, _cublas.R_32F, a_trans=True, name="t")
    gemm.a.value, gemm.b.value, gemm.c.value = 0x1000, 0x2000, 0x3000
    gemm.alpha.value, gemm.beta.value = 0x40, 0x44

    class Handle:
        ptr = ctypes.c_void_p(0x77)

    gemm(Handle())
    gemm.indirect(Handle(), 0x9000)
    (name_ex, ex), (name_b, batched) = fake.calls
    assert (name_ex, name_b) == ("cublasGemmEx", "cublasGemmBatchedEx")
    ex, batched = [_value(a) for a in ex], [_value(a) for a in batched]
    assert batched[7] == 0x9000 + 8 and batched[10] == 0x9000 and batched[14] == 0x9000 + 16
    assert ex[7] == 0x2000 and ex[10] == 0x1000 and ex[14] == 0x3000  # the same roles, given directly
    assert batched[17] == 1  # one matrix
    same = [i for i in range(17) if i not in (7, 10, 14)]  # handle, ops, n m k, alpha, types, lds, beta
    assert [batched[i] for i in same] == [ex[i] for i in same]
    assert batched[18:] == ex[17:]  # compute type, algorithm


@pytest.mark.parametrize("windows", [E.CALL_GRAPH_TOKENS, E.CONVERT_AB_TOKENS])
def test_default_windows_are_tf32_at_small_t(windows):
    """Both measured faster only for the tf32 plan at T <= 512 (docs/decisions/018-call-graph.md,
    019-convert-ab-one-launch.md)."""
    assert windows == {P.FMT_F16S: (1, 512)}


def test_option_wanted():
    """The engine's window switches (EngineOptions fused_gemm1, gelu_epilogue, epilogue_warps, call_graph,
    convert_ab) read one way: None (auto) the window, True always, False never."""
    windows = {P.FMT_F16S: (1, 512)}
    auto = EngineOptions().call_graph
    assert E.option_wanted(auto, windows, P.FMT_F16S, 512)
    assert not E.option_wanted(auto, windows, P.FMT_F16S, 513)
    assert not E.option_wanted(auto, windows, P.FMT_BF16X3, 256)  # not listed
    assert E.option_wanted(EngineOptions(call_graph=True).call_graph, windows, P.FMT_BF16X3, 10 ** 6)
    assert not E.option_wanted(EngineOptions(call_graph=False).call_graph, windows, P.FMT_F16S, 256)
    with pytest.raises(TypeError, match="EngineOptions.call_graph must be None"):
        EngineOptions(call_graph="yes")
