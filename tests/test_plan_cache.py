"""Plan lifetime without a GPU: EngineCache in-use counts, eviction, pins, clear(); closed and pinned
CPU plans; the failure note when the NaN fill fails; the capture query's legacy-stream shortcut; and
the GPU call's control flow (ordering, events, pins, side stream, failures) with a logging fake engine."""

import threading
import types

import numpy
import pytest

import cupyffn
from cupyffn import workloads as W
from cupyffn.api import backward_plan, execute, routes, validate
from cupyffn.core import plans as _plans
from cupyffn.core.plans import EngineCache
from cupyffn.cuda.stream_engine import StreamEngine


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
    _plans.release_captured_plans()


def build(name):
    return lambda: FakePlan(name)


def test_acquire_builds_once_and_evicts_least_recently_used():
    cache = EngineCache(2)
    a = cache.acquire("a", build("a"))
    assert cache.acquire("a", build("a2")) is a
    cache.release(a)
    cache.release(a)
    b = cache.acquire("b", build("b"))
    cache.release(b)
    assert cache.acquire("a") is a  # a is now the most recent
    cache.release(a)
    assert cache.plans() == [b, a]
    c = cache.acquire("c", build("c"))
    cache.release(c)
    assert b.closed and b.close_calls == 1
    assert not a.closed and not c.closed
    assert cache.acquire("b") is None  # gone; without build nothing is built


def test_in_use_plan_is_evicted_but_closed_by_its_last_user():
    cache = EngineCache(1)
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
    cache = EngineCache(4)
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
    cache = EngineCache(4)
    inner = []

    def outer_build():  # another thread builds and inserts the same key meanwhile
        inner.append(cache.acquire("k", build("first")))
        return FakePlan("duplicate")

    got = cache.acquire("k", outer_build)
    assert got is inner[0] and got.name == "first"
    assert not got.closed and cache.plans() == [got]
    cache.release(got)
    cache.clear()  # unlinked while a call is still in it
    assert not got.closed
    cache.release(got)  # the second user (two acquires, one plan): the last
    assert got.closed


def test_pinned_plans_survive_eviction_and_clear_until_released():
    cache = EngineCache(2)
    a = cache.acquire("a", build("a"))
    _plans.pin(a)  # captured into a graph during this call
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
    assert _plans.release_captured_plans() == 1
    assert not a.closed  # unpinned, within the cache size: kept
    cache.clear()
    assert a.closed


def test_release_of_pins_closes_what_is_beyond_the_cache_size():
    cache = EngineCache(1)
    pinned = []
    for i in range(3):
        p = cache.acquire(i, build(str(i)))
        _plans.pin(p)
        cache.release(p)
        pinned.append(p)
    assert not any(p.closed for p in pinned)
    assert _plans.release_captured_plans() == 3
    assert [p.closed for p in pinned] == [True, True, False]  # the newest stays as the one cached plan


def test_pinned_while_evicted_in_use_is_kept_until_released():
    cache = EngineCache(1)
    a = cache.acquire("a", build("a"))
    b = cache.acquire("b", build("b"))  # evicts a while a call is in it
    cache.release(b)
    _plans.pin(a)  # that call was being captured
    cache.release(a)
    assert not a.closed
    assert _plans.release_captured_plans() == 1
    assert a.closed


def test_close_failure_during_eviction_does_not_leak_the_use_count():
    cache = EngineCache(1)

    class Broken(FakePlan):
        def close(self):
            raise RuntimeError("device lost")

    old = cache.acquire("old", lambda: Broken("old"))
    cache.release(old)
    with pytest.raises(RuntimeError, match="device lost"):
        cache.acquire("new", build("new"))
    new = cache.acquire("new")
    assert new is not None
    cache.release(new)
    cache.clear()
    assert new.closed  # no user left: the failed acquire released its count


