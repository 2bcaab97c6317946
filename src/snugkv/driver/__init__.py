"""The driver layer: what runs an engine core, between the scheduler below and the server and the
Python API above. ("Driver" as in what drives the engine's turns; the CUDA driver is elsewhere.)

    engine_core     EngineCore: one rank's engine, tokenizer and scheduler; the one place that
                    assembles them; share a turn, apply its commands, step
    commands        the commands of a turn (Add, Abort, ResizeKV, Sleep, WakeUp, Stop, ...)
    engine_thread   EngineThread: the core on a scheduler thread behind an asyncio client (serve)
    engine_process  EngineProcess: the core and its thread in a process of their own (serve's default)
    wire            the typed messages of the engine process's pipe, each call declared once
    follower        the one loop of the helper ranks of `--tp N`

The Python API (snugkv.llm) and the interactive commands drive a core in the caller's thread.
Nothing here parses HTTP or formats a response; nothing below imports this layer.
"""
