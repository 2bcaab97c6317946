"""Models named by a Hugging Face Hub id (`Org/Name`): fetched into, or found in, the Hub cache.

Only what the engine reads is downloaded: safetensors weights and their index, the config, the
generation config and the tokenizer files. `huggingface_hub` does the work, so its settings hold:
`HF_HOME` / `HF_HUB_CACHE` (where the cache lives), `HF_HUB_OFFLINE=1` (the cache only), `HF_TOKEN`
or a saved login (gated and private models), and its progress bars. Every failure is one
`ModelLoadError` line saying what to do. A local path that exists is never looked up here.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


class HubModelError(ValueError):
    """A Hub model that cannot be had; the message says what to do."""


def is_hub_id(model: str) -> bool:
    """`Org/Name`, the shape of a Hub repository id (a caller checks first that no such path exists)."""
    return _HUB_ID.fullmatch(model) is not None and ".." not in model


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (default: main), downloaded if needed."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise HubModelError(
            f"{repo_id} looks like a Hugging Face Hub id, but huggingface_hub is not installed; "
            "pip install huggingface_hub, or pass a local model directory"
        ) from None
    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILE_PATTERNS)))
    except GatedRepoError:
        raise HubModelError(
            f"{at} is gated: accept its terms on huggingface.co, then set HF_TOKEN (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelError(
            f"{repo_id} is not a model on the Hugging Face Hub (or it is private: set HF_TOKEN); "
            "check the id, or pass a local model directory"
        ) from None
    except RevisionNotFoundError:
        raise HubModelError(
            f"{repo_id} has no revision {revision!r}; pass a branch, tag or commit that exists"
        ) from None
    except LocalEntryNotFoundError:
        raise HubModelError(
            f"{at} is not in the Hugging Face cache and cannot be downloaded (offline: HF_HUB_OFFLINE is "
            "set or the Hub is unreachable); download it once with network access "
            f"(`hf download {repo_id}`), point HF_HOME at a cache that has it, or pass a local directory"
        ) from None
    except (OSError, HfHubHTTPError) as exc:
        raise HubModelError(
            f"{at}: downloading from the Hugging Face Hub failed ({exc}); try again"
        ) from None
