"""`snugkv serve` spawns its engine process before it imports torch or the HTTP stack itself, so the two
processes' imports overlap (issue 26, start-up time): checked in a fresh interpreter, where nothing
is imported yet, by replacing the spawn with a probe of what is loaded at that moment."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import json, sys
    import snugkv.commands.engine_spawn as engine_spawn

    class Probe(SystemExit):
        pass

    def probe(flags):
        loaded = {name: name in sys.modules for name in ("torch", "fastapi", "uvicorn", "triton")}
        print(json.dumps({"loaded": loaded, "device": flags.device, "port": flags.port}))
        raise Probe(0)

    engine_spawn.start_from_flags = probe
    from snugkv.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def spawn_time_modules(*argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_process_is_spawned_before_torch_or_the_server_stack_is_imported():
    seen = spawn_time_modules()
    assert seen["loaded"] == {"torch": False, "fastapi": False, "uvicorn": False, "triton": False}


def test_an_explicit_device_is_checked_without_torch_at_parse_time():
    seen = spawn_time_modules("--device", "cuda:1")
    assert seen["device"] == "cuda:1" and not seen["loaded"]["torch"]
