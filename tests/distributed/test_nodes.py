"""One tensor-parallel group over two "nodes": two `snugkv serve --nnodes 2` launches on this host,
one rank each, meeting over gloo at --master-addr; and how flags and torchrun's environment place a
launch in the group."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from snugkv import LLM, SamplingParams
from snugkv.distributed.launch import free_port
from snugkv.distributed.nodes import NodePlacement, NodePlacementError, placement_from
from tests.models.hf_tiny import hf_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = "snugkv is serving on "
NEW_TOKENS = 10
PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):"]


def _args(**flags: object) -> argparse.Namespace:
    values: dict[str, object] = {"tp_size": 1, "nnodes": None, "node_rank": None, "master_addr": None}
    return argparse.Namespace(**{**values, "master_port": None, **flags})


def test_node_flags_give_each_launch_its_share_of_the_ranks() -> None:
    flags = {"tp_size": 4, "nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29600}
    first, second = (placement_from(_args(**flags, node_rank=rank), environ={}) for rank in (0, 1))
    assert (first.first_rank, first.local_ranks, first.helpers, first.hosts_rank_zero) == (0, 2, 1, True)
    assert (second.first_rank, second.local_ranks, second.hosts_rank_zero) == (2, 2, False)
    assert first.init_method == second.init_method == "tcp://10.0.0.1:29600"
    assert placement_from(_args(tp_size=2), environ={}) == NodePlacement(world_size=2, local_ranks=2)


def test_torchrun_makes_this_process_one_rank_that_starts_no_helper() -> None:
    environ = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    environ |= {"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "GROUP_RANK": "1"}
    args = _args()
    placement = placement_from(args, environ=environ)
    assert args.tp_size == 4  # --tp defaults to the whole torchrun world
    assert (placement.first_rank, placement.local_rank, placement.node_rank) == (3, 1, 1)
    assert placement.helpers == 0
    assert placement.init_method == "env://" and not placement.hosts_rank_zero


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ({"tp_size": 3, "nnodes": 2, "node_rank": 0}, {}, "--tp 3 does not split evenly over --nnodes 2"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2}, {}, "--node-rank 2 is not below --nnodes 2"),
        ({"tp_size": 2, "node_rank": 1}, {}, "--node-rank 1 needs --nnodes above 1"),
        (
            {"tp_size": 2},
            {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "--tp 2 differs from torchrun's WORLD_SIZE=4",
        ),
    ],
)
def test_node_flags_that_describe_no_group_are_refused_naming_the_flag(
    flags: dict[str, object], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(NodePlacementError, match=re.escape(message)):
        placement_from(_args(**flags), environ=environ)


def _launch(model: Path, node_rank: int, master_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "snugkv", "serve", "--model", str(model), "--tp", "2", "--device", "cpu",
        "--dtype", "float32", "--max-total-tokens", "2048", "--max-running-requests", "8",
        "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
        "--master-port", str(master_port), "--port", "0",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _serving_url(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()
        for line in log_path.read_text(errors="replace").splitlines():
            if SERVING in line:
                return line.split(SERVING)[1].split()[0]
        time.sleep(0.2)
    raise AssertionError(f"node 0 did not serve:\n{log_path.read_text()}")


@pytest.mark.slow  # two server processes meeting over gloo: end to end
def test_two_nodes_of_one_rank_each_serve_the_tokens_of_tp_1_and_transformers(tiny_model, tmp_path):
    path, model, tokenizer = tiny_model
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_launch(path, rank, port, logs[rank]) for rank in (0, 1)]
    try:
        url = _serving_url(nodes[0], logs[0])
        body = {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=120) as http, ThreadPoolExecutor(len(PROMPTS)) as pool:

            def complete(prompt: str) -> httpx.Response:
                return http.post("/v1/completions", json={**body, "prompt": prompt})

            answers = list(pool.map(complete, PROMPTS))
            info = http.get("/server_info").json()
        # Both "nodes" stop with node 0: it tells its follower, which then exits cleanly as well.
        os.kill(nodes[0].pid, signal.SIGTERM)
        codes = [node.wait(timeout=90) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert codes == [0, 0], [log.read_text() for log in logs]
    assert info["tp_size"] == 2 and len(info["per_rank_free_bytes"]) == 2, info  # sized as MIN over both
    assert SERVING not in logs[1].read_text()  # only node 0 serves HTTP
    with LLM(path, device="cpu", dtype="float32", max_total_tokens=1024) as single:
        greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        tp1 = [output.text for output in single.generate(PROMPTS, greedy, use_tqdm=False)]
    for prompt, answer, alone in zip(PROMPTS, answers, tp1, strict=True):
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
        expected = tokenizer.decode(hf_greedy(model, tokenizer.encode(prompt), NEW_TOKENS))
        assert text == alone == expected, prompt
    for log in logs:
        assert "Traceback" not in log.read_text(), log.read_text()


@pytest.mark.slow  # torchrun and two ranks: end to end
def test_torchrun_starts_both_ranks_and_its_rank_0_serves_the_same_tokens(tiny_model, tmp_path):
    path, model, tokenizer = tiny_model
    log_path = tmp_path / "torchrun.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "snugkv", "serve", "--model", str(path), "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", "2048", "--port", "0",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = _serving_url(process, log_path)
        body = {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        info = httpx.get(f"{url}/server_info", timeout=30).json()
        process.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks; rank 0 leads the stop
        process.wait(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    expected = tokenizer.decode(hf_greedy(model, tokenizer.encode(PROMPTS[0]), NEW_TOKENS))
    assert answer.json()["choices"][0]["text"] == expected
    assert info["tp_size"] == 2 and len(info["per_rank_free_bytes"]) == 2
    log = log_path.read_text()
    assert "Stopped serving on" in log, log
    assert "[rank0]" not in log and "[rank1]" not in log, log  # no rank failed on the way out
