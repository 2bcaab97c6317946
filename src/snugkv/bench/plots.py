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
SMALLEST_SHOWN_GIB = 0.005  # below this a part shows as 0.00 GiB: no legend entry for it
INLINE_LABEL_SHARE = 0.04  # segments at least this share of the tallest bar carry their GiB inside


def ledger_parts(ledgers: dict[str, MemoryLedger]) -> list[tuple[str, str, list[float]]]:
    """(legend label, color, GiB per ledger) of each part that is not empty in some ledger; the
    label carries the GiB of every bar, in bar order (a thin slice is still read there)."""
    parts = []
    for label, attribute, color in PARTS:
        values = []
        for ledger in ledgers.values():
            if attribute == "weights_bytes" and not ledger.weights_in_device_memory:
                values.append(0.0)
            else:
                values.append(max(getattr(ledger, attribute), 0) / GIB)
        if max(values) < SMALLEST_SHOWN_GIB:
            continue
        parts.append((f"{label}: {' / '.join(f'{value:.2f}' for value in values)} GiB", color, values))
    return parts


def plot_ledgers(ledgers: dict[str, MemoryLedger], path: str, title: str) -> None:
    """One stacked bar per ledger (e.g. per sizing mode), in GiB, each segment labelled with its GiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(2.2 + 1.6 * len(ledgers), 5))
    names = list(ledgers)
    parts = ledger_parts(ledgers)
    tallest = max((sum(values) for values in zip(*(v for _, _, v in parts))), default=0.0)
    bottoms = [0.0] * len(names)
    for label, color, values in parts:
        bars = axes.bar(names, values, bottom=bottoms, color=color, label=label, width=0.6)
        inline = [f"{value:.2f}" if value >= INLINE_LABEL_SHARE * tallest else "" for value in values]
        axes.bar_label(bars, labels=inline, label_type="center", fontsize=8)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes.set_ylabel("GiB")
    axes.set_title(title, fontsize=10)
    legend_title = "GiB per bar, left to right" if len(names) > 1 else None
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title=legend_title, title_fontsize=8)
    # The legend sits outside the axes and the title may be wider than the bars: save what is drawn.
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
