"""EngineOptions (cupyffn/engine/options.py) without a GPU: the defaults, the type checks, the one debug variable
CUPYFFN_ENGINE parsed into the same object, and the functional API's plan cache keeping plans of different options
apart. (That the defaults make the measured windows' choices: tests/test_fused_policy.py.)"""

import dataclasses
import types

import numpy
import pytest

from cupyffn.api import functional as _backward
from cupyffn.engine import options as _options
from cupyffn.gemm import ksplit as _ksplit
from cupyffn.core import precision as P
from cupyffn.engine.options import SWITCHES, EngineOptions


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


@pytest.mark.parametrize("text,expected", [
    ("", EngineOptions()),
    (" , ", EngineOptions()),
    ("fused_gemm1=0", EngineOptions(fused_gemm1=False)),
    ("fused_gemm1=0,call_graph=1,max_k=none", EngineOptions(fused_gemm1=False, call_graph=True, max_k=None)),
    (" gelu_epilogue = 1 , epilogue_warps=AUTO,", EngineOptions(gelu_epilogue=True)),
    ("sm90_pair=1,convert_ab=0", EngineOptions(sm90_pair=True, convert_ab=False)),
    ("max_k=4096", EngineOptions(max_k=4096)),
    ("max_k=None", EngineOptions(max_k=None)),
    ("max_k=0", EngineOptions(max_k=0)),
])
def test_parse(text, expected):
    assert _options.parse(text) == expected


@pytest.mark.parametrize("text,bad", [
    ("fused_gemm1", "'fused_gemm1' is not field=value"),
    ("fused=0", "'fused=0' is not field=value with a known field"),
    ("Fused_gemm1=0", "'Fused_gemm1=0' is not field=value"),
    ("fused_gemm1=yes", "bad value in 'fused_gemm1=yes'"),
    ("call_graph=", "bad value in 'call_graph='"),
    ("call_graph=true", "bad value in 'call_graph=true'"),
    ("max_k=100", "bad value in 'max_k=100'"),
    ("max_k=-64", "bad value in 'max_k=-64'"),
    ("max_k=auto", "bad value in 'max_k=auto'"),
    ("fused_gemm1=0;call_graph=1", "bad value in 'fused_gemm1=0;call_graph=1'"),
    ("call_graph=1,call_graph=0", "call_graph is given twice"),
])
def test_a_bad_string_names_the_variable_the_entry_and_the_valid_values(text, bad):
    with pytest.raises(ValueError) as info:
        _options.parse(text)
    message = str(info.value)
    assert message.startswith(f"CUPYFFN_ENGINE={text!r}: ") and bad in message, message
    if "twice" not in bad:
        assert all(name in message for name in SWITCHES + ("max_k",)) and "auto, 1 or 0" in message


def test_from_env_reads_the_variable_and_caches_by_its_value(monkeypatch):
    monkeypatch.delenv("CUPYFFN_ENGINE", raising=False)
    assert EngineOptions.from_env() == EngineOptions()
    monkeypatch.setenv("CUPYFFN_ENGINE", "call_graph=0")
    first = EngineOptions.from_env()
    assert first == EngineOptions(call_graph=False)
    parsed = []
    monkeypatch.setattr(_options, "parse", lambda text: parsed.append(text) or EngineOptions(convert_ab=True))
    assert EngineOptions.from_env() is first and parsed == []  # cached by the raw string: not parsed again
    monkeypatch.setenv("CUPYFFN_ENGINE", "convert_ab=1")
    assert EngineOptions.from_env() == EngineOptions(convert_ab=True) and parsed == ["convert_ab=1"]
    assert EngineOptions.from_env() == EngineOptions(convert_ab=True) and parsed == ["convert_ab=1"]


def test_from_env_refuses_a_bad_value_every_time(monkeypatch):
    monkeypatch.setenv("CUPYFFN_ENGINE", "max_k=7")
    for _ in range(2):
        with pytest.raises(ValueError, match="CUPYFFN_ENGINE='max_k=7'"):
            EngineOptions.from_env()


