"""POST /kv/resize says in its answer what it freed, and warns when a shrink freed nothing (the
host backend keeps a buffer's top extension whole when it has no memory to split it in); a body
that is not UTF-8 is a 400 on the memory routes."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from snugkv.server.app import create_app
from tests.server.fake_engine import FakeEngine

MIB = 1 << 20


class ResizeAnswer:
    """The fields of a `core.reports.KvResizeReply` that the answer's freed-memory note reads."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def to_dict(self) -> dict[str, Any]:
        return self.fields


class ResizableFakeEngine(FakeEngine):
    def __init__(self, freed_bytes: int) -> None:
        super().__init__()
        self.freed_bytes = freed_bytes

    async def resize_kv(
        self, *, max_total_num_tokens: int | None = None, free_gib: float | None = None
    ) -> Any:
        before = 1024 * MIB
        return ResizeAnswer(
            {
                "reason": "resize",
                "from_tokens": 23300,
                "to_tokens": max_total_num_tokens,
                "from_committed_bytes": before,
                "to_committed_bytes": before - self.freed_bytes,
                "kv": {"chunk_bytes": 256 * MIB},
            }
        )


def resize(freed_bytes: int) -> dict[str, Any]:
    app = create_app(
        ResizableFakeEngine(freed_bytes), api_key=None, max_body_bytes=1024, served_model_name="m"
    )
    with TestClient(app) as client:
        response = client.post("/kv/resize", json={"max_total_num_tokens": 1000})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_shrink_that_frees_nothing_says_so_in_its_answer() -> None:
    answer = resize(freed_bytes=0)
    assert answer["freed_bytes"] == 0
    assert "no memory was freed" in answer["warning"] and "--kv-chunk-mib" in answer["warning"]
    assert "256 MiB" in answer["warning"]


def test_a_shrink_that_frees_memory_reports_it_without_a_warning() -> None:
    answer = resize(freed_bytes=512 * MIB)
    assert answer["freed_bytes"] == 512 * MIB and "warning" not in answer


def test_a_body_that_is_not_utf8_is_a_400_on_the_memory_routes() -> None:
    """Found by the fuzzer (tests/server/test_fuzz.py): these bodies were a 500 (UnicodeDecodeError)."""
    app = create_app(ResizableFakeEngine(0), api_key=None, max_body_bytes=1024, served_model_name="m")
    with TestClient(app) as client:
        for route in ("/kv/resize", "/release_memory_occupation", "/resume_memory_occupation"):
            response = client.post(route, content=b"\x8e ]", headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (route, response.text)
            assert "not UTF-8" in response.json()["error"]["message"]
