"""Tensor parallelism: the rank/world object, process-group setup and the `--tp N` launcher.

`TensorParallel` (group.py) is the one object that says which rank this process is, how many
there are and which process groups reach them; it is passed explicitly to every layer that
communicates. setup.py creates the groups, launch.py starts one process per rank, nodes.py places
the ranks on hosts. The package itself imports no torch (the re-exports below load on first use),
so building the command line's parser, which reads nodes.py's flags, stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TensorParallel", "current_tensor_parallel", "use_tensor_parallel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from snugkv.distributed import group

        return getattr(group, name)
    raise AttributeError(f"module 'snugkv.distributed' has no attribute {name!r}")
