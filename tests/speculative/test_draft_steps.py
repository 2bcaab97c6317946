"""The draft steps' loop (snugkv.runner.draft_steps) against a stand-in runner, no model: what each
step hands the runner, without a forward's cost."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from snugkv.core.sampling import SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.memory.req_to_token import ReqToTokenPool
from snugkv.runner.draft_steps import DraftRow, run_draft_steps

VOCAB = 11


class RecordingRunner:
    """A `DraftRunner` whose model drafts `last token + 1` and which keeps every step's slots."""

    def __init__(self) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_requests=4, max_context_len=16)
        self.model = SimpleNamespace(config=SimpleNamespace(num_layers=2))
        self.draft_model = None
        self.draft_kv = None
        self.attn_backend = None
        self.sampler = None
        self.tp = TensorParallel()
        self.step_slots: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return self.req_to_token_pool.req_to_token.device

    def build_batch(self, rows, out_cache_loc):
        self.step_slots.append(out_cache_loc)
        return SimpleNamespace(input_ids=torch.tensor([row.token_ids[0] for row in rows]))

    def forward_batch(self, forward_batch):
        return torch.nn.functional.one_hot((forward_batch.input_ids + 1) % VOCAB, VOCAB).float()


def test_each_draft_step_gets_its_slots_as_the_devices_int64_not_the_host_tables_int32():
    """The slots come from the host copy of the table (int32); handed on as they are, the forward
    batch would copy them up with a plain `.to(device)`, which on a GPU makes the host wait for the
    step before at every draft step."""
    runner = RecordingRunner()
    table = runner.req_to_token_pool
    table.write_positions(torch.tensor([1, 1, 1]), torch.tensor([5, 6, 7]), torch.tensor([40, 41, 42]))
    table.write_positions(torch.tensor([2, 2]), torch.tensor([3, 4]), torch.tensor([20, 21]))
    rows = [DraftRow(1, 5, 3, 3), DraftRow(2, 3, 7, 2)]
    drafts = run_draft_steps(runner, rows, [SamplingParams()] * 2, None, num_layers=2)
    assert drafts.token_ids == [[4, 5, 6], [8, 9]]
    assert [slots.tolist() for slots in runner.step_slots] == [[40, 20], [41, 21], [42]]
    for slots in runner.step_slots:
        assert slots.dtype == torch.int64 and slots.device == runner.device
