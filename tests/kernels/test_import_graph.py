"""snugkv.kernels sits at the bottom of the import graph: importing it loads nothing else of snugkv
(tests/test_layering.py checks its import statements)."""

from __future__ import annotations

import ast
import subprocess
import sys


def test_importing_the_package_loads_no_other_snugkv_module():
    code = "import sys, snugkv.kernels; print(sorted(m for m in sys.modules if m.startswith('snugkv')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = ast.literal_eval(loaded.strip())
    assert all(m in ("snugkv", "snugkv.version") or m.startswith("snugkv.kernels") for m in modules), modules
