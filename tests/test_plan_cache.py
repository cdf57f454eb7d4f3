"""Plan lifetime without a GPU: PlanCache in-use counts, eviction, pins, clear(); closed and pinned
CPU plans; the failure note when the NaN fill fails; the capture query's legacy-stream shortcut."""

import threading
import types

import numpy
import pytest

import cupyffn
from cupyffn import _plan_cache
from cupyffn import workloads as W
from cupyffn._plan_cache import PlanCache


class FakePlan:
    """Records close(); use() fails if the plan is closed while a call is inside it."""

    def __init__(self, name):
        self.name = name
        self.closed = False
        self.close_calls = 0

    def close(self):
        self.close_calls += 1
        self.closed = True

    def use(self):
        assert not self.closed, f"{self.name} closed before the call started"
        for _ in range(50):  # give another thread time to evict it
            pass
        assert not self.closed, f"{self.name} closed under a call"


@pytest.fixture(autouse=True)
def no_pins_left():
    yield
    _plan_cache.release_captured_plans()


def build(name):
    return lambda: FakePlan(name)


def test_acquire_builds_once_and_evicts_least_recently_used():
    cache = PlanCache(2)
    a = cache.acquire("a", build("a"))
    assert cache.acquire("a", build("a2")) is a
    cache.release(a)
    cache.release(a)
    b = cache.acquire("b", build("b"))
    cache.release(b)
    assert cache.acquire("a") is a  # a is now the most recent
    cache.release(a)
    c = cache.acquire("c", build("c"))
    cache.release(c)
    assert b.closed and b.close_calls == 1
    assert not a.closed and not c.closed
    assert cache.acquire("b") is None  # gone; without build nothing is built


def test_in_use_plan_is_evicted_but_closed_by_its_last_user():
    cache = PlanCache(1)
    a = cache.acquire("a", build("a"))
    a2 = cache.acquire("a")  # two calls in flight
    assert a2 is a
    b = cache.acquire("b", build("b"))  # evicts a, which is in use
    assert not a.closed
    assert not cache.reacquire(a)  # the fast path must not pick up an evicted plan
    cache.release(a)
    assert not a.closed
    cache.release(a)
    assert a.closed and a.close_calls == 1
    cache.release(b)
    assert not b.closed


def test_clear_closes_idle_plans_and_defers_in_use_ones():
    cache = PlanCache(4)
    idle = cache.acquire("idle", build("idle"))
    cache.release(idle)
    busy = cache.acquire("busy", build("busy"))
    cache.clear()
    assert idle.closed
    assert not busy.closed
    assert len(cache) == 0
    cache.release(busy)
    assert busy.closed


def test_racing_builds_keep_the_first_and_close_the_duplicate():
    cache = PlanCache(4)
    inner = []

    def outer_build():  # another thread builds and inserts the same key meanwhile
        inner.append(cache.acquire("k", build("first")))
        return FakePlan("duplicate")

    got = cache.acquire("k", outer_build)
    assert got is inner[0] and got.name == "first"
    assert got._users == 2
    assert not got.closed
    cache.release(got)
    cache.release(got)
    assert not got.closed  # still cached


def test_pinned_plans_survive_eviction_and_clear_until_released():
    cache = PlanCache(2)
    a = cache.acquire("a", build("a"))
    _plan_cache.pin(a)  # captured into a graph during this call
    cache.release(a)
    others = []
    for i in range(5):  # churn more plans than the cache holds
        p = cache.acquire(f"o{i}", build(f"o{i}"))
        cache.release(p)
        others.append(p)
    assert not a.closed
    assert cache.acquire("a") is a  # still serves calls (a second capture, replays)
    cache.release(a)
    assert [p.closed for p in others] == [True, True, True, False, False]
    cache.clear()
    assert not a.closed and all(p.closed for p in others)
    assert cache.acquire("a") is a
    cache.release(a)
    assert _plan_cache.release_captured_plans() == 1
    assert not a.closed  # unpinned, within the cache size: kept
    cache.clear()
    assert a.closed


def test_release_of_pins_closes_what_is_beyond_the_cache_size():
    cache = PlanCache(1)
    pinned = []
    for i in range(3):
        p = cache.acquire(i, build(str(i)))
        _plan_cache.pin(p)
        cache.release(p)
        pinned.append(p)
    assert not any(p.closed for p in pinned)
    assert _plan_cache.release_captured_plans() == 3
    assert [p.closed for p in pinned] == [True, True, False]  # the newest stays as the one cached plan


