"""A process that compiles Triton kernels into Triton's file cache, one specialization at a time.

`python -m snugkv.kernels.compile_worker` reads one job per line on stdin (JSON: the kernel's
module and name, the specialization Triton serialized for it, the GPU target) and answers one
line per job on stdout (`{"ok": bool, "seconds": float, "error": str, "torch": bool}`: whether
the real torch got loaded in the worker). It compiles with
`triton.compile`, as a launch would, into the same file cache (the same environment), then the
kernel's launcher where Triton builds one per signature, and never touches a GPU: the engine that
started it finds both there when its warm-up launches the kernel.

Its own imports come first (triton and snugkv's kernel modules), so that a job waits for none.
Not torch: the kernel modules take nothing from torch at import (tests/kernels/test_compile_ahead.py
checks it), and their `import torch` finds a stand-in that imports torch at its first use, which a
compile never makes. Fifteen workers that each loaded torch's CUDA libraries beside the engine's own
imports made those 5.7 s against 3.6 s in one H100 call at bd2368a (docs/bench/startup.md).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import types
from typing import Any

# Modules that define Triton kernels, imported before the first job arrives.
KERNEL_MODULES = (
    "snugkv.attention.triton_common",
    "snugkv.attention.triton_decode",
    "snugkv.attention.triton_extend",
    "snugkv.kernels.activation",
    "snugkv.kernels.dense_gemv",
    "snugkv.kernels.fp8_gemm",
    "snugkv.kernels.fp8_quant",
    "snugkv.kernels.fp8_small_gemm",
    "snugkv.kernels.kv_store",
    "snugkv.kernels.moe_align",
    "snugkv.kernels.moe_direct",
    "snugkv.kernels.moe_experts",
    "snugkv.kernels.moe_routing",
    "snugkv.kernels.norm",
    "snugkv.kernels.rope_store",
    "snugkv.memory.page_copy",
)


class _TorchOnFirstUse(types.ModuleType):
    """`torch` in `sys.modules` until something uses it: then the real one is imported, and every
    later attribute read through this module is the real module's."""

    def __getattr__(self, name: str) -> Any:
        if sys.modules.get("torch") is self:
            del sys.modules["torch"]
        return getattr(importlib.import_module("torch"), name)


def torch_imported() -> bool:
    """Whether the real torch is loaded in this process."""
    return "torch" in sys.modules and not isinstance(sys.modules["torch"], _TorchOnFirstUse)


def jit_function(module: str, name: str) -> Any:
    """The `triton.jit` function `name` of `module` (through any wrapper that keeps it as `.fn`)."""
    from triton.runtime.jit import JITFunction

    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    while not isinstance(found, JITFunction):
        found = found.fn
    return found


def _constant(value: Any) -> Any:
    """A constant as Triton serialized it, back as the launch had it (as `JITFunction.preload` does)."""
    import triton.language as tl
    from triton.runtime.jit import convert_to_tuple_if_list as _tuples

    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(_tuples(value["constexpr"]))
    if isinstance(value, dict) and "jit_function" in value:  # Triton 3.9: a kernel passed as a constant
        module, _, name = value["jit_function"].partition(":")
        return jit_function(module, name)
    return _tuples(value)


def compile_job(job: dict[str, Any]) -> None:
    """Compile one specialization for `job["target"]` (backend, arch, warp size) into the cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list as _tuples

    fn = jit_function(job["module"], job["name"])
    spec = json.loads(job["spec"])
    constexprs = {
        tuple(key): _constant(value) for key, value in zip(spec["constant_keys"], spec["constant_vals"])
    }
    attrs = {tuple(key): value for key, value in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {key: _tuples(value) for key, value in spec["signature"].items()}
    options = {
        key: tuple(value) if isinstance(value, list) else value for key, value in spec["options"].items()
    }
    backend, arch, warp_size = job["target"]
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget(backend, arch, warp_size),
        options=options,
    )
    with contextlib.suppress(Exception):  # the engine's first launch builds it then
        build_launcher(kernel)


def build_launcher(kernel: Any) -> None:
    """The kernel's host-side launcher too, where Triton builds one per signature with the C
    compiler (Triton 3.6 on NVIDIA: `make_launcher`, a module in the same cache), which the engine's
    first launch would otherwise build; Triton 3.9 launches every kernel through one launcher and
    builds none. A launcher that cannot be built here (no libcuda to link) is built at that launch."""
    from triton.backends.nvidia import driver

    if hasattr(driver, "make_launcher") and hasattr(driver, "compile_module_from_src"):
        driver.CudaLauncher(kernel.src, kernel.metadata)


def build_driver_utils() -> None:
    """Triton 3.6's NVIDIA driver module (`cuda_utils`, built once per machine with the C compiler),
    which the engine's first use of Triton's driver would otherwise build."""
    from triton.backends.nvidia import driver

    if hasattr(driver, "make_launcher") and hasattr(driver, "CudaUtils"):
        driver.CudaUtils()


def main() -> None:
    with contextlib.suppress(OSError):  # the engine's own start first, where CPUs are short
        os.nice(10)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what a compile prints stays off the answers
    sys.modules.setdefault("torch", _TorchOnFirstUse("torch"))
    for module in KERNEL_MODULES:
        with contextlib.suppress(ImportError):  # a job for it says why
            importlib.import_module(module)
    if "--driver-utils" in sys.argv[1:]:  # one worker of the pool: the others would race to build it
        with contextlib.suppress(Exception):  # else the engine builds it
            build_driver_utils()
    for line in sys.stdin:
        if not line.strip():
            continue
        started = time.perf_counter()
        try:
            compile_job(json.loads(line))
            answer: dict[str, Any] = {"ok": True}
        except Exception as exc:  # the engine's warm-up compiles this one itself
            answer = {
                "ok": False,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            }
        answer["seconds"] = round(time.perf_counter() - started, 3)
        answer["torch"] = torch_imported()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
