"""Following one argument through the door (issue 49's measure of how the call flow doubles back).

`trace(fn, carries)` runs `fn()` under sys.setprofile and keeps the calls into cupyffn's own files whose arguments
carry the followed value (`carries(obj)` says whether one does; tuples, lists, dicts and NamedTuples such as a Call
are looked into, two levels deep). A step is such a call made from another file (entering a file); calls within one
file are not steps. A step doubles back when it returns to a stage already passed: it enters a file that the flow
had entered before it entered the calling file (execute.py calling into validate.py, say). Entering a file below the
caller again (validate.py calling core/arrays.py for each argument) goes on downward and is not doubling back."""

import collections
import os
import sys
from typing import Any, Counter, List, NamedTuple

import cupyffn

ROOT = os.path.dirname(cupyffn.__file__)


def _holds(obj, carries, depth=2):
    if carries(obj):
        return True
    if depth == 0:
        return False
    if isinstance(obj, dict):
        obj = tuple(obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_holds(o, carries, depth - 1) for o in obj)
    return False


class Flow(NamedTuple):
    """What `trace` saw: fn()'s result, the files entered in order (relative to cupyffn/), the entries per file, the
    doubled-back steps, and the calls per "file:function" that carried the value (steps or not)."""

    result: Any
    files: List[str]
    entries: Counter
    doubled: int
    functions: Counter


def trace(fn, carries):
    """The Flow of `fn()` following `carries` (module docstring)."""
    entered = []  # (file, caller's file)
    functions = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if not path.startswith(ROOT):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        values = [frame.f_locals.get(n) for n in names if n != "self"]
        if any(_holds(v, carries) for v in values):
            functions[f"{os.path.relpath(path, ROOT)}:{code.co_name}"] += 1
            if path != caller:
                entered.append((os.path.relpath(path, ROOT), os.path.relpath(caller, ROOT)))

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    first, doubled = {}, 0  # file -> the step that first entered it
    for i, (f, caller) in enumerate(entered):
        if f in first and first[f] < first.get(caller, i):
            doubled += 1
        first.setdefault(f, i)
    files = [f for f, _ in entered]
    return Flow(result, files, collections.Counter(files), doubled, functions)
