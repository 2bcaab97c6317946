"""`snugkv serve --dp N` before anything starts: what each replica is given, which GPUs it sees, and
the one-line refusals (no router installed, flags that describe no fleet)."""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

import pytest

from snugkv.cli import build_parser, main
from snugkv.commands.serve_replicas import replica_devices, replica_flags
from snugkv.server.router import RouterOptions, RouterUnavailable, find_router_binary, router_command


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_a_replica_gets_every_serve_flag_but_the_fleets() -> None:
    args = _serve_args(
        "--dp", "2", "--model", "m.gguf", "--max-total-tokens", "100", "--kv-elastic", "--no-engine-process",
        "--memory-share", "2.5", "--host", "0.0.0.0", "--port", "9000", "--api-key", "secret",
        "--router-policy", "round_robin", "--replica-restarts", "1",
    )  # fmt: skip
    serve_parser = next(
        action.choices["serve"]
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    flags = replica_flags(args, serve_parser)
    assert flags == [
        "--model", "m.gguf", "--max-total-tokens", "100", "--no-engine-process", "--kv-elastic",
        "--memory-share", "2.5",
    ]  # fmt: skip
    again = _serve_args(*flags)  # what the replica parses is what was asked, fleet flags at their defaults
    for name in ("model", "max_total_tokens", "kv_elastic", "engine_process", "memory_share"):
        assert getattr(again, name) == getattr(args, name), name
    assert (again.dp_size, again.api_key, again.port) == (1, None, 8000)


def _on_gpus(*flags: str) -> argparse.Namespace:
    args = _serve_args(*flags)
    args.device = "cuda"  # as --device cuda parses on a GPU machine (this one may have none)
    return args


def test_replicas_get_their_own_gpus_or_share_them_with_kv_elastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_devices(_on_gpus("--dp", "2", "--tp", "2")) == ["4,5", "6,7"]
    assert replica_devices(_on_gpus("--dp", "4")) == ["4", "5", "6", "7"]
    assert replica_devices(_on_gpus("--dp", "6", "--kv-elastic")) == ["4", "5", "6", "7", "4", "5"]
    with pytest.raises(ValueError, match=r"--dp 3 x --tp 2 needs 6 GPUs and 4 are visible"):
        replica_devices(_on_gpus("--dp", "3", "--tp", "2"))
    one_gpu = _on_gpus("--dp", "2")
    one_gpu.device = "cuda:1"
    with pytest.raises(ValueError, match=r"puts every replica on one GPU; add --kv-elastic"):
        replica_devices(one_gpu)
    assert replica_devices(_serve_args("--dp", "2", "--device", "cpu")) == [None, None]


def test_the_router_command_keeps_to_loopback_and_checks_readiness() -> None:
    options = RouterOptions(
        host="127.0.0.1", port=30000, metrics_port=29000, api_key="k", metrics_host="10.0.0.5"
    )
    command = router_command("/env/bin/smg", ["http://127.0.0.1:1", "http://127.0.0.1:2"], options)
    assert command[:2] == ["/env/bin/smg", "launch"]
    pairs = dict(itertools.pairwise(command))
    assert pairs["--host"] == "127.0.0.1"  # only the front reaches it
    assert pairs["--prometheus-host"] == "10.0.0.5"  # --host: its metrics are read from elsewhere
    assert pairs["--policy"] == "cache_aware" and pairs["--health-check-endpoint"] == "/ready"
    assert pairs["--api-key"] == "k"
    assert command[command.index("--worker-urls") + 1 : command.index("--policy")] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]


def test_a_missing_router_is_one_line_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RouterUnavailable, match=r"pip install 'snugkv\[router\]'"):
        find_router_binary()
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--dp", "2", "--device", "cpu", "--port", "0"]) == 2
    assert "--dp needs the router `smg`" in caplog.text and "Traceback" not in caplog.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2", "--node-rank", "0", "--tp", "2"], "--dp starts its replicas on this host"),
        (["--replica-restarts", "-1"], "--replica-restarts -1 is negative"),
    ],
)
def test_dp_refuses_flags_that_describe_no_fleet(
    flags: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--dp", "2", "--device", "cpu", "--port", "0", *flags]) == 2
    assert message in caplog.text


def test_dp_must_be_a_count_of_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--dp", "0"])
    assert exit_info.value.code == 2
    assert "0 replicas serve nothing" in capsys.readouterr().err
