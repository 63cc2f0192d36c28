"""examples/zero_code.py (no profiler code) behind an import hook of its own, ahead of every other in
sys.meta_path, that finds torch itself, so torch is imported past zero-code's finder:
`python zerocode_past_hook.py ARGS...` (zero_code.py's arguments)."""

from __future__ import annotations

import importlib.machinery
import runpy
import sys
from pathlib import Path


class VendorFinder:
    """What an instrumenting or vendoring import hook does: locate some modules itself."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name == "torch":
            return importlib.machinery.PathFinder.find_spec(name, path, target)
        return None


sys.meta_path.insert(0, VendorFinder())
example = Path(__file__).resolve().parents[2] / "examples" / "zero_code.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
