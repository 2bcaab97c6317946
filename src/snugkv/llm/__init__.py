"""The Python API for offline work: `LLM(model).generate(prompts, SamplingParams(...))`.

    llm       LLM: the engine in an object (generate, chat, memory, stats, close)
    runtime   what an open LLM holds, and the loop of a call; GenerationError
    options   keyword options -> EngineArgs, checked as the command line checks its flags
    outputs   RequestOutput, RequestTimes; the collector of the scheduler's outputs

It sits beside the server (floor 8): it drives an engine core (snugkv.driver) in the caller's
thread, as the server's engine thread does on its own, and nothing below it knows it exists.
"""

from snugkv.core.reports import MemoryReport
from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.core.structured_output import StructuredOutput
from snugkv.engine import InvalidEngineArgs
from snugkv.llm.llm import LLM
from snugkv.llm.outputs import RequestOutput, RequestTimes
from snugkv.llm.runtime import GenerationError

__all__ = [
    "LLM",
    "GenerationError",
    "InvalidEngineArgs",
    "InvalidRequest",
    "MemoryReport",
    "RequestOutput",
    "RequestTimes",
    "SamplingParams",
    "StructuredOutput",
]