def test_two_threads_never_see_a_plan_closed_under_a_call():
    import sys

    cache = EngineCache(2)
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
    _plans.pin(plan)
    with pytest.raises(RuntimeError, match="release_captured_plans"):
        plan.close()
    plan(*args)  # still usable
    assert cupyffn.release_captured_plans() == 1
    plan.close()
    with pytest.raises(RuntimeError, match="was closed"):
        plan(*args)


def test_failed_nan_fill_is_reported_on_the_error(monkeypatch):
    original = ValueError("the call failed")
    assert _plans.fill_nan_after_failure(original, lambda: None) is original
    assert not getattr(original, "__notes__", None)

    def broken_fill():
        raise RuntimeError("sticky CUDA error")

    error = ValueError("the call failed")
    got = _plans.fill_nan_after_failure(error, broken_fill)
    assert got is error
    assert any("filling out= with NaN after this error also failed" in n and "sticky CUDA error" in n
               for n in error.__notes__)
    # Pythons without add_note (3.9, 3.10): a RuntimeError that says so, caused by the original
    monkeypatch.setattr(_plans, "sys", types.SimpleNamespace(version_info=(3, 10)))
    error = ValueError("the call failed")
    got = _plans.fill_nan_after_failure(error, broken_fill)
    assert isinstance(got, RuntimeError) and got.__cause__ is error
    assert "the call failed" in str(got) and "out= may hold stale or partial values" in str(got)


def test_legacy_streams_are_never_queried():
    # 0 (CuPy's null stream) and 1 (cudaStreamLegacy) cannot capture: answered without a CUDA call
    assert _plans.is_capturing(0) is False
    assert _plans.is_capturing(1) is False


def test_release_captured_plans_is_exported():
    assert "release_captured_plans" in cupyffn.__all__
    assert cupyffn.release_captured_plans() == 0


# ---------------------------------------------------------------------- the GPU call's control flow
class FakeEngine(StreamEngine):
    """Stands in for a GPU engine (cupyffn/cuda/stream_engine.py is its real base, so the capture bookkeeping and the
    binding are the product's): logs the ordering, binding, launch and event calls the executor makes."""

    what = "GeluFFNBackward plan"
    side = object()  # an engine with a side stream

    def __init__(self, call_graph=False):  # no CUDA: the base's event is not made
        import threading

        self.log = []
        self.lock = threading.Lock()
        self.closed = False
        self.side_in_capture = False
        self.side_capture_stream = 0
        self.side_busy = False  # the side stream still in a caller's capture
        self.fail = None
        self.call_graph = call_graph  # GpuEngine.call_graph: eager calls as one re-pointed graph launch
        self._graph_caches = {}
        self.device_id = 0
        self._io = None

    def io_key(self, call, outputs):
        return call.inputs, outputs.pointers

    def bind(self, call, outputs):
        self.log.append(("bind",))

    def enqueue(self, sp, serial=False, ready=0):
        if self.fail is not None:
            raise self.fail
        self.log.append(("enqueue", sp, serial))

    def eager(self, sp, ready=0):
        if self.call_graph and not ready:
            if self.fail is not None:
                raise self.fail
            self.log.append(("graph", sp))
        else:
            self.enqueue(sp, ready=ready)

    def order_after_previous(self, sp):
        self.log.append(("order", sp))

    def record_done(self, sp):
        self.log.append(("done", sp))

    def side_stream_free(self):
        if self.side_busy:
            return False
        self.side_in_capture = False
        return True

    def close(self):
        self.log.append(("close",))


class FakeStream:
    def __init__(self, ptr):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Harness:
    """A validated call (NumPy arrays standing for device 0's) and its route, run by the product's executor on a
    FakeEngine (the route's engine, built by its plan cache)."""

    def __init__(self, engine, call, out, graphs=routes.EAGER):
        self.engine, self.call, self.out = engine, call, out
        self.route = routes.Route(routes.FLOAT32, graphs, ("harness", id(engine)), lambda key: engine)
        cache = execute.engine_cache(routes.FLOAT32, call.kind)  # built, as by a call outside any capture
        cache.release(cache.acquire(self.route.key, lambda: engine))

    @property
    def graphs(self):
        """The engine's GraphCache under the route's policy."""
        return self.engine.graph_cache(self.route.graphs)

    def run(self, ptr, ready=0, call=None, out=None):
        return execute.run((call or self.call)._replace(ready=ready), self.route, out or self.out, FakeStream(ptr))


