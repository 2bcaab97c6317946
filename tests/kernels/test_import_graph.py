"""snugkv.kernels sits at the bottom of the import graph: torch and triton, nothing else of snugkv."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import snugkv.kernels

PACKAGE_DIR = Path(snugkv.kernels.__file__).parent
ALLOWED_ROOTS = {"__future__", "functools", "math", "torch", "triton"}


def test_kernel_modules_import_only_torch_triton_and_each_other():
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in ALLOWED_ROOTS or name.startswith("snugkv.kernels"), (
                    f"{path.name} imports {name}"
                )


def test_importing_the_package_loads_no_other_snugkv_module():
    code = "import sys, snugkv.kernels; print(sorted(m for m in sys.modules if m.startswith('snugkv')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = ast.literal_eval(loaded.strip())
    assert all(m == "snugkv" or m.startswith("snugkv.kernels") for m in modules), modules
