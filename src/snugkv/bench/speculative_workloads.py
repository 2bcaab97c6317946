"""The fixed texts `snugkv bench speculative` sends: four kinds of chat work, written for this
benchmark (no dataset), each a few conversations that a batch cycles through.

- `code-edit`: a module in the prompt and a small change asked for; the answer repeats the code.
- `summarize`: a few paragraphs to summarize; the answer reuses their phrases.
- `chat`: three user turns, each re-sent with the history so far (the model's own replies in it).
- `open`: a request with nothing to copy from.

A `Conversation` is a list of user turns; the assistant's replies come from the model at run time.
This module holds text only: no engine, no tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Conversation:
    turns: tuple[str, ...]  # user messages, in order; replies are generated between them


def _code_edit(code: str, change: str) -> Conversation:
    return Conversation(
        (f"Here is a Python module:\n\n```python\n{code}```\n\n{change} Reply with the whole module.",)
    )


INVENTORY = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if name in self.items:
            self.items[name] += count
        else:
            self.items[name] = count

    def remove(self, name, count):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] -= count
        if self.items[name] <= 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
"""

CSV_READER = """def parse_line(line):
    parts = line.strip().split(",")
    name = parts[0]
    age = int(parts[1])
    city = parts[2]
    return {"name": name, "age": age, "city": city}


def load(path):
    rows = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                rows.append(parse_line(line))
    return rows
"""

TEMPERATURES = """def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


def describe(celsius):
    if celsius < 0:
        return "freezing"
    if celsius < 15:
        return "cold"
    if celsius < 25:
        return "mild"
    return "hot"
"""

CODE_EDIT = (
    _code_edit(CSV_READER, "Rename the function `parse_line` to `parse_row` everywhere."),
    _code_edit(
        INVENTORY, "Add a method `count(self, name)` that returns how many of `name` are held (0 if none)."
    ),
    _code_edit(TEMPERATURES, "Add type hints (float in, float or str out) to every function."),
)

HARBOUR = """The town of Kessling grew up around a small harbour on the north coast. For two centuries its \
people fished for herring, and the harbour was crowded every autumn when the shoals came close to shore. \
Families owned their boats for generations, and the market by the quay sold most of the catch before noon.

In the 1970s the herring stocks collapsed. Catches fell by more than half within ten years, and many \
families sold their boats. The fish market closed in 1984, and the population of the town dropped from \
about nine thousand to under six thousand as young people moved to the cities for work.

Recovery came slowly and from an unexpected direction. A marine research station opened in the old \
market hall in 1996, bringing scientists and students to the town. Small hotels and cafes followed, and \
the harbour now holds more sailing boats than fishing boats. The population has grown again to about \
seven thousand, although the town's older residents say it no longer feels like a fishing town."""

BATTERIES = """Lithium-ion batteries power most phones, laptops and electric cars. Each cell holds two \
electrodes separated by an electrolyte. When the battery charges, lithium ions move from the positive \
electrode to the negative one; when it discharges, they move back and release energy.

Batteries wear out because every cycle of charging and discharging causes small, permanent changes. A thin \
layer forms on the negative electrode and slowly grows, trapping lithium that can no longer carry charge. \
Heat speeds this up, which is why a phone left in a hot car loses capacity faster than one kept cool.

There are simple ways to make a battery last longer. Avoid keeping it at full charge for long periods, avoid \
letting it run completely empty, and keep it away from heat. Many devices now stop charging at eighty \
percent for this reason, and electric cars often recommend a daily charging limit below full."""

SUMMARIZE = (
    Conversation((f"Summarize the following text in one paragraph.\n\n{HARBOUR}",)),
    Conversation((f"Summarize the following text in three bullet points.\n\n{BATTERIES}",)),
)

CHAT = (
    Conversation(
        (
            "I want to start running. Give me a plan for the first four weeks, three runs a week.",
            "That looks hard for week one. Write the plan again with shorter runs in the first two weeks.",
            "Thanks. Now write the same plan as a short checklist I can print.",
        )
    ),
    Conversation(
        (
            "List five things to pack for a weekend of camping in the mountains.",
            "Add two more items for cold nights and write the whole list again.",
            "Which of the items on your list are the heaviest? Repeat the list sorted from heaviest to lightest.",
        )
    ),
)

OPEN = (
    Conversation(("Write a short story about a lighthouse keeper who finds a message in a bottle.",)),
    Conversation(("Explain why the sky is blue to a ten-year-old.",)),
    Conversation(("Give me three ideas for a birthday party for a friend who likes board games.",)),
    Conversation(("Describe a quiet morning in a city you have never visited.",)),
)

WORKLOADS: dict[str, tuple[Conversation, ...]] = {
    "code-edit": CODE_EDIT,
    "summarize": SUMMARIZE,
    "chat": CHAT,
    "open": OPEN,
}


def batch_of(workload: str, batch: int) -> list[Conversation]:
    """`batch` conversations of `workload`, cycling through its texts."""
    conversations = WORKLOADS[workload]
    return [conversations[i % len(conversations)] for i in range(batch)]


def waves(items: Sequence[T], batch: int) -> list[list[T]]:
    """What one pass at `batch` runs, one wave after another: at batch 1 each item alone, so a row
    covers all of a workload's texts; else `batch` items at once, cycling through them."""
    if batch == 1:
        return [[item] for item in items]
    return [[items[i % len(items)] for i in range(batch)]]


def waves_of(workload: str, batch: int) -> list[list[Conversation]]:
    """`waves` of `workload`'s conversations."""
    return waves(WORKLOADS[workload], batch)
