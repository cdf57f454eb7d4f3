"""EngineOptions (cupyffn/f32/options.py) without a GPU: the defaults and the type checks. (That the defaults make
the measured windows' choices: tests/test_fused_policy.py.)"""

import dataclasses
import inspect

import numpy
import pytest

from cupyffn import GeluFFNBackward
from cupyffn.api.backward_plan import plan_with_options
from cupyffn.f32 import options as _options
from cupyffn.f32.options import SWITCHES, EngineOptions
from cupyffn.gemm import ksplit as _ksplit


def test_defaults_are_auto_and_the_k_chunk_limit():
    options = EngineOptions()
    assert [f.name for f in dataclasses.fields(options)] == list(SWITCHES) + ["max_k"]
    assert all(getattr(options, name) is None for name in SWITCHES)
    assert options.max_k == _ksplit.MAX_K
    assert _options.DEFAULT == options and hash(_options.DEFAULT) == hash(options)


def test_frozen_hashable_and_equal_by_value():
    a, b = EngineOptions(fused_gemm1=False, max_k=None), EngineOptions(fused_gemm1=False, max_k=None)
    assert a == b and hash(a) == hash(b) and len({a, b, EngineOptions()}) == 2
    assert a != EngineOptions(fused_gemm1=True, max_k=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.fused_gemm1 = True
    c = dataclasses.replace(a, call_graph=True)
    assert c.call_graph is True and c.fused_gemm1 is False and hash(c) == hash(EngineOptions(
        fused_gemm1=False, call_graph=True, max_k=None))


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", [1, 0, "1", "auto", numpy.bool_(True), 1.0])
def test_a_switch_takes_only_a_bool_or_none(name, value):
    with pytest.raises(TypeError, match=rf"EngineOptions\.{name} must be None \(auto\), True or False; got"):
        EngineOptions(**{name: value})


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", [None, True, False])
def test_a_switch_keeps_its_value(name, value):
    assert getattr(EngineOptions(**{name: value}), name) is value


def test_max_k():
    assert EngineOptions(max_k=None).max_k is None
    assert EngineOptions(max_k=0).max_k == 0  # as None: chunking off (_ksplit.chunks)
    assert EngineOptions(max_k=4096).max_k == 4096
    for bad in (True, 4096.0, "4096", numpy.float32(64)):
        with pytest.raises(TypeError, match="EngineOptions.max_k must be None .* or an int"):
            EngineOptions(max_k=bad)
    for bad in (-64, 100, _ksplit.ALIGN + 1):
        with pytest.raises(ValueError, match=f"EngineOptions.max_k must be None or an integer >= 0, a multiple of "
                                             f"{_ksplit.ALIGN}; got {bad}"):
            EngineOptions(max_k=bad)


def test_plan_with_options_checks_them_and_keeps_them_off_the_public_signature():
    """The NumPy backend has no engine to configure; the options must still be EngineOptions."""
    assert "_options" not in inspect.signature(GeluFFNBackward).parameters
    plan = plan_with_options(4, 8, 16, EngineOptions(max_k=None), device="cpu", need_bias_grads=True)
    assert type(plan) is GeluFFNBackward and repr(plan) == repr(GeluFFNBackward(4, 8, 16, device="cpu",
                                                                                 need_bias_grads=True))
    with pytest.raises(TypeError, match="options must be a cupyffn.f32.options.EngineOptions"):
        plan_with_options(4, 8, 16, {"max_k": None}, device="cpu")


def test_nothing_reads_the_environment_for_options(monkeypatch):
    """Options are arguments: the former debug variable changes nothing (the house rule: tests/test_house.py)."""
    assert not hasattr(_options, "ENV") and not hasattr(EngineOptions, "from_env")
    monkeypatch.setenv("CUPYFFN_ENGINE", "not=valid")
    assert GeluFFNBackward(4, 8, 16, device="cpu").precision.name == "ieee"