def _gpu_call(seed, out):
    call = validate.validate(validate.Request("backward", "tf32"), _cpu_args(seed)[0], out)
    return call._replace(backend="gpu", device=0)


@pytest.fixture
def gpu_like(monkeypatch):
    """A FakeEngine on "device 0", a call on it with every output given, and a set of capturing streams."""
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    capturing = set()
    monkeypatch.setattr(_plans, "_stream_is_capturing", lambda ptr: ptr in capturing)
    out = [numpy.zeros((16, 8), numpy.float32), numpy.zeros((32, 8), numpy.float32),
           numpy.zeros((8, 32), numpy.float32)]
    engine = FakeEngine()
    yield Harness(engine, _gpu_call(2, out), out), capturing
    _plans.release_captured_plans()
    execute.clear_engines()


def _with_call_graph(h, monkeypatch=None, replay=None):
    """The harness's engine as a call-graph plan's, on the route the table gives it (graphs per repeated set of
    arrays), with `replay` standing for the capture."""
    h.engine.call_graph = True
    h.route = h.route._replace(graphs=routes.REPEATED)
    if replay is not None:
        monkeypatch.setattr(h.graphs, "_capture", replay)
    return h


def test_a_second_open_capture_keeps_to_its_own_stream(gpu_like):
    """Two captures open at once (streams 9 and 11) of one engine: the first takes the side stream, the
    second runs everything on its own stream (joining the first capture's side stream would break both);
    further calls in the first capture use the side stream again; once it has ended, so may the next one."""
    h, capturing = gpu_like
    engine = h.engine
    h.run(7)  # warm-up
    engine.log.clear()
    capturing.update({9, 11})
    h.run(9)
    engine.side_busy = True  # the side stream joined capture 9
    h.run(11)
    h.run(9)
    assert engine.log == [("enqueue", 9, False), ("enqueue", 11, True), ("enqueue", 9, False)]
    assert engine.side_capture_stream == 9
    engine.side_busy = False  # capture 9 ended
    capturing.discard(9)
    engine.log.clear()
    h.run(11)
    assert engine.log == [("enqueue", 11, False)] and engine.side_capture_stream == 11
    assert cupyffn.release_captured_plans() == 1


def test_eager_call_orders_after_the_previous_and_records_done(gpu_like):
    h, _ = gpu_like
    grads = h.run(7)
    assert all(g is o for g, o in zip(grads, h.out))
    assert h.engine.log == [("order", 7), ("bind",), ("enqueue", 7, False), ("done", 7)]
    h.engine.log.clear()
    h.run(7)  # the same arrays: the launches stay bound
    assert h.engine.log == [("order", 7), ("enqueue", 7, False), ("done", 7)]
    assert not _plans.is_pinned(h.engine)


def test_eager_calls_take_the_call_graph_where_the_engine_has_one(gpu_like, monkeypatch):
    """An eager call launches the engine's call graph; a call under a caller's capture, one while that capture
    holds the side stream, and one asking for grad_hidden_ready enqueue launch by launch (the graph records no
    event for the caller, and a capture must capture the launches themselves)."""
    h, capturing = gpu_like
    engine = _with_call_graph(h).engine
    h.run(7)
    assert engine.log == [("order", 7), ("bind",), ("graph", 7), ("done", 7)]
    engine.log.clear()
    h.run(7, ready=1234)
    assert engine.log == [("order", 7), ("enqueue", 7, False), ("done", 7)]
    engine.log.clear()
    capturing.add(9)
    h.run(9)
    engine.side_busy = True
    h.run(7)
    assert engine.log == [("enqueue", 9, False), ("order", 7), ("enqueue", 7, True), ("done", 7)]
    engine.side_busy = False
    engine.log.clear()
    engine.destroy_graphs()  # forget the sighting above
    h.run(7)
    assert engine.log == [("order", 7), ("graph", 7), ("done", 7)]
    engine.fail = ValueError("injected")  # a failed graph launch: done recorded, out= NaN
    engine.destroy_graphs()
    with pytest.raises(ValueError, match="injected"):
        h.run(7)
    assert engine.log[-1] == ("done", 7) and all(numpy.isnan(o).all() for o in h.out)
    assert cupyffn.release_captured_plans() == 1


