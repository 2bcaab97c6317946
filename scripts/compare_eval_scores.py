"""Compare two lm-evaluation-harness result folders task by task and metric by metric, and the
generated texts sample by sample; exit 1 if any score differs by more than the tolerance (relative
1e-4) or any generated text differs, printing a table either way."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

TOLERANCE = 1e-4


def scores(folder: Path) -> dict[str, dict[str, float]]:
    newest = max(folder.rglob("results_*.json"), key=lambda path: path.stat().st_mtime)
    results = json.loads(newest.read_text())["results"]
    return {
        task: {
            name: value
            for name, value in metrics.items()
            if isinstance(value, float) and "stderr" not in name
        }
        for task, metrics in results.items()
    }


def generations(folder: Path) -> list[str]:
    """Every generated text of the generation tasks' logged samples, in task and document order."""
    texts = []
    for path in sorted(folder.rglob("samples_*gen*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        texts += [str(sample["resps"]) for sample in sorted(lines, key=lambda sample: sample["doc_id"])]
    return texts


def main() -> int:
    served, reference = scores(Path(sys.argv[1])), scores(Path(sys.argv[2]))
    worst = 0.0
    print(f"{'task':<18} {'metric':<26} {'snugkv serve':>14} {'hf':>14}")
    for task in sorted(reference):
        for metric, expected in sorted(reference[task].items()):
            got = served.get(task, {}).get(metric, math.nan)
            gap = abs(got - expected) / max(abs(expected), 1e-12)
            worst = max(worst, gap if not math.isnan(got) else math.inf)
            print(f"{task:<18} {metric:<26} {got:>14.6f} {expected:>14.6f}")
    print(f"largest relative difference: {worst:.2e} (tolerance {TOLERANCE:g})")
    served_texts, reference_texts = generations(Path(sys.argv[1])), generations(Path(sys.argv[2]))
    same = sum(a == b for a, b in zip(served_texts, reference_texts))
    print(f"generated texts equal: {same} of {len(reference_texts)}")
    texts_equal = len(served_texts) == len(reference_texts) and same == len(reference_texts)
    return 0 if worst <= TOLERANCE and texts_equal else 1


if __name__ == "__main__":
    sys.exit(main())
