"""Where the seconds of a py-spy recording went, per process and thread (scripts/startup_check.py
--py-spy writes one: `py-spy record --subprocesses --idle --threads --format raw --rate R`).

    python3 scripts/py_spy_summary.py OUT/startup-pyspy/py-spy-llama-3-8b.txt [--rate 100] [--top 30]
        [--match snugkv]

Each line of the recording is a stack (`process ...;thread (...): NAME;frame;...;frame COUNT`), the
outermost frame first. For every thread this prints its seconds
(samples / rate: wall clock, idle included) and the frames most of them were under (inclusive
seconds, each frame counted once a stack), those whose text contains `--match` when given; threads
under `--min-seconds` (0.5) are left out.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

# a process's command line may hold ";" (a spawned child's `-c` code): it ends at `";` before the next
# process or the thread
_PROCESS = re.compile(r'process (\d+):"(.*?)";(?=process |thread \()')


def parse(path: Path) -> dict[tuple[str, str], list[tuple[list[str], int]]]:
    """(process, thread) -> [(frames outermost first, samples)]; the process is the innermost one."""
    threads: dict[tuple[str, str], list[tuple[list[str], int]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        process = "?"
        while found := _PROCESS.match(stack):
            pid, command = found.groups()
            process, stack = f"{pid} {short(command)}", stack[found.end() :]
        thread, *frames = stack.split(";")
        threads[(process, thread)].append((frames, int(count)))
    return threads


def short(command: str) -> str:
    """A command line cut to what tells the processes apart."""
    for marker in ("snugkv.kernels.compile_worker", "multiprocessing.spawn", "-m snugkv serve"):
        if marker in command:
            return marker
    return command[:60]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", type=Path)
    parser.add_argument("--rate", type=float, default=100.0, help="samples a second it was recorded at")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="", help="only frames whose text contains this")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="leave out threads with fewer")
    args = parser.parse_args(argv)
    threads = parse(args.recording)
    for (process, thread), stacks in sorted(threads.items(), key=lambda item: -sum(c for _, c in item[1])):
        samples = sum(count for _, count in stacks)
        if samples < args.min_seconds * args.rate:
            continue
        print(f"\n== {process} | {thread}: {samples / args.rate:.2f} s")
        inclusive: Counter[str] = Counter()
        for frames, count in stacks:
            for frame in set(frames):
                if args.match in frame:
                    inclusive[frame] += count
        for frame, count in inclusive.most_common(args.top):
            print(f"  {count / args.rate:7.2f} s  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
