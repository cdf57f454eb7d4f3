"""cupyffn/_graph_replay.py without a GPU: which calls run eagerly, which are captured, which are launched, and what
is kept (the runtime's event calls and the capture are stand-ins)."""

import types

from cupyffn.cuda import graph_cache as R


class FakeGraph:
    def __init__(self, log, key):
        self.log, self.key, self.destroyed = log, key, False

    def launch(self, stream_ptr):
        self.log.append(("launch", self.key, stream_ptr))

    def destroy(self):
        self.destroyed = True


def replay(monkeypatch):
    log = []
    runtime = types.SimpleNamespace(streamWaitEvent=lambda s, e, f: log.append(("wait", s, e)),
                                    eventRecord=lambda e, s: log.append(("record", e, s)))
    monkeypatch.setattr(R, "_runtime", lambda: runtime)
    r = R.GraphReplay()
    graphs = []

    def capture(enqueue, stream_ptr):
        enqueue(99, True)  # the capture stream
        graphs.append(FakeGraph(log, len(graphs)))
        r.captures += 1
        return graphs[-1]

    monkeypatch.setattr(r, "_capture", capture)
    return r, log, graphs


def test_a_pointer_set_is_captured_the_second_time_and_launched_after(monkeypatch):
    r, log, graphs = replay(monkeypatch)

    def enqueue(stream_ptr, capturing):
        log.append(("enqueue", stream_ptr, capturing))

    r.run(("a",), enqueue, 7, 5)
    assert log == [("enqueue", 7, False)] and r.captures == 0  # seen once: eager, nothing kept
    log.clear()
    r.run(("a",), enqueue, 7, 5)
    # captured on the capture stream, then launched on the caller's, ordered like an eager call
    assert log == [("enqueue", 99, True), ("wait", 7, 5), ("launch", 0, 7), ("record", 5, 7)]
    log.clear()
    r.run(("a",), enqueue, 8, 5)
    assert log == [("wait", 8, 5), ("launch", 0, 8), ("record", 5, 8)] and r.captures == 1 and r.launches == 2


def test_graphs_are_kept_least_recently_used_first_out(monkeypatch):
    r, log, graphs = replay(monkeypatch)
    for key in range(R.KEEP + 1):
        for _ in range(2):
            r.run((key,), lambda s, c: None, 7, 5)
    assert r.captures == R.KEEP + 1 and graphs[0].destroyed and not any(g.destroyed for g in graphs[1:])
    r.destroy()
    assert all(g.destroyed for g in graphs)


def test_remembered_pointer_sets_are_bounded(monkeypatch):
    r, log, graphs = replay(monkeypatch)
    for key in range(R.SEEN + 1):
        r.run((key,), lambda s, c: None, 7, 5)
    assert len(r._seen) == 1  # cleared when full: a set seen long ago counts as new
    r.run((0,), lambda s, c: None, 7, 5)
    assert r.captures == 0
