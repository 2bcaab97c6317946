"""The engine: start-up (snugkv.engine.pipeline), run-time resize/sleep/wake (snugkv.engine.elastic),
and its flags (snugkv.engine.args)."""

from snugkv.engine.args import EngineArgs, InvalidEngineArgs
from snugkv.engine.elastic import DEFAULT_SLEEP_TAGS, SLEEP_TAGS, ElasticMemory
from snugkv.engine.pipeline import Engine
from snugkv.engine.report import SizedKV

__all__ = [
    "DEFAULT_SLEEP_TAGS",
    "SLEEP_TAGS",
    "ElasticMemory",
    "Engine",
    "EngineArgs",
    "InvalidEngineArgs",
    "SizedKV",
]
