"""Hub ids (`Org/Name`) resolve through huggingface_hub's own cache, offline: a snapshot laid out as
the Hub library lays it out is found by branch and by commit; a model the cache lacks is one line
saying what to do; a local path that exists wins over a Hub id of the same spelling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snugkv.models.hub import is_hub_id
from snugkv.models.loader import ModelLoadError, resolve_model_source
from tests.models.hf_tiny import save_tiny_hf_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME with `tiny-org/tiny-llama` at COMMIT (refs/main points at it), and no network."""
    home = tmp_path / "hf-home"
    repo = home / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    save_tiny_hf_model("llama", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    # huggingface_hub reads the environment when it is imported: point its constants at this cache.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_cache: Path) -> None:
    source = resolve_model_source("tiny-org/tiny-llama")
    assert source.kind == "hf" and source.path == hub_cache
    assert json.loads((source.path / "config.json").read_text())["model_type"] == "llama"
    assert resolve_model_source("tiny-org/tiny-llama", revision=COMMIT).path == hub_cache


def test_a_model_missing_offline_is_one_line_saying_what_to_do(hub_cache: Path) -> None:
    with pytest.raises(ModelLoadError) as raised:
        resolve_model_source("tiny-org/not-cached")
    message = str(raised.value)
    assert "\n" not in message
    assert "tiny-org/not-cached" in message and "HF_HUB_OFFLINE" in message and "hf download" in message
    with pytest.raises(ModelLoadError, match="tiny-org/tiny-llama@v9"):
        resolve_model_source("tiny-org/tiny-llama", revision="v9")


def test_a_local_path_that_exists_wins_over_a_hub_id(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "work"
    (local / "tiny-org" / "tiny-llama").mkdir(parents=True)
    save_tiny_hf_model("llama", local / "tiny-org" / "tiny-llama")
    monkeypatch.chdir(local)
    assert resolve_model_source("tiny-org/tiny-llama").path == Path("tiny-org/tiny-llama")


def test_what_counts_as_a_hub_id() -> None:
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("meta-llama/Llama-3.1-8B")
    for not_an_id in ("model.gguf", "/abs/path", "./org/name", "a/b/c", "org/..", "org/"):
        assert not is_hub_id(not_an_id)