def test_call_graph_plans_replay_a_graph_per_repeated_set_of_arrays(gpu_like, monkeypatch):
    """With a call graph, the first call with a set of arrays re-points the graph (bind, the call graph), the
    second captures a graph of its own (the engine's launches enqueued into the capture), later ones launch that
    graph with nothing bound or re-pointed, even after another set of arrays came in between; a call asking for
    grad_hidden_ready keeps the launch-by-launch route (decision 052)."""
    h, _ = gpu_like
    engine = h.engine

    class Graph:
        def launch(self, stream_ptr):
            engine.log.append(("replay", stream_ptr))

        def destroy(self):
            engine.log.append(("destroy",))

    def capture(issue, stream_ptr):  # GraphCache._capture on its private stream (99)
        issue(99, True)
        h.graphs.captures += 1
        return Graph()

    _with_call_graph(h, monkeypatch, capture)
    for _ in range(3):
        h.run(7)
    assert engine.log == [("order", 7), ("bind",), ("graph", 7), ("done", 7),
                          ("order", 7), ("enqueue", 99, False), ("replay", 7), ("done", 7),
                          ("order", 7), ("replay", 7), ("done", 7)]
    assert (h.graphs.captures, h.graphs.launches) == (1, 2)
    other = [o.copy() for o in h.out]
    call2 = _gpu_call(2, other)
    engine.log.clear()
    h.run(7, call=call2, out=other)
    h.run(7)
    h.run(7, ready=1234)
    assert engine.log == [("order", 7), ("bind",), ("graph", 7), ("done", 7),
                          ("order", 7), ("replay", 7), ("done", 7),
                          ("order", 7), ("bind",), ("enqueue", 7, False), ("done", 7)]
    graphs = h.graphs
    engine.destroy_graphs()
    assert engine.log[-1] == ("destroy",) and graphs._graphs == {} and h.graphs is not graphs


def test_captured_call_pins_and_uses_no_event_from_outside(gpu_like):
    h, capturing = gpu_like
    engine = h.engine
    h.run(7)  # warm-up
    engine.log.clear()
    capturing.add(9)
    h.run(9)
    assert engine.log == [("enqueue", 9, False)]  # no order_after_previous wait, no done record
    assert _plans.is_pinned(engine) and engine.side_in_capture
    # an eager call while that capture still holds the side stream: everything on its own stream
    engine.log.clear()
    engine.side_busy = True
    h.run(7)
    assert engine.log == [("order", 7), ("enqueue", 7, True), ("done", 7)]
    engine.side_busy = False  # the caller ended the capture
    engine.log.clear()
    h.run(7)
    assert engine.log == [("order", 7), ("enqueue", 7, False), ("done", 7)] and not engine.side_in_capture
    assert cupyffn.release_captured_plans() == 1
    engine.closed = True
    with pytest.raises(RuntimeError, match="this GeluFFNBackward plan was closed"):
        h.run(7)


def test_captured_call_without_out_raises_before_anything(gpu_like):
    h, capturing = gpu_like
    capturing.add(9)
    partial = [h.out[0], None, None]
    call = _gpu_call(2, partial)
    with pytest.raises(RuntimeError, match="without out= for grad_weight1, grad_weight2: allocating from CuPy"):
        h.run(9, call=call, out=partial)
    assert h.engine.log == [] and not _plans.is_pinned(h.engine)