def test_the_cpu_plan_ignores_the_variable_and_checks_the_keyword(monkeypatch):
    """The NumPy backend has no engine to configure: a CPU plan never reads CUPYFFN_ENGINE; _options must be
    EngineOptions or None."""
    monkeypatch.setenv("CUPYFFN_ENGINE", "not=valid")
    _backward.GeluFFNBackward(4, 8, 16, device="cpu")
    _backward.GeluFFNBackward(4, 8, 16, device="cpu", _options=EngineOptions(max_k=None))
    with pytest.raises(TypeError, match="_options must be None or a cupyffn.engine.options.EngineOptions"):
        _backward.GeluFFNBackward(4, 8, 16, device="cpu", _options={"max_k": None})


def test_plan_key_holds_the_options():
    call = types.SimpleNamespace(device=0, tokens=256, dim=64, hidden_dim=256)
    tf32 = P.lookup("tf32")
    keys = {_backward._plan_key(call, tf32, True, True, o) for o in (EngineOptions(), EngineOptions(call_graph=False),
                                                                      EngineOptions(max_k=None))}
    assert len(keys) == 3
    assert _backward._plan_key(call, tf32, True, True, EngineOptions()) == \
        _backward._plan_key(call, tf32, True, True, _options.parse(""))
    assert len({_backward._recent_key("sig", tf32, True, True, o)
                for o in (EngineOptions(), EngineOptions(fused_gemm1=False))}) == 2


class _FakePlan:
    def __init__(self, options):
        self.options = options

    def _run(self, args, out, stream, accumulate, sig, call=None, check_activations=False, grad_hidden_ready=None):
        return self.options, call is None  # call None: the fast path for repeated arrays ran


class _FakeCache:
    """The functional API's plan cache, reduced to its keys: one fake plan per key."""

    def __init__(self):
        self.plans, self.acquired = {}, []

    def acquire(self, key, build=None):
        self.acquired.append(key)
        if key not in self.plans:
            if build is None:
                return None
            self.plans[key] = _FakePlan(key[-1])
        return self.plans[key]

    def reacquire(self, plan):
        return plan in self.plans.values()

    def release(self, plan):
        pass


def test_the_functional_api_never_reuses_a_plan_built_with_other_options(monkeypatch):
    """gelu_ffn_backward on (stand-in) GPU arrays: the plan cache and the repeated-arrays fast path are keyed by
    the options CUPYFFN_ENGINE gives at each call, so changing it between calls builds (or finds) the plan of the
    new options, and setting it back finds the first plan again."""
    cache = _FakeCache()
    monkeypatch.setattr(_backward, "_plans", cache)
    monkeypatch.setattr(_backward, "_recent", {})
    monkeypatch.setattr(_backward._validate, "signature", lambda args, out, accumulate: ("same arrays",))
    call = types.SimpleNamespace(backend="cupy", device=0, tokens=256, dim=64, hidden_dim=256)
    monkeypatch.setattr(_backward._validate, "prepare", lambda *a: call)
    monkeypatch.setattr(_backward, "_stream_ptr", lambda stream, device: 0)
    monkeypatch.setattr(_backward._plan_cache, "is_capturing", lambda ptr: False)
    monkeypatch.setattr(_backward, "GeluFFNBackward", lambda *a, **k: pytest.fail("the fake cache builds"))
    pytest.importorskip("cupy")  # _acquire_plan enters cupy.cuda.Device on a miss
    monkeypatch.setattr("cupy.cuda.Device", lambda device: _NoDevice())
    args = [None] * 7

    def call_with(value):
        if value is None:
            monkeypatch.delenv("CUPYFFN_ENGINE", raising=False)
        else:
            monkeypatch.setenv("CUPYFFN_ENGINE", value)
        return _backward.gelu_ffn_backward(*args, precision="tf32")

    assert call_with(None) == (EngineOptions(), False)            # built
    assert call_with(None) == (EngineOptions(), True)             # the fast path, same plan
    assert call_with("call_graph=0") == (EngineOptions(call_graph=False), False)  # not the first plan
    assert call_with("call_graph=0") == (EngineOptions(call_graph=False), True)
    assert call_with("max_k=none") == (EngineOptions(max_k=None), False)
    assert call_with("") == (EngineOptions(), True)               # the defaults again: the first plan
    assert len(cache.plans) == 3
    assert {key[-1] for key in cache.plans} == {EngineOptions(), EngineOptions(call_graph=False),
                                                EngineOptions(max_k=None)}
    monkeypatch.setenv("CUPYFFN_ENGINE", "call_graph=maybe")
    with pytest.raises(ValueError, match="CUPYFFN_ENGINE"):
        _backward.gelu_ffn_backward(*args, precision="tf32")


class _NoDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
