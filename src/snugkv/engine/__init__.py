"""The engine: start-up and the run-time changes of its memory (snugkv.engine.pipeline; its phases
in memory_backend, blocks, capture, post_capture_start and static_start), the KV cache's size
(snugkv.engine.kv_sizing), sleep and wake (snugkv.engine.sleep), and its flags (snugkv.engine.args)."""

from snugkv.engine.args import EngineArgs, InvalidEngineArgs
from snugkv.engine.kv_sizing import KvSizing
from snugkv.engine.pipeline import Engine
from snugkv.engine.sleep import DEFAULT_SLEEP_TAGS, SLEEP_TAGS

__all__ = [
    "DEFAULT_SLEEP_TAGS",
    "SLEEP_TAGS",
    "Engine",
    "EngineArgs",
    "InvalidEngineArgs",
    "KvSizing",
]
