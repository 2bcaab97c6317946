"""`snugkv memory`: run the start-up sizing pipeline on this machine and print the plan.

Loads the model, reserves and captures as `serve` would, sizes the KV cache, prints the sizing
line and the memory ledger, then releases everything. Nothing is served. `--plot FILE.png`
draws the ledger as a stacked bar.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator

from snugkv.commands.engine_args import add_engine_arguments, checked_engine_args, engine_args_from

GIB = 1 << 30  # as snugkv.memory.vmm has it; that module imports torch, which --help need not


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "memory", help="print the KV sizing plan and memory ledger without serving"
    )
    add_engine_arguments(parser)
    parser.add_argument("--plot", default=None, help="write the ledger as a bar chart to this PNG")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="N",
        help="instead: show the --kv-elastic engines registered on GPU N (or 'host', the host backend's "
        "shared device), their KV caches and shares; loads nothing",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from snugkv.distributed.launch import device_type_for, launch

    if args.gpu is not None:
        return _show_engines(args.gpu, as_json=args.json)
    checked_engine_args(args)  # a bad flag is one line before loading, as `generate` has it
    return int(launch(_memory_rank, args.tp_size, (args,), device_type=device_type_for(args.device)) or 0)


def _memory_rank(tp, args: argparse.Namespace) -> int:
    """Every rank sizes its own engine (the token count is agreed); rank 0 prints its ledger and
    one line per rank."""
    from snugkv.engine import Engine

    with _engine_report_not_logged():
        engine = Engine(engine_args_from(args), tp=tp)
    report = engine.report
    ledgers = _gather(tp, report.ledger)
    engine.close()
    if not tp.is_first_rank:
        return 0
    if args.json:  # stdout holds the JSON alone, so it can be piped into a parser
        print(
            json.dumps(
                {**report.to_dict(), "ledger_per_rank": [ledger.to_dict() for ledger in ledgers]}, indent=2
            )
        )
    else:
        _print_report(report, ledgers)
    if args.plot:
        from snugkv.bench.plots import plot_ledgers

        plot_ledgers(
            {f"rank {rank}": ledger for rank, ledger in enumerate(ledgers)}
            if len(ledgers) > 1
            else {str(report.mode): report.ledger},
            args.plot,
            title=f"snugkv memory ledger ({report.ledger.device})",
        )
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_report(report, ledgers) -> None:
    ledger = report.ledger
    print(
        f"kv sizing: {report.mode}, max_total_num_tokens={report.max_total_num_tokens:,}, "
        f"max_running_requests={report.max_running_requests}, KV committed {ledger.kv_committed_bytes / GIB:.2f} GiB, "
        f"free after {ledger.free_bytes / GIB:.2f} GiB, sizing took {report.sizing_ms:.1f} ms"
    )
    print(report.ledger.table())
    if len(ledgers) > 1:
        for rank, ledger in enumerate(ledgers):
            print(
                f"rank {rank}: KV committed {ledger.kv_committed_bytes / GIB:.2f} GiB, "
                f"free {ledger.free_bytes / GIB:.2f} GiB, unaccounted {ledger.unaccounted_bytes / GIB:.3f} GiB"
            )


@contextlib.contextmanager
def _engine_report_not_logged() -> Iterator[None]:
    """The engine logs its sizing line and ledger at INFO; this command prints them on stdout, so at
    the default level the log's copies would show everything twice (--log-level debug keeps them)."""
    engine_logger = logging.getLogger("snugkv.engine")
    previous = engine_logger.level
    if engine_logger.getEffectiveLevel() == logging.INFO:
        engine_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        engine_logger.setLevel(previous)


def _gather(tp, ledger):
    if not tp.enabled:
        return [ledger]
    import torch.distributed as dist

    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, ledger, group=tp.cpu_group)
    return everyone


def _show_engines(gpu: str, *, as_json: bool) -> int:
    """`--gpu N`: the record of elastic engines on that device, one line each."""
    import torch

    from snugkv.memory_share.policy import SharePolicy
    from snugkv.memory_share.record import ShareRecord, device_key
    from snugkv.memory_share.share import share_table
    from snugkv.sizing.measure import shared_device_free_bytes

    if gpu == "host":
        device = torch.device("cpu")
    elif gpu.isdigit() and torch.cuda.is_available() and int(gpu) < torch.cuda.device_count():
        device = torch.device("cuda", int(gpu))
    else:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        visible = f"{count} visible: 0 to {count - 1}" if count else "no GPU is visible"
        print(f"error: --gpu {gpu!r} is neither a GPU here ({visible}) nor 'host'")
        return 2
    record = ShareRecord.for_device(device_key(device))
    table = share_table(record.entries(), shared_device_free_bytes(device), SharePolicy())
    if as_json:
        print(json.dumps({"record": str(record.path), **table}, indent=2))
        return 0
    engines = table["engines"]
    print(f"{len(engines)} elastic engine(s) on {device} ({record.path})")
    if table["free_bytes"] is not None:
        print(f"free {table['free_bytes'] / GIB:.2f} GiB, shared KV pool {table['pool_bytes'] / GIB:.2f} GiB")
    for e in engines:
        target = "-" if e["target_bytes"] is None else f"{e['target_bytes'] / GIB:.2f}"
        print(
            f"  pid {e['pid']:>7}  {e['name'][:24]:<24} {e['state']:<8} KV {e['kv_bytes'] / GIB:7.2f} GiB "
            f"({e['kv_tokens']:,} tokens)  demand {e['demand_bytes'] / GIB:6.2f}  weight {e['weight']:g} "
            f"share {e['share']:.0%}  target {target}  {e['url']}"
        )
    return 0
