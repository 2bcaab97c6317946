"""Elastic memory over HTTP on a real server (SmolLM2 on CPU, the host VMM backend): the KV cache
shrinks and grows under a stream of concurrent greedy requests without changing a token, the
process gives the decommitted memory back, and bad resizes get a 4xx naming the limit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE, ServerProcess, start_server
from tests.server.expect import openai_error, wait_for

# End to end (make test-fast leaves it out): real servers resized, put to sleep and woken.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ENGINE != "real", reason="elastic memory needs the real engine"),
]

FULL = 4096  # serve_for_tests' --max-total-tokens
PROMPTS = [
    f"Story {index}: once upon a time, in a land of {index * 7} hills, there lived a" for index in range(16)
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def elastic_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # 1 MiB chunks: each of SmolLM2's 60 KV buffers (3 MiB at 4096 tokens) has three, so a shrink
    # drops whole extensions and splits the one it cuts through.
    process = start_server(tmp_path_factory.mktemp("elastic-server"), "--kv-chunk-mib", "1")
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log(), process.log()


@pytest.fixture()
def http(elastic_server: ServerProcess) -> Iterator[httpx.Client]:
    with elastic_server.client(timeout=120.0) as client:
        yield client


def resize(http: httpx.Client, **body: object) -> dict:
    response = http.post("/kv/resize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_get_kv_tells_the_size_the_memory_and_what_a_resize_would_need(http: httpx.Client) -> None:
    kv = http.get("/kv").json()
    assert kv["max_total_num_tokens"] == FULL and kv["page_size"] == 4
    assert kv["committed_bytes"] > 0 and kv["reserved_bytes"] >= kv["committed_bytes"]
    assert kv["min_tokens"] == 8 and kv["max_tokens"] == FULL
    assert kv["bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers of K and V, 3 heads of 64, fp32
    assert 0.0 <= kv["usage"] <= 1.0 and kv["chunk_bytes"] == 1 << 20
    assert kv["sleeping_tags"] == [] and kv["resizable"] is True


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"max_total_num_tokens": 0}, 400, "below the smallest KV cache, 8 tokens"),
        ({"max_total_num_tokens": -64}, 400, "below the smallest KV cache"),
        ({"max_total_num_tokens": 10**9}, 400, "whose address space was reserved at start-up"),
        ({"max_total_num_tokens": FULL + 4}, 400, "above --max-total-tokens 4096"),
        ({"max_total_num_tokens": "big"}, 400, "must be an integer number of tokens"),
        ({"free_gib": -1}, 400, "is negative"),
        ({"free_gib": 1000}, 400, "leaves room for only"),
        ({"max_total_num_tokens": 512, "free_gib": 1}, 400, "exactly one of"),
        ({}, 400, "exactly one of"),
        ({"tokens": 5}, 400, "Unknown field"),
    ],
)
def test_bad_resizes_get_a_4xx_naming_the_limit(
    http: httpx.Client, body: dict, status: int, says: str
) -> None:
    message = openai_error(http.post("/kv/resize", json=body), status)
    assert says in message, message
    assert http.get("/kv").json()["max_total_num_tokens"] == FULL  # nothing changed


def test_a_body_that_is_not_a_json_object_is_refused(http: httpx.Client) -> None:
    message = openai_error(http.post("/kv/resize", content=b"[1, 2]"), 400)
    assert "JSON object" in message


def test_a_shrink_gives_the_decommitted_bytes_back_to_the_os(
    elastic_server: ServerProcess, http: httpx.Client
) -> None:
    pid = elastic_server.process.pid
    before = rss_bytes(pid)
    shrunk = resize(http, max_total_num_tokens=512)
    released = shrunk["from_committed_bytes"] - shrunk["to_committed_bytes"]
    assert released > 100 << 20  # 3584 tokens of 46 KiB
    dropped = before - rss_bytes(pid)
    assert abs(dropped - released) < 16 << 20, (dropped, released)
    grown = resize(http, max_total_num_tokens=FULL)
    assert grown["to_committed_bytes"] == shrunk["from_committed_bytes"]
    assert abs(rss_bytes(pid) - before) < 16 << 20


def complete_all(base_url: str, headers: dict) -> list[tuple[str, int]]:
    def one(prompt: str) -> tuple[str, int]:
        with httpx.Client(base_url=base_url, headers=headers, timeout=300.0) as client:
            body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            result = response.json()
            return result["choices"][0]["text"], result["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_shrink_and_grow_under_concurrent_greedy_requests_change_no_token(
    elastic_server: ServerProcess, http: httpx.Client
) -> None:
    headers = dict(http.headers)
    expected = complete_all(elastic_server.base_url, headers)
    assert all(tokens == NEW_TOKENS for _, tokens in expected)
    for index in range(8):  # cached filler above the first run's pages: the next run's pages land higher
        filler = f"Filler {index}: " + " ".join(f"item{index}x{j}" for j in range(60))
        assert http.post("/v1/completions", json={"prompt": filler, "max_tokens": 1}).status_code == 200
    results: list[dict] = []
    done = threading.Event()

    def resizer() -> None:
        with elastic_server.client(timeout=120.0) as client:
            while not done.is_set():
                kv = client.get("/kv").json()
                if kv["num_running_requests"] < len(PROMPTS) // 2:
                    continue  # the live pages sit above the first run's cached ones once they decode
                in_use = kv["used_tokens"] - kv["evictable_cached_tokens"]
                room = 4 * 7 * len(PROMPTS)  # every request can still take seven pages
                target = max(kv["min_tokens_without_failing_a_request"], -(-(in_use + room) // 4) * 4)
                for tokens in (min(target, FULL), FULL):
                    results.append(resize(client, max_total_num_tokens=tokens))
                    time.sleep(0.05)

    thread = threading.Thread(target=resizer)
    thread.start()
    try:
        outputs = complete_all(elastic_server.base_url, headers)
    finally:
        done.set()
        thread.join()
    assert outputs == expected
    shrinks = [r for r in results if r["to_tokens"] < r["from_tokens"]]
    assert shrinks and all(r["retracted_requests"] == 0 for r in results)
    assert sum(r["moved_pages"] for r in shrinks) > 0, shrinks  # live KV moved, not only cache evicted
    info = wait_for(
        lambda: (i := http.get("/server_info").json())["slot_accounting_when_idle"].get("checked") and i,
        what="the engine to go idle",
    )
    assert info["slot_accounting_when_idle"]["ok"], info["slot_accounting_when_idle"]
    assert info["step_errors"] == 0 and info["max_total_num_tokens"] == FULL
    metrics = http.get("/metrics").text
    assert f"snugkv_kv_max_total_num_tokens {float(FULL)}" in metrics
    assert info["kv_events"][-1] == {key: results[-1][key] for key in info["kv_events"][-1]}


def greedy_texts(http: httpx.Client, prompts: list[str]) -> list[str]:
    texts = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


@pytest.mark.parametrize("release", ["sleep", "release_memory_occupation"])
def test_sleep_answers_503_then_wake_gives_the_same_greedy_outputs(
    elastic_server: ServerProcess, http: httpx.Client, release: str
) -> None:
    pid = elastic_server.process.pid
    expected = greedy_texts(http, PROMPTS[:3])
    weights_bytes = http.get("/is_sleeping").json()["weights_committed_bytes"]
    assert weights_bytes > 400 << 20  # SmolLM2's 135M parameters in float32
    before = rss_bytes(pid)
    if release == "sleep":
        slept = http.post("/sleep", params={"level": 1})
    else:  # SGLang's name, level 2: the weights are dropped and read again from the GGUF on wake
        slept = http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"], "level": 2})
    assert slept.status_code == 200, slept.text
    state = http.get("/is_sleeping").json()
    assert state["is_sleeping"] and state["sleeping_tags"] == ["kv_cache", "weights"]
    assert state["kv_committed_bytes"] == 0 and state["weights_committed_bytes"] == 0
    # Level 1 on CPU copies the weights into ordinary host memory: only the KV cache leaves the
    # process. Level 2 drops the weights too.
    released = slept.json()["from_committed_bytes"] + (weights_bytes if release != "sleep" else 0)
    assert abs(before - rss_bytes(pid) - released) < 48 << 20, (before - rss_bytes(pid), released)
    body = {"prompt": "hello", "max_tokens": 4}
    assert "asleep" in openai_error(http.post("/v1/completions", json=body), 503)
    assert "asleep" in openai_error(http.post("/kv/resize", json={"max_total_num_tokens": 512}), 409)
    if release == "sleep":
        woke = http.post("/wake_up", params={"tags": "weights,kv_cache"})
    else:
        woke = http.post("/resume_memory_occupation", json={})
    assert woke.status_code == 200, woke.text
    assert woke.json()["to_tokens"] == FULL and not woke.json()["is_sleeping"]
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert greedy_texts(http, PROMPTS[:3]) == expected


def test_a_request_in_flight_waits_through_a_sleep_and_finishes(
    elastic_server: ServerProcess, http: httpx.Client
) -> None:
    result: dict = {}

    def long_request() -> None:
        with elastic_server.client(timeout=300.0) as client:
            body = {"prompt": "Count slowly:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            result["response"] = client.post("/v1/completions", json=body)

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_for(lambda: http.get("/kv").json()["num_running_requests"] == 1, what="the request to run")
    assert http.post("/sleep").status_code == 200
    assert http.get("/kv").json()["num_queued_requests"] == 1  # retracted to the queue, not lost
    time.sleep(0.3)
    assert http.post("/wake_up").status_code == 200
    thread.join(timeout=300)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 48


@pytest.mark.parametrize(
    ("path", "params", "says"),
    [("/sleep", {"level": 3}, "level must be 1"), ("/sleep", {"level": "x"}, "level must be 1"),
     ("/wake_up", {"tags": "gpu"}, "unknown tag(s) gpu")],
)  # fmt: skip
def test_bad_sleep_and_wake_requests_get_a_400(
    http: httpx.Client, path: str, params: dict, says: str
) -> None:
    assert says in openai_error(http.post(path, params=params), 400)
    assert http.get("/is_sleeping").json()["is_sleeping"] is False


@pytest.mark.parametrize(
    ("path", "request_fields", "shown"),
    [("/sleep", {"params": {"level": 7}}, "'7'"), ("/sleep", {"params": {"level": "x"}}, "'x'"),
     ("/release_memory_occupation", {"json": {"level": 0}}, "0")],
)  # fmt: skip
def test_a_sleep_level_other_than_1_or_2_is_an_invalid_parameter_naming_level(
    http: httpx.Client, path: str, request_fields: dict, shown: str
) -> None:
    error = http.post(path, **request_fields).json()["error"]
    assert (error["param"], error["code"]) == ("level", "invalid_parameter"), error
    assert (
        error["message"]
        == f"level must be 1 (weights kept in host memory) or 2 (weights dropped), got {shown}."
    )
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
