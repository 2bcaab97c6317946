"""Where this process sits when one tensor-parallel group spans several hosts.

Two ways to say it, one placement:
- snugkv's flags, one launch per node: `--nnodes 2 --node-rank R --master-addr HOST0 --master-port P`.
  Each launch starts `tp / nnodes` ranks on its host (itself and helpers, as `--tp` does on one
  host); node R's ranks are R * tp/nnodes onwards, so node 0's first process is rank 0.
- torchrun's environment (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
  `MASTER_PORT`): torchrun started every rank itself, so this process is exactly one of them and
  starts none; the group joins through torchrun's store (`env://`).

Rank 0 (node 0's first process) is the one that serves HTTP or owns the terminal; every other rank,
on any node, follows it step by step. Sizing needs nothing here: it already takes the MIN over the
whole group, whatever host a rank is on. This module reads flags and the environment; it starts
nothing and joins no group.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_MASTER_PORT = 29500


class NodePlacementError(ValueError):
    """Node flags that do not describe one group (the message names the flag to change)."""


@dataclass(frozen=True, slots=True)
class NodePlacement:
    """This launch's share of a group of `world_size` ranks over `nnodes` hosts."""

    world_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    first_rank: int = 0  # the global rank of the process this launch runs in
    local_ranks: int = 1  # ranks on this host, this process included
    local_rank: int = 0  # this process's index among them (its GPU)
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    torchrun: bool = False  # torchrun started every rank: this process starts no helper

    @property
    def spans_nodes(self) -> bool:
        return self.nnodes > 1 or self.torchrun

    @property
    def helpers(self) -> int:
        """Ranks this launch spawns beside itself."""
        return 0 if self.torchrun else self.local_ranks - 1

    @property
    def init_method(self) -> str:
        if self.torchrun:
            return "env://"
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    @property
    def hosts_rank_zero(self) -> bool:
        return self.first_rank == 0


def single_host(tp_size: int) -> NodePlacement:
    return NodePlacement(world_size=tp_size, local_ranks=tp_size)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensor parallel across nodes (--tp ranks split evenly over the nodes)")
    group.add_argument(
        "--nnodes",
        type=_positive,
        default=None,
        help="hosts the --tp group spans; start the same command on each with its --node-rank (default: 1, "
        "or torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE)",
    )
    group.add_argument(
        "--node-rank",
        type=_non_negative,
        default=None,
        help="this host's index, 0 to --nnodes - 1 (0 serves)",
    )
    group.add_argument(
        "--master-addr",
        default=None,
        help="address of node 0, where every rank meets (default: 127.0.0.1, or torchrun's MASTER_ADDR)",
    )
    group.add_argument(
        "--master-port",
        type=_port,
        default=None,
        help=f"a free port on node 0 for the meeting (default: {DEFAULT_MASTER_PORT}, or torchrun's MASTER_PORT)",
    )


def placement_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NodePlacement:
    """The placement `args` (the flags above, `tp_size`) and torchrun's variables describe."""
    environ = os.environ if environ is None else environ
    tp_size = int(getattr(args, "tp_size", 1))
    nnodes = getattr(args, "nnodes", None)
    node_rank = getattr(args, "node_rank", None)
    flags_given = nnodes is not None or node_rank is not None
    if not flags_given and all(key in environ for key in TORCHRUN_ENV) and int(environ["WORLD_SIZE"]) > 1:
        return _from_torchrun(tp_size, environ, args)
    nnodes = nnodes or 1
    node_rank = node_rank or 0
    if nnodes == 1:
        if node_rank:
            raise NodePlacementError(f"--node-rank {node_rank} needs --nnodes above {node_rank}")
        return single_host(tp_size)
    if node_rank >= nnodes:
        raise NodePlacementError(
            f"--node-rank {node_rank} is not below --nnodes {nnodes}; use 0 to {nnodes - 1}"
        )
    if tp_size % nnodes:
        raise NodePlacementError(
            f"--tp {tp_size} does not split evenly over --nnodes {nnodes}; pass a --tp that is a multiple of it"
        )
    master_addr = getattr(args, "master_addr", None) or environ.get("MASTER_ADDR") or "127.0.0.1"
    master_port = getattr(args, "master_port", None) or int(environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    per_node = tp_size // nnodes
    return NodePlacement(
        world_size=tp_size,
        nnodes=nnodes,
        node_rank=node_rank,
        first_rank=node_rank * per_node,
        local_ranks=per_node,
        master_addr=master_addr,
        master_port=master_port,
    )


def _from_torchrun(tp_size: int, environ: Mapping[str, str], args: argparse.Namespace) -> NodePlacement:
    world_size, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
    if tp_size not in (1, world_size):
        raise NodePlacementError(
            f"--tp {tp_size} differs from torchrun's WORLD_SIZE={world_size}; one tensor-parallel group "
            f"takes every rank torchrun starts (drop --tp or pass --tp {world_size})"
        )
    args.tp_size = world_size  # the engine checks its rank count against it
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    return NodePlacement(
        world_size=world_size,
        nnodes=max(1, world_size // max(local_ranks, 1)),
        node_rank=int(environ.get("GROUP_RANK", rank // max(local_ranks, 1))),
        first_rank=rank,
        local_ranks=local_ranks,
        local_rank=int(environ["LOCAL_RANK"]),
        master_addr=environ["MASTER_ADDR"],
        master_port=int(environ["MASTER_PORT"]),
        torchrun=True,
    )


def _positive(value: str) -> int:
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not a number of nodes; pass 1 or more")
    return number


def _non_negative(value: str) -> int:
    number = _integer(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number} is not a node index; pass 0 or more")
    return number


def _port(value: str) -> int:
    number = _integer(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a TCP port; pass 1 to 65535")
    return number


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
