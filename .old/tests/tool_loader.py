"""A script of dev/ loaded as a module for a CPU test, with cupy made unimportable while it loads: a tool
must not need cupy (or a GPU) at import, only when it runs."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "dev"


def load_tool(name):
    """dev/`name`.py as a module (its top level run with `import cupy` raising ImportError)."""
    if str(ROOT) not in sys.path:  # as the tools run: PYTHONPATH=. (benchmarks/timing.py, cupyffn)
        sys.path.append(str(ROOT))
    if str(TOOLS) not in sys.path:  # as when the script runs: its folder first (dev/_json_out.py)
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("cupy", "absent")
    sys.modules["cupy"] = None  # importing cupy now raises
    try:
        spec.loader.exec_module(module)
    finally:
        if saved == "absent":
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved
    return module
