"""`snugkv serve` start-up choices, with the engine and uvicorn replaced by recorders: where the
API key comes from, and the warning for a server open to other machines."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from snugkv.cli import main


@pytest.fixture()
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `serve` would have started: create_app's keyword arguments."""
    import snugkv.commands.engine_spawn
    import snugkv.server.app
    import snugkv.server.launch
    from snugkv.commands import serve

    class NotStarted:
        def stop_unless_adopted(self) -> None: ...

    class NoEngine:
        def stop(self) -> None: ...

        def abort_all(self) -> None: ...

    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        serve, "build_engine_thread", lambda args, metrics, tp, **hooks: (NoEngine(), "model")
    )
    monkeypatch.setattr(serve, "build_engine_process", lambda args, **hooks: (NoEngine(), "model"))
    monkeypatch.setattr(snugkv.commands.engine_spawn, "start_from_flags", lambda args: NotStarted())
    monkeypatch.setattr(snugkv.server.app, "create_app", lambda engine, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(snugkv.server.launch, "serve", lambda app, **kwargs: None)
    monkeypatch.delenv("SNUGKV_API_KEY", raising=False)
    return seen


def test_the_api_key_comes_from_the_environment(started, monkeypatch):
    monkeypatch.setenv("SNUGKV_API_KEY", "from-env")
    assert main(["serve", "--port", "0"]) == 0
    assert started["api_key"] == "from-env"


def test_the_api_key_flag_wins_over_the_environment(started, monkeypatch):
    monkeypatch.setenv("SNUGKV_API_KEY", "from-env")
    assert main(["serve", "--port", "0", "--api-key", "from-flag"]) == 0
    assert started["api_key"] == "from-flag"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_an_open_address_without_a_key_is_warned_about(started, caplog, host):
    with caplog.at_level(logging.WARNING, logger="snugkv.commands.serve"):
        assert main(["serve", "--port", "0", "--host", host]) == 0
    assert started["api_key"] is None
    assert f"Serving on {host} without an API key" in caplog.text


@pytest.mark.parametrize(
    ("host", "key"), [("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "k")]
)
def test_loopback_or_a_key_needs_no_warning(started, caplog, monkeypatch, host, key):
    if key:
        monkeypatch.setenv("SNUGKV_API_KEY", key)
    with caplog.at_level(logging.WARNING, logger="snugkv.commands.serve"):
        assert main(["serve", "--port", "0", "--host", host]) == 0
    assert "without an API key" not in caplog.text