def test_pinned_while_evicted_in_use_is_kept_until_released():
    cache = PlanCache(1)
    a = cache.acquire("a", build("a"))
    b = cache.acquire("b", build("b"))  # evicts a while a call is in it
    cache.release(b)
    _plan_cache.pin(a)  # that call was being captured
    cache.release(a)
    assert not a.closed
    assert _plan_cache.release_captured_plans() == 1
    assert a.closed


def test_close_failure_during_eviction_does_not_leak_the_use_count():
    cache = PlanCache(1)

    class Broken(FakePlan):
        def close(self):
            raise RuntimeError("device lost")

    old = cache.acquire("old", lambda: Broken("old"))
    cache.release(old)
    with pytest.raises(RuntimeError, match="device lost"):
        cache.acquire("new", build("new"))
    new = cache.acquire("new")
    assert new is not None and new._users == 1  # the failed acquire released its count
    cache.release(new)


def test_two_threads_never_see_a_plan_closed_under_a_call():
    import sys

    cache = PlanCache(2)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as often as possible
    errors = []

    def work(keys):
        try:
            for i in range(3000):
                key = keys[i % len(keys)]
                plan = cache.acquire(key, build(key))
                try:
                    plan.use()
                finally:
                    cache.release(plan)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(["fixed"],)),
               threading.Thread(target=work, args=([f"s{i}" for i in range(8)],))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


def _cpu_args(seed=0):
    inputs = W.make_inputs((16,), 8, 32, xp=numpy, seed=seed)
    return [inputs[n] for n in W.INPUT_NAMES], inputs


def test_closed_cpu_plan_raises():
    args, inputs = _cpu_args()
    plan = cupyffn.GeluFFNBackward(16, 8, 32, device="cpu", precision="ieee")
    grads = plan(*args)
    ref = W.reference(inputs, xp=numpy)
    assert W.relative_l2(grads[1], ref[1], xp=numpy) <= 1e-5
    plan.close()
    plan.close()  # idempotent
    with pytest.raises(RuntimeError, match="this GeluFFNBackward plan was closed"):
        plan(*args)


def test_pinned_plan_refuses_close_until_released():
    args, _ = _cpu_args(1)
    plan = cupyffn.GeluFFNBackward(16, 8, 32, device="cpu")
    _plan_cache.pin(plan)
    with pytest.raises(RuntimeError, match="release_captured_plans"):
        plan.close()
    plan(*args)  # still usable
    assert cupyffn.release_captured_plans() == 1
    plan.close()
    with pytest.raises(RuntimeError, match="was closed"):
        plan(*args)


def test_failed_nan_fill_is_reported_on_the_error(monkeypatch):
    original = ValueError("the call failed")
    assert _plan_cache.fill_nan_after_failure(original, lambda: None) is original
    assert not getattr(original, "__notes__", None)

    def broken_fill():
        raise RuntimeError("sticky CUDA error")

    error = ValueError("the call failed")
    got = _plan_cache.fill_nan_after_failure(error, broken_fill)
    assert got is error
    assert any("filling out= with NaN after this error also failed" in n and "sticky CUDA error" in n
               for n in error.__notes__)
    # Pythons without add_note (3.9, 3.10): a RuntimeError that says so, caused by the original
    monkeypatch.setattr(_plan_cache, "sys", types.SimpleNamespace(version_info=(3, 10)))
    error = ValueError("the call failed")
    got = _plan_cache.fill_nan_after_failure(error, broken_fill)
    assert isinstance(got, RuntimeError) and got.__cause__ is error
    assert "the call failed" in str(got) and "out= may hold stale or partial values" in str(got)


def test_legacy_streams_are_never_queried():
    # 0 (CuPy's null stream) and 1 (cudaStreamLegacy) cannot capture: answered without a CUDA call
    assert _plan_cache.is_capturing(0) is False
    assert _plan_cache.is_capturing(1) is False


def test_release_captured_plans_is_exported():
    assert "release_captured_plans" in cupyffn.__all__
    assert cupyffn.release_captured_plans() == 0
