"""Charts for benchmark reports (matplotlib, imported only when a chart is asked for)."""

from __future__ import annotations

from snugkv.memory.vmm import GIB
from snugkv.sizing.ledger import MemoryLedger

PARTS = (
    ("baseline", "baseline_bytes", "#9e9e9e"),
    ("weights", "weights_bytes", "#5c6bc0"),
    ("graphs + buffers", "graphs_and_buffers_bytes", "#ffa726"),
    ("KV committed", "kv_committed_bytes", "#66bb6a"),
    ("unaccounted", "unaccounted_bytes", "#ef5350"),
    ("free", "free_bytes", "#e0e0e0"),
)


def plot_ledgers(ledgers: dict[str, MemoryLedger], path: str, title: str) -> None:
    """One stacked bar per ledger (e.g. per sizing mode), in GiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(2.2 + 1.6 * len(ledgers), 5))
    names = list(ledgers)
    bottoms = [0.0] * len(names)
    for label, attribute, color in PARTS:
        values = []
        for name in names:
            ledger = ledgers[name]
            if attribute == "weights_bytes" and not ledger.weights_in_device_memory:
                values.append(0.0)
            else:
                values.append(max(getattr(ledger, attribute), 0) / GIB)
        axes.bar(names, values, bottom=bottoms, color=color, label=label, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes.set_ylabel("GiB")
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
