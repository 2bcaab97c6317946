"""Tensor parallelism: the rank/world object, process-group setup and the `--tp N` launcher.

`TensorParallel` (group.py) is the one object that says which rank this process is, how many
there are and which process groups reach them; it is passed explicitly to every layer that
communicates. setup.py creates the groups, launch.py starts one process per rank.
"""

from snugkv.distributed.group import TensorParallel, current_tensor_parallel, use_tensor_parallel

__all__ = ["TensorParallel", "current_tensor_parallel", "use_tensor_parallel"]