def test_failed_eager_call_records_done_and_fills_nan(gpu_like):
    h, _ = gpu_like
    h.engine.fail = ValueError("injected")
    with pytest.raises(ValueError, match="injected") as info:
        h.run(7)
    assert h.engine.log[-1] == ("done", 7)  # close() must wait for the partial work too
    assert all(numpy.isnan(o).all() for o in h.out)
    assert not getattr(info.value, "__notes__", None)


def test_failed_nan_fill_after_a_failed_call_is_reported(gpu_like, monkeypatch):
    h, _ = gpu_like

    def broken(call, stream):
        raise RuntimeError("sticky CUDA error")

    monkeypatch.setattr(execute, "_poison", broken)
    h.engine.fail = ValueError("injected")
    with pytest.raises(ValueError, match="injected") as info:
        h.run(7)
    assert any("out= may hold stale or partial values" in n for n in info.value.__notes__)


def test_failed_call_during_capture_fills_nothing(gpu_like):
    h, capturing = gpu_like
    capturing.add(9)
    h.engine.fail = ValueError("injected")
    with pytest.raises(ValueError, match="injected"):
        h.run(9)
    assert h.engine.log == [("bind",)]  # no NaN fill (it would be captured), no events
    assert not any(numpy.isnan(o).any() for o in h.out)


def test_profile_stages_refuses_a_plan_closed_meanwhile(monkeypatch):
    """Another thread may close the plan between the stage profile's ordinary call and its serialized reps
    (benchmarks/stages.py; close() frees the scratch once it has the lock): the reps must then raise, not enqueue."""
    pytest.importorskip("cupy")
    from benchmarks import stages
    plan = cupyffn.GeluFFNBackward(16, 8, 32, device="cpu")
    engine = FakeEngine()
    plan.engine = engine

    def ordinary_call_then_closed(*args, **kwargs):
        engine.closed = True

    monkeypatch.setattr(stages.functional, "run", ordinary_call_then_closed)
    args, _ = _cpu_args(0)
    with pytest.raises(RuntimeError, match="this GeluFFNBackward plan was closed"):
        stages.profile(plan, *args, out=[numpy.zeros(1)] * 3, stream=FakeStream(7), reps=1)
    assert engine.log == []  # nothing was enqueued on the closed engine


def test_graph_plans_bind_before_their_capture(gpu_like, monkeypatch):
    """A graph=True plan captures at a set of arrays' first call: the launches are bound (which may allocate on
    first use, refused inside a capture) before the capture begins, and the capture only enqueues."""
    h, _ = gpu_like
    engine = h.engine
    h.route = h.route._replace(graphs=routes.GRAPH_PLAN)

    class Graph:
        def launch(self, stream_ptr):
            engine.log.append(("replay", stream_ptr))

        def destroy(self):
            pass

    def capture(issue, stream_ptr):
        engine.log.append(("begin capture",))
        issue(99, True)
        engine.log.append(("end capture",))
        h.graphs.captures += 1
        return Graph()

    monkeypatch.setattr(h.graphs, "_capture", capture)
    h.run(7)
    h.run(7)
    assert engine.log == [("order", 7), ("bind",), ("begin capture",), ("enqueue", 99, False), ("end capture",),
                          ("replay", 7), ("done", 7), ("order", 7), ("replay", 7), ("done", 7)]


def test_a_plans_captured_call_pins_the_plan(gpu_like):
    """Under a caller's capture a plan's call pins the plan (it holds the engine and the outputs it owns), so the
    plan stays alive and closed-proof until release_captured_plans(); the functions' engines are pinned themselves."""
    h, capturing = gpu_like
    owner = cupyffn.GeluFFNBackward(16, 8, 32, device="cpu")
    owner.engine = h.engine  # the plan's own engine (a CPU plan has none)
    capturing.add(9)
    execute.run(h.call, h.route, h.out, FakeStream(9), plan=owner)
    owner.engine = None
    assert _plans.is_pinned(owner) and not _plans.is_pinned(h.engine)
    with pytest.raises(RuntimeError, match="pinned"):
        owner.close()
    assert cupyffn.release_captured_plans() == 1
    owner.close()
