"""Sleep and wake: an engine gives back its KV cache, its weights and (when named) its graphs, and
takes them back at the same addresses, so graphs captured once stay valid.

Post-capture only: the KV cache and the weights live in virtual memory whose addresses never
change. Sleep decommits the KV cache (the dummy page included; every slot must be free: the
scheduler's elastic module retracts first) and offloads the weights (level 1 keeps a copy in
pinned host memory, level 2 drops them); `cuda_graph` also releases the graphs and their pool.
Wake takes them back in `WAKE_ORDER`, each sized or captured from what the ones before leave: the
weights at their addresses (copied back, or loaded again from the model files or the dummy seed),
the graphs captured again, then the KV cache sized from the free memory measured now (the KV
sizing object's `back_after_sleep`, the same steps as at start-up), not the old number.

`EngineSleep` owns what sleeps (tags, level, the token history's vocabulary) and never sizes the
KV cache itself; the engine records each change in its report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch

from snugkv.core.reports import KvResize, SleepState
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.engine.kv_sizing import KvSizing
from snugkv.models.loader import LoadedModel, fill_weights
from snugkv.sizing.measure import settle
from snugkv.sizing.modes import SizingMode
from snugkv.sizing.resize import KvResizeError

SLEEP_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})  # what sleep can release (SGLang's names)
# Without tags sleep keeps the graphs (wake needs no capture); naming `cuda_graph` releases their
# memory pool too, and wake captures them again (before the KV cache is sized, as at start-up).
DEFAULT_SLEEP_TAGS = frozenset({"weights", "kv_cache"})
WAKE_ORDER = ("weights", "cuda_graph", "kv_cache")  # each is sized or captured from the ones before


def check_tags(tags: Collection[str] | None, default: frozenset[str] = DEFAULT_SLEEP_TAGS) -> frozenset[str]:
    """The tags to act on (none given: `default`), or `KvResizeError` naming the unknown ones."""
    if not tags:
        return default
    given = frozenset(tags)
    unknown = sorted(given - SLEEP_TAGS)
    if unknown:
        names = ", ".join(sorted(SLEEP_TAGS))
        raise KvResizeError(f"unknown tag(s) {', '.join(unknown)}; tags are {names}", param="tags")
    return given


class EngineSleep:
    """What sleeps of one engine, and the sleeping and waking of it. `capture_graphs` and
    `release_graphs` are the engine's (it counts the graphs' memory)."""

    def __init__(
        self,
        *,
        mode: SizingMode,
        loaded: LoadedModel,
        kv: KvSizing,
        draft: LoadedModel | None = None,
        tp: TensorParallel,
        device: torch.device,
        capture_graphs: Callable[[], object],
        release_graphs: Callable[[], None],
    ) -> None:
        self.mode = mode
        self.loaded = loaded
        self.draft = draft  # a separate draft model's weights sleep and wake with the model's
        self.kv = kv
        self.tp = tp
        self.device = device
        self._capture_graphs = capture_graphs
        self._release_graphs = release_graphs
        self.sleeping_tags: frozenset[str] = frozenset()  # what sleep released
        self.level = 0  # of the last sleep that released the weights: 1 keeps them on the host, 2 drops them
        self._history_vocab: int | None = None  # the token history's, while the KV cache sleeps

    def _models(self) -> list[LoadedModel]:
        return [self.loaded] if self.draft is None else [self.loaded, self.draft]

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def state(self) -> SleepState:
        weights = self.loaded.weights
        return SleepState(
            sleeping_tags=self.sleeping_tags,
            level=self.level if "weights" in self.sleeping_tags else None,
            weights_in_host_memory=weights is not None and weights.holds_host_copy,
            kv_committed_bytes=self.kv.pool.committed_bytes,
            weights_committed_bytes=(
                sum(m.weights.committed_bytes for m in self._models() if m.weights is not None)
                if weights is not None
                else None
            ),
        )

    def check(self, level: int, tags: Collection[str] | None) -> frozenset[str]:
        """The tags a sleep at `level` releases, or `KvResizeError` saying why it cannot."""
        if level not in (1, 2):
            raise KvResizeError(
                f"level must be 1 (weights kept in host memory) or 2 (weights dropped), got {level!r}",
                param="level",
            )
        chosen = check_tags(tags)
        if self.mode is not SizingMode.POST_CAPTURE or self.loaded.weights is None:
            raise KvResizeError(
                f"this engine sized its KV cache with --kv-sizing {self.mode}, which keeps the weights and the "
                "KV cache in torch's allocator; start it with --kv-sizing post-capture to sleep",
                status=409,
            )
        return chosen

    def sleep(self, level: int, tags: Collection[str] | None, *, max_running_requests: int) -> KvResize:
        """Release the KV cache and/or the weights (`tags`, default both) and, if `cuda_graph` is
        named, the captured graphs. Level 1 copies the weights to host memory, level 2 drops them
        (wake reloads them from the model files)."""
        chosen = self.check(level, tags) - self.sleeping_tags
        kv, runner = self.kv, self.kv.runner
        allocator = runner.allocator
        if "kv_cache" in chosen and allocator.available_tokens != allocator.capacity_tokens:
            raise KvResizeError(
                f"{allocator.capacity_tokens - allocator.available_tokens} KV tokens are still held; finish or "
                "retract the requests and empty the prefix cache before the KV cache sleeps",
                status=409,
            )
        started = time.perf_counter()
        old_tokens, old_bytes = kv.pool.committed_tokens, kv.pool.committed_bytes
        if "kv_cache" in chosen:
            kv.release()
            self._history_vocab = runner.release_token_history()  # rows are set again on prefill
        if "cuda_graph" in chosen:
            self._release_graphs()
        if "weights" in chosen and self.loaded.weights is not None:
            for loaded in self._models():
                if loaded.weights is not None:
                    loaded.weights.offload(keep=level == 1)
            self.level = level
        settle(self.device)
        self.sleeping_tags |= chosen
        tokens = 0 if "kv_cache" in self.sleeping_tags else old_tokens
        return KvResize(
            "sleep",
            old_tokens,
            tokens,
            old_bytes,
            kv.pool.committed_bytes,
            max_running_requests,
            (time.perf_counter() - started) * 1e3,
        )

    def wake_up(self, tags: Collection[str] | None, *, max_running_requests: int) -> KvResize:
        """Take back what sleep released (`tags`, default all), in `WAKE_ORDER`; the KV cache is
        sized again from the free memory measured now (MIN over ranks, less the headroom, under
        the caps) and committed at its old addresses, so kept graphs run as they are."""
        chosen = check_tags(tags, default=SLEEP_TAGS) & self.sleeping_tags
        left = self.sleeping_tags - chosen
        for index, tag in enumerate(WAKE_ORDER):
            before = [earlier for earlier in WAKE_ORDER[:index] if earlier in left]
            if tag in chosen and before:
                raise KvResizeError(
                    f"wake {before[0]} before {tag} ({tag} is captured or sized from what the ones before it "
                    f"leave free): pass tags={before[0]} first, or both",
                    status=409,
                    param="tags",
                )
        kv = self.kv
        started = time.perf_counter()
        if "weights" in chosen:
            for loaded in self._models():
                if loaded.weights is not None and not loaded.weights.restore():
                    with use_tensor_parallel(self.tp):  # level 2: the same files (or seed) again
                        fill_weights(loaded)
        if "cuda_graph" in chosen:
            if "kv_cache" in self.sleeping_tags:
                kv.pool.ensure_prefix()  # graphs write their padding rows' K/V to the dummy page
            self._capture_graphs()
        tokens = kv.pool.committed_tokens
        if "kv_cache" in chosen:
            kv.runner.restore_token_history(self._history_vocab)
            tokens = kv.back_after_sleep()
            max_running_requests = kv.recap(tokens)
        self.sleeping_tags -= chosen
        return KvResize(
            "wake",
            0,
            tokens,
            0,
            kv.pool.committed_bytes,
            max_running_requests,
            (time.perf_counter() - started) * 1e3,
        )
