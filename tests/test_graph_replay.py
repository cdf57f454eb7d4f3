"""The one graph cache (cupyffn/cuda/graph_cache.py) without a GPU: under each policy of the route table
(cupyffn/api/routes.py), which calls run eagerly, which are captured, which are launched, and what is kept (the
capture is a stand-in)."""

import pytest

from cupyffn.api import routes
from cupyffn.cuda import graph_cache as R


class FakeGraph:
    def __init__(self, log, key):
        self.log, self.key, self.destroyed = log, key, False

    def launch(self, stream_ptr):
        self.log.append(("launch", self.key, stream_ptr))

    def destroy(self):
        self.destroyed = True


def cache(monkeypatch, policy):
    log = []
    c = R.GraphCache(policy, device_id=0)
    graphs = []

    def capture(issue, stream_ptr):
        issue(99, True)  # the capture stream
        graphs.append(FakeGraph(log, len(graphs)))
        c.captures += 1
        return graphs[-1]

    monkeypatch.setattr(c, "_capture", capture)
    return c, log, graphs


def test_a_set_of_arrays_is_captured_the_second_time_and_launched_after(monkeypatch):
    c, log, graphs = cache(monkeypatch, routes.REPEATED)

    def issue(stream_ptr, captured):
        log.append(("issue", stream_ptr, captured))

    c.run(("a",), issue, 7)
    assert log == [("issue", 7, False)] and c.captures == 0  # seen once: eager, nothing kept
    log.clear()
    c.run(("a",), issue, 7)
    assert log == [("issue", 99, True), ("launch", 0, 7)]  # captured on the capture stream, launched on the caller's
    log.clear()
    c.run(("a",), issue, 8)
    assert log == [("launch", 0, 8)] and c.captures == 1 and c.launches == 2


def test_graph_plans_capture_at_the_first_sighting(monkeypatch):
    c, log, graphs = cache(monkeypatch, routes.GRAPH_PLAN)
    c.run(("a",), lambda s, captured: log.append(("issue", s, captured)), 7)
    assert log == [("issue", 99, True), ("launch", 0, 7)]


@pytest.mark.parametrize("policy", [routes.REPEATED, routes.GRAPH_PLAN], ids=lambda p: p.name)
def test_graphs_are_kept_least_recently_used_first_out(monkeypatch, policy):
    c, log, graphs = cache(monkeypatch, policy)
    for key in range(policy.keep + 1):
        for _ in range(policy.capture_after):
            c.run((key,), lambda s, captured: None, 7)
    assert c.captures == policy.keep + 1 and graphs[0].destroyed and not any(g.destroyed for g in graphs[1:])
    c.run((1,), lambda s, captured: None, 7)  # the oldest kept: launched, and now the most recently used
    assert c.launches == policy.keep + 2 and c.captures == policy.keep + 1  # each capture is launched too
    c.destroy()
    assert all(g.destroyed for g in graphs)


def test_remembered_sightings_are_bounded(monkeypatch):
    c, log, graphs = cache(monkeypatch, routes.REPEATED)
    bound = 8 * routes.REPEATED.keep
    for key in range(bound + 1):
        c.run((key,), lambda s, captured: None, 7)
    assert len(c._seen) == 1  # cleared when full: a set seen long ago counts as new
    c.run((0,), lambda s, captured: None, 7)
    assert c.captures == 0


def test_the_eager_policy_has_no_cache():
    with pytest.raises(ValueError, match="capture_after >= 1"):
        R.GraphCache(routes.EAGER, device_id=0)


def test_a_thrashing_cycle_stops_capturing(monkeypatch):
    """More sets of arrays cycling than REPEATED keeps (a deep model's layers of one shape): once `keep` graphs
    were dropped, no more captures (each would be dropped before its next use); kept graphs still launch.
    GRAPH_PLAN (graph=True: the caller asked for graphs) keeps capturing."""
    c, log, graphs = cache(monkeypatch, routes.REPEATED)
    keep = routes.REPEATED.keep
    keys = range(2 * keep)
    for _ in range(2):
        for key in keys:
            c.run((key,), lambda s, captured: None, 7)
    assert c.evictions == keep and c.thrashing
    captured, launches = c.captures, c.launches
    for _ in range(2):
        for key in keys:
            c.run((key,), lambda s, captured: None, 7)
    assert c.captures == captured  # eager from now on,
    assert c.launches == launches + 2 * keep  # but for the graphs kept
    plan, _, _ = cache(monkeypatch, routes.GRAPH_PLAN)
    for _ in range(3):
        for key in range(2 * routes.GRAPH_PLAN.keep):
            plan.run((key,), lambda s, captured: None, 7)
    assert not plan.thrashing and plan.captures == 6 * routes.GRAPH_PLAN.keep
