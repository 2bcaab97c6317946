"""`snugkv bench peers` on CPU: where each engine's log states its KV tokens, the rows and ratios
built from the client's, the arguments and the plan they make (flags and environments per engine),
the deadline skipping what would not fit, a server's whole process group stopped, several calls
merged; and end to end (slow) a stand-in peer (the stub-device server behind a fake `serve.sh`)
then a tiny `snugkv serve`, both loaded by the real client."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from snugkv.bench import peer_servers
from snugkv.bench.peer_report import ServerFacts, engine_rows, ratios
from snugkv.bench.peer_servers import ServerError, ServerSpec
from snugkv.bench.peers import Workload, check_plan, plan_from_args, run_plan
from snugkv.cli import build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[2]

VLLM_LOG = """\
INFO 12-04 11:20:01 [gpu_worker.py:300] Available KV cache memory: 110.61 GiB
INFO 12-04 11:20:01 [kv_cache_utils.py:2177] GPU KV cache size: 1,188,528 tokens
INFO 12-04 11:20:01 [kv_cache_utils.py:2181] Maximum concurrency for 40,960 tokens per request: 29.02x
"""
SGLANG_LOG = """\
[2026-12-04 11:30:02] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096, K size: 0.22 GB, V size: 0.22 GB
[2026-12-04 11:30:40] Post-capture KV sizing: KV cache allocated. dtype: torch.bfloat16, #tokens: 1156354, K size: 61.76 GB, V size: 61.76 GB
[2026-12-04 11:30:41] max_total_num_tokens=1156354, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=4096, context_len=40960, available_gpu_mem=12.47 GB
"""
SNUGKV_LOG = """\
13:10:51 INFO snugkv.engine.pipeline: Post-capture KV sizing: max_total_num_tokens=1246192, committed=133.10 GiB, headroom=3.00 GiB, free after=3.50 GiB, took=1441.9 ms
"""


@pytest.mark.parametrize(
    ("engine", "log", "tokens"),
    [("vllm", VLLM_LOG, 1_188_528), ("sglang", SGLANG_LOG, 1_156_354), ("snugkv", SNUGKV_LOG, 1_246_192)],
)
def test_each_engine_s_kv_tokens_are_read_from_its_own_log_line(engine: str, log: str, tokens: int) -> None:
    assert peer_servers.kv_tokens_from_log(engine, log) == tokens


def test_sglang_s_post_capture_pool_counts_not_the_pre_capture_one() -> None:
    pre_capture_only = SGLANG_LOG.splitlines()[0]
    assert peer_servers.kv_tokens_from_log("sglang", pre_capture_only) is None
    assert peer_servers.kv_tokens_from_log("sglang", SGLANG_LOG.splitlines()[1]) == 1_156_354


def test_a_log_without_a_kv_line_gives_none() -> None:
    assert peer_servers.kv_tokens_from_log("vllm", "INFO starting\n") is None


def test_server_info_kv_tokens_are_found_at_the_top_or_in_sglang_s_scheduler_state() -> None:
    assert peer_servers.kv_tokens_from_server_info({"max_total_num_tokens": 23300}) == 23300
    sglang = {"internal_states": [{"max_total_num_tokens": 1156354}], "version": "0.5.17"}
    assert peer_servers.kv_tokens_from_server_info(sglang) == 1156354
    assert peer_servers.kv_tokens_from_server_info({"detail": "Not Found"}) is None
    assert peer_servers.kv_tokens_from_server_info(["not", "a", "dict"]) is None


def test_the_stress_cap_is_whole_vllm_blocks_and_max_total_tokens_elsewhere() -> None:
    workload = Workload()
    assert workload.stress_demand_tokens == 256 * 3900 and workload.stress_kv_tokens == 499_200
    assert peer_servers.kv_cap_flags("vllm", 499_201) == [
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        "31201",
    ]
    for engine in ("sglang", "snugkv"):
        assert peer_servers.kv_cap_flags(engine, 499_200) == ["--max-total-tokens", "499200"]


def test_the_warm_up_is_the_clients_own_default() -> None:
    from snugkv.bench import openai_load, peers

    assert peers.WARM_UP_REQUESTS == openai_load.WARM_UP_REQUESTS == Workload().warm_up_requests


def test_both_cases_send_the_issue_s_load_through_the_client() -> None:
    workload = Workload()
    offline = workload.client_args("offline")
    assert offline == [
        "--requests", "256", "--workloads", "offline", "--warm-up-requests", "16", "--prompts", "ids,text",
        "--low", "100", "--high", "1024",
    ]  # fmt: skip
    stress = workload.client_args("stress")
    assert stress == [
        "--requests", "256", "--workloads", "stress", "--warm-up-requests", "16", "--prompts", "ids",
        "--stress-input-tokens", "3500", "--stress-output-tokens", "400",
    ]  # fmt: skip


def _client_row(path: str, prompts: str, tok_per_s: float) -> dict:
    return {
        "path": path,
        "case": "offline 256 req",
        "prompts": prompts,
        "output_tok_per_s": tok_per_s,
        "errors": 0,
    }


def test_rows_take_the_measured_passes_and_the_server_s_facts() -> None:
    client = [
        _client_row("u, httpx client, streamed (first pass, not compared)", "ids", 1.0),
        _client_row("u, httpx client, streamed (measured)", "ids", 10_000.0),
        _client_row("u, httpx client, streamed (measured)", "text", 9_000.0),
    ]
    facts = ServerFacts(startup_s=110.0, kv_tokens=1_188_528, kv_tokens_source="log")
    ids, text = engine_rows("vllm", "llama-3-8b", "offline", ("ids", "text"), facts, client)
    assert (ids["engine"], ids["model"], ids["case"], ids["prompts"]) == (
        "vllm",
        "llama-3-8b",
        "offline",
        "ids",
    )
    assert (ids["output_tok_per_s"], text["output_tok_per_s"]) == (10_000.0, 9_000.0)
    assert ids["kv_tokens"] == 1_188_528 and ids["startup_s"] == 110.0 and "error" not in ids
    assert ids["load"] == "offline 256 req" and "path" not in ids


def test_a_kind_the_client_did_not_measure_has_no_figure_and_says_why() -> None:
    client = [_client_row("u (measured)", "ids", 10_000.0)]
    ids, text = engine_rows(
        "sglang", "qwen3-0.6b", "offline", ("ids", "text"), ServerFacts(), client, "timed out"
    )
    assert ids["output_tok_per_s"] == 10_000.0 and ids["error"] == "timed out"
    assert text["output_tok_per_s"] is None and text["error"] == "timed out"
    (failed,) = engine_rows("vllm", "qwen3-30b-a3b", "stress", ("ids",), ServerFacts(), [])
    assert (
        failed["output_tok_per_s"] is None and failed["error"] == "the client measured no pass of this kind"
    )


def test_ratios_are_snugkv_over_the_peer_and_text_over_ids_per_engine() -> None:
    rows = [
        {"engine": "vllm", "model": "m", "case": "offline", "prompts": "ids", "output_tok_per_s": 10_000.0},
        {"engine": "vllm", "model": "m", "case": "offline", "prompts": "text", "output_tok_per_s": 9_500.0},
        {"engine": "snugkv", "model": "m", "case": "offline", "prompts": "ids", "output_tok_per_s": 11_500.0},
        {"engine": "snugkv", "model": "m", "case": "offline", "prompts": "text", "output_tok_per_s": None},
    ]
    found = ratios(rows)
    assert {"model": "m", "case": "offline", "prompts": "ids", "snugkv_over": "vllm", "ratio": 1.15} in found
    assert {"model": "m", "case": "offline", "engine": "vllm", "text_over_ids": 0.95} in found
    assert len(found) == 2  # snugkv's text row has no figure: no ratio of it


def test_a_ratio_names_both_engines_kv_tokens_so_one_at_unequal_kv_shows():
    # the H100 stress case at b77435b: vLLM's blocks forced to the 499,200-token cap, snugkv's cap
    # above the 481,264 tokens it sizes on that card
    rows = [
        {"engine": "vllm", "model": "m", "case": "stress", "prompts": "ids", "output_tok_per_s": 2319.0,
         "kv_tokens": 499_200},
        {"engine": "snugkv", "model": "m", "case": "stress", "prompts": "ids", "output_tok_per_s": 2171.0,
         "kv_tokens": 481_264},
    ]  # fmt: skip
    (found,) = ratios(rows)
    assert found["kv_tokens"] == {"snugkv": 481_264, "vllm": 499_200}
    assert found["kv_ratio"] == pytest.approx(481_264 / 499_200)
    assert found["ratio"] == pytest.approx(2171 / 2319)


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "peers", *argv])


def test_the_arguments_plan_each_engine_s_flags_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", "src:/tmp/snugkv-site")
    args = _parse(
        "--peer", "vllm", "--shape", "llama-3-8b-fp8", "--cases", "stress", "--peer-site", "/tmp/peer-site",
        "--peer-args", "--max-model-len 8192", "--out", str(tmp_path),
    )  # fmt: skip
    plan = plan_from_args(args)
    assert plan.engines == ("vllm", "snugkv") and plan.cases == ("stress",)
    assert plan.model_dir == Path(".peer/models/llama-3-8b")  # the FP8 shape serves the bf16 dir quantized
    peer = plan.server_spec("vllm", "stress")
    assert peer.command[:6] == [
        "bash",
        ".peer/serve.sh",
        "vllm",
        ".peer/models/llama-3-8b",
        str(peer.port),
        "--host",
    ]
    assert peer.command[7:] == [
        "--quantization", "fp8", "--block-size", "16", "--num-gpu-blocks-override", "31200", "--max-model-len", "8192",
    ]  # fmt: skip
    assert peer.env["PYTHONPATH"] == "/tmp/peer-site" and peer.env["HF_HUB_OFFLINE"] == "1"
    ours = plan.server_spec("snugkv", "stress")
    assert ours.command[1:4] == ["-m", "snugkv", "serve"] and "--load-format" in ours.command
    assert ours.command[-4:] == ["--quantization", "fp8", "--max-total-tokens", "499200"]
    assert ours.env["PYTHONPATH"] == "src:/tmp/snugkv-site"  # snugkv's wheels, never the peer's site
    assert ours.log_path == tmp_path / "server-snugkv-stress.log"
    # --profile-steps: vLLM gets its profiler at launch (a flag: 0.26 ignores the old environment
    # variable and answers /start_profile with a 404 without it), snugkv its folder in the environment
    profiled = plan_from_args(
        _parse("--peer", "vllm", "--cases", "offline", "--profile-steps", "5", "--out", str(tmp_path))
    )
    peer = profiled.server_spec("vllm", "offline")
    folder = tmp_path.resolve() / "profile-vllm-offline"
    at = peer.command.index("--profiler-config")
    assert json.loads(peer.command[at + 1]) == {
        "profiler": "torch", "torch_profiler_dir": str(folder), "torch_profiler_with_stack": False,
    }  # fmt: skip
    assert not any(key.startswith("VLLM_TORCH_PROFILER") for key in peer.env)
    assert "--profiler-config" not in plan.server_spec("vllm", "stress").command  # only the profiled case
    ours = profiled.server_spec("snugkv", "offline")
    assert (
        "--profiler-config" not in ours.command
        and str(tmp_path.resolve() / "profile-snugkv-offline") in ours.env.values()
    )


def test_the_dry_run_is_snugkv_alone_on_the_default_model_with_a_tiny_load() -> None:
    plan = plan_from_args(_parse("--dry-run", "--peer", "sglang"))
    assert plan.engines == ("snugkv",) and plan.model_dir is None and plan.tokenizer == "default"
    assert plan.workload.requests < 10 and check_plan(plan) is None
    assert "--model" not in plan.server_spec("snugkv", "offline").command


def test_unknown_cases_and_a_missing_model_directory_are_refused_with_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parse("--cases", "offline,online")
    assert "name cases from offline, stress" in capsys.readouterr().err
    assert main(["bench", "peers", "--models-dir", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "make it with the peers tools' mktok.py" in capsys.readouterr().err


def test_cases_that_would_not_fit_before_the_deadline_are_skipped_and_the_json_says_so(
    tmp_path: Path,
) -> None:
    models = tmp_path / "models" / "qwen3-0.6b"
    models.mkdir(parents=True)
    (models / "config.json").write_text("{}")
    args = _parse("--peer", "sglang", "--shape", "qwen3-0.6b", "--models-dir", str(tmp_path / "models"))
    args.out, args.deadline_s = str(tmp_path / "out"), 60.0
    report = run_plan(plan_from_args(args))
    payload = json.loads(report.path.read_text())
    assert payload["benchmark"] == "peers" and payload["complete"] and payload["servers"] == []
    assert {"date", "commit", "gpu", "snugkv"} <= payload["environment"].keys()
    rows = payload["rows"]
    assert [(row["engine"], row["case"], row["prompts"]) for row in rows] == [
        ("sglang", "offline", "ids"), ("sglang", "offline", "text"), ("snugkv", "offline", "ids"),
        ("snugkv", "offline", "text"), ("sglang", "stress", "ids"), ("snugkv", "stress", "ids"),
    ]  # fmt: skip
    assert all(row["output_tok_per_s"] is None for row in rows)
    assert (
        "sglang needs about 145 s" in rows[0]["skipped"]
        and rows[2]["skipped"] == "its peer did not run this case"
    )


def test_stop_ends_every_process_of_the_server_s_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    command = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"]
    spec = ServerSpec("vllm", command, dict(os.environ), 1, tmp_path / "server.log")
    server = peer_servers.start(spec)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert os.getpgid(child) == server.process.pid != os.getpgid(0)  # its own group, not ours
    assert peer_servers.stop(server, timeout_s=5) == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "the server's child outlived the stop"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


def test_a_server_that_exits_before_it_is_healthy_is_an_error_with_its_log(tmp_path: Path) -> None:
    command = ["bash", "-c", "echo 'CUDA error: no kernel image'; exit 3"]
    server = peer_servers.start(ServerSpec("sglang", command, dict(os.environ), 1, tmp_path / "server.log"))
    with pytest.raises(ServerError, match=r"sglang exited with code 3(.|\n)*no kernel image"):
        peer_servers.wait_healthy(server, timeout_s=30)


def test_several_calls_merge_into_one_file_with_every_row(tmp_path: Path) -> None:
    paths = []
    for peer, tok_per_s in (("vllm", 10_000.0), ("sglang", 9_000.0)):
        rows = [
            {
                "engine": peer,
                "model": "m",
                "case": "offline",
                "prompts": "ids",
                "output_tok_per_s": tok_per_s,
            },
            {
                "engine": "snugkv",
                "model": "m",
                "case": "offline",
                "prompts": "ids",
                "output_tok_per_s": 11_000.0,
            },
        ]
        env = {"date": "d", "commit": "abc1234", "gpu": "NVIDIA H200"}
        path = tmp_path / f"peers-{peer}-m.json"
        path.write_text(
            json.dumps({"benchmark": "peers", "peer": peer, "model": "m", "environment": env, "rows": rows})
        )
        paths.append(str(path))
    assert main(["bench", "peers", "--merge", *paths, "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "peers.json").read_text())
    assert merged["benchmark"] == "peers" and merged["commits"] == ["abc1234"] and len(merged["rows"]) == 4
    assert sorted(r["snugkv_over"] for r in merged["ratios"]) == ["sglang", "vllm"]


# -- end to end ---------------------------------------------------------------------------------
def _tiny_model_dir(directory: Path) -> Path:
    """A one-layer Llama config with the embedded SmolLM2's tokenizer beside it (what mktok.py
    makes for a real shape), served with random weights."""
    from snugkv.bench.model_configs import write_tiny_llama_config
    from snugkv.models.loader import resolve_model_source
    from snugkv.models.tokenizer import load_tokenizer

    directory.mkdir(parents=True)
    tokenizer = load_tokenizer(resolve_model_source(None))
    write_tiny_llama_config(directory, context_length=2048, vocab_size=len(tokenizer.hf))
    tokenizer.hf.save_pretrained(str(directory))
    return directory


def _fake_serve_sh(path: Path) -> Path:
    """A stand-in for the pack's serve.sh: records its arguments, logs vLLM's KV line, serves the
    stub-device server on the port it was given."""
    path.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$@" >> {path.parent}/serve-args.txt\n'
        'echo "INFO [kv_cache_utils.py:2177] GPU KV cache size: 4,096 tokens"\n'
        f'exec {sys.executable} -m snugkv.bench.stub_device --port "$3" --step-ms 2 --tokenizer default '
        "--max-batch 8 --chunk 256\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.slow
def test_a_peer_then_snugkv_serve_both_cases_through_the_same_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "src"))
    _tiny_model_dir(tmp_path / "models" / "qwen3-0.6b")
    serve_sh = _fake_serve_sh(tmp_path / "serve.sh")
    out = tmp_path / "out"
    args = [
        "bench",
        "peers",
        "--peer",
        "vllm",
        "--shape",
        "qwen3-0.6b",
        "--models-dir",
        str(tmp_path / "models"),
    ]
    args += ["--serve-sh", str(serve_sh), "--requests", "4", "--low", "8", "--high", "16"]
    args += ["--warm-up-requests", "2"]
    args += ["--stress-input-tokens", "32", "--stress-output-tokens", "4", "--out", str(out)]
    code = main(args)
    payload = json.loads((out / "peers-vllm-qwen3-0.6b.json").read_text())
    assert code == 0, (payload["problems"], capsys.readouterr().out)
    rows = {(row["engine"], row["case"], row["prompts"]): row for row in payload["rows"]}
    assert set(rows) == {
        ("vllm", "offline", "ids"), ("vllm", "offline", "text"), ("vllm", "stress", "ids"),
        ("snugkv", "offline", "ids"), ("snugkv", "offline", "text"), ("snugkv", "stress", "ids"),
    }  # fmt: skip
    for row in rows.values():
        assert row["output_tok_per_s"] > 0 and row["errors"] == 0 and row["startup_s"] > 0, row
        assert row["kv_tokens"] > 0, row
    assert rows[("snugkv", "stress", "ids")]["kv_tokens"] == 72  # 4 x (32 + 4) at 2x demand
    assert rows[("snugkv", "stress", "ids")]["output_tokens"] == 16
    assert rows[("vllm", "offline", "ids")]["kv_tokens_source"] == "server_info"  # the stub answers it
    serve_args = (tmp_path / "serve-args.txt").read_text().splitlines()
    assert serve_args[1].endswith("--host 127.0.0.1 --block-size 16 --num-gpu-blocks-override 5")
    assert [server["exit_code"] is not None for server in payload["servers"]] == [True] * 4
    assert payload["complete"] and any("snugkv_over" in ratio for ratio in payload["ratios"])
    for name in ("server-vllm-offline.log", "server-snugkv-stress.log", "client-snugkv-offline.log"):
        assert (out / name).is_file(), name


@pytest.mark.slow
def test_a_profile_of_the_engines_steps_is_taken_after_the_offline_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--profile-steps`: after the offline passes, the server's next steps are profiled under one
    load (POST /start_profile, /stop_profile) and summed by kind beside the table."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "src"))
    out = tmp_path / "out"
    code = main(
        ["bench", "peers", "--dry-run", "--cases", "offline", "--profile-steps", "3", "--out", str(out)]
    )
    payload = json.loads((out / "peers-snugkv-smollm2-135m.json").read_text())
    assert code == 0, payload["problems"]
    profile = payload["servers"][0]["profile"]
    assert profile["steps_recorded"] == 3 and profile["steps_source"] == "stop_profile", profile
    assert profile["answered"] == 4, profile
    assert profile["summary"]["kinds"]["gemm"] > 0 and profile["ms_per_step_by_kind"]["gemm"] > 0
    assert (out / "profile-snugkv-offline" / profile["trace"]).is_file()
    assert "| kind (ms per step) | snugkv |" in (out / "peers-snugkv-smollm2-135m.md").read_text()
