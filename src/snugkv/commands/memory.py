"""`snugkv memory`: run the start-up sizing pipeline on this machine and print the plan.

Loads the model, reserves and captures as `serve` would, sizes the KV cache, prints the sizing
line and the memory ledger, then releases everything. Nothing is served. `--plot FILE.png`
draws the ledger as a stacked bar.
"""

from __future__ import annotations

import argparse
import json

from snugkv.commands.engine_args import add_engine_arguments, engine_args_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "memory", help="print the KV sizing plan and memory ledger without serving"
    )
    add_engine_arguments(parser)
    parser.add_argument("--plot", default=None, help="write the ledger as a bar chart to this PNG")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from snugkv.engine import Engine

    engine = Engine(engine_args_from(args))
    report = engine.report
    print(
        f"kv sizing: {report.mode}, max_total_num_tokens={report.max_total_num_tokens:,}, "
        f"max_running_requests={report.max_running_requests}, sizing took {report.sizing_ms:.1f} ms"
    )
    print(report.ledger.table())
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    if args.plot:
        from snugkv.bench.plots import plot_ledgers

        plot_ledgers(
            {str(report.mode): report.ledger},
            args.plot,
            title=f"snugkv memory ledger ({report.ledger.device})",
        )
        print(f"wrote {args.plot}")
    engine.close()
    return 0
