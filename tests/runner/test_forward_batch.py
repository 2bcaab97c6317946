"""ForwardBatch layout and ModelRunner.allocate_slots: the contract the scheduler relies on."""

from __future__ import annotations

import pytest
import torch

from snugkv.attention.torch_backend import TorchAttentionBackend
from snugkv.core.forward import FUTURE_TOKEN, BatchRow, ForwardBatch, ForwardMode
from snugkv.core.sampling import SamplingParams
from tests.runner.tiny_runner import tiny_runner


def _build(rows):
    total = sum(len(r.token_ids) for r in rows)
    table = torch.zeros(4, 64, dtype=torch.int32)
    return ForwardBatch.build(
        rows, torch.arange(total), req_to_token=table, kv_pool=None, attn_backend=TorchAttentionBackend()
    )


def test_rows_are_concatenated_row_major_with_positions_after_each_prefix():
    fb = _build([BatchRow(1, 0, [5, 6, 7]), BatchRow(2, 4, [8]), BatchRow(3, 2, [9, 10], need_logits=False)])
    assert fb.mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert fb.positions.tolist() == [0, 1, 2, 4, 2, 3]
    assert fb.seq_lens.tolist() == [3, 5, 4] and fb.prefix_lens.tolist() == [0, 4, 2]
    assert fb.extend_lens.tolist() == [3, 1, 2] and fb.extend_start_loc.tolist() == [0, 3, 4]
    assert fb.logits_indices.tolist() == [2, 3]  # the last token of each row that wants logits
    assert fb.seq_lens_cpu == (3, 5, 4)


def test_all_single_token_rows_make_a_decode_batch():
    fb = _build([BatchRow(1, 4, [8]), BatchRow(2, 0, [3])])
    assert fb.is_decode and fb.logits_indices.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "at least one row"),
        ([BatchRow(1, 0, [])], "adds no tokens"),
        ([BatchRow(1, -1, [3])], "prefix_len"),
        ([BatchRow(1, 0, [3, FUTURE_TOKEN])], "only a decode row"),
        ([BatchRow(1, 2, [FUTURE_TOKEN], need_logits=False)], "only a decode row"),
        ([BatchRow(1, 0, [3, 4]), BatchRow(2, 2, [FUTURE_TOKEN])], "only a decode row"),  # behind a chunk
    ],
)
def test_malformed_rows_are_rejected(rows, message):
    with pytest.raises(ValueError, match=message):
        _build(rows)


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocate_slots_fills_the_table_and_keeps_page_offsets(page_size):
    runner = tiny_runner(page_size=page_size)
    table = runner.req_to_token_pool.req_to_token
    a, b = runner.req_to_token_pool.alloc(), runner.req_to_token_pool.alloc()
    first = runner.allocate_slots([BatchRow(a, 0, [1] * 6), BatchRow(b, 0, [2] * 3)])
    assert first.numel() == 9
    assert table[a, :6].tolist() == first[:6].tolist() and table[b, :3].tolist() == first[6:].tolist()
    decode = runner.allocate_slots([BatchRow(a, 6, [1]), BatchRow(b, 3, [2])])
    assert table[a, 6] == decode[0] and table[b, 3] == decode[1]
    extend = runner.allocate_slots([BatchRow(a, 7, [1, 1, 1])])
    assert table[a, 7:10].tolist() == extend.tolist()
    row = table[a, :10].long()
    assert bool((row >= page_size).all()), "the dummy page was handed out"
    assert (row % page_size).tolist() == [p % page_size for p in range(10)]
    assert len(set(row.tolist()) | set(table[b, :4].tolist())) == 14


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_full():
    runner = tiny_runner(max_total_tokens=16)
    row = runner.req_to_token_pool.alloc()
    before = runner.allocator.available_tokens
    assert runner.allocate_slots([BatchRow(row, 0, [1] * 17)]) is None
    assert runner.allocator.available_tokens == before
    assert int(runner.req_to_token_pool.req_to_token[row].abs().sum()) == 0


def test_allocate_slots_refuses_rows_longer_than_the_context():
    runner = tiny_runner(max_context_len=8)
    row = runner.req_to_token_pool.alloc()
    with pytest.raises(ValueError, match="context holds 8"):
        runner.allocate_slots([BatchRow(row, 0, [1] * 9)])


def test_a_mixed_steps_decode_rows_lead_and_may_read_the_previous_steps_token():
    fb = _build([BatchRow(1, 4, [FUTURE_TOKEN]), BatchRow(2, 3, [8]), BatchRow(3, 0, [5, 6, 7])])
    assert fb.mode is ForwardMode.EXTEND and fb.num_decode_rows == 2 and fb.reads_future_tokens
    assert fb.logits_indices.tolist() == [0, 1, 4]
    assert _build([BatchRow(1, 0, [5, 6]), BatchRow(2, 3, [8])]).num_decode_rows == 0


def test_a_mixed_step_reads_the_previous_steps_token_as_a_decode_step_does():
    """The same decode row, alone and ahead of a prompt, gives the same logits (its token read on
    the device both times); the prompt beside it gives what it gives alone."""
    runner = tiny_runner(page_size=4)
    a, b = (runner.req_to_token_pool.alloc() for _ in range(2))
    first = [BatchRow(a, 0, [5, 6, 7])]
    logits = runner.forward(first, runner.allocate_slots(first))
    runner.sample_on_device(logits, [SamplingParams()], None, [a])
    alone = [BatchRow(a, 3, [FUTURE_TOKEN])]
    decode_logits = runner.forward(alone, runner.allocate_slots(alone)).clone()
    runner.free_request_slots(a, 4)
    logits = runner.forward(first, runner.allocate_slots(first))
    runner.sample_on_device(logits, [SamplingParams()], None, [a])
    prompt = [BatchRow(b, 0, [9, 10, 11, 12])]
    prompt_logits = runner.forward(prompt, runner.allocate_slots(prompt)).clone()
    runner.free_request_slots(b, 4)
    mixed = [BatchRow(a, 3, [FUTURE_TOKEN]), BatchRow(b, 0, [9, 10, 11, 12])]
    both = runner.forward(mixed, runner.allocate_slots(mixed))
    torch.testing.assert_close(both[:1], decode_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1:], prompt_logits, rtol=1e-5, atol=1e-5)


def test_a_verify_step_is_a_decode_batch_of_one_row_per_position():
    fb = _build([BatchRow(1, 3, [7, 8, 9], draft_len=2), BatchRow(2, 5, [4], draft_len=0)])
    assert fb.is_decode and fb.batch_size == 4 and fb.num_decode_rows == 0
    assert fb.req_pool_indices.tolist() == [1, 1, 1, 2]
    assert fb.positions.tolist() == [3, 4, 5, 5] and fb.seq_lens.tolist() == [4, 5, 6, 6]
    assert fb.input_ids.tolist() == [7, 8, 9, 4] and fb.logits_indices.tolist() == [0, 1, 2, 3]


def test_a_verify_step_gives_the_logits_of_its_positions_as_a_prompt_scored_extend_does():
    runner = tiny_runner(page_size=4)
    a, b = (runner.req_to_token_pool.alloc() for _ in range(2))
    prompts = [BatchRow(a, 0, [5, 6, 7]), BatchRow(b, 0, [9, 10])]
    runner.forward(prompts, runner.allocate_slots(prompts))
    verify = [BatchRow(a, 3, [11, 12, 13], draft_len=2), BatchRow(b, 2, [14, 15], draft_len=1)]
    assert runner.build_batch(verify, torch.zeros(5, dtype=torch.int64)).is_decode
    decoded = runner.forward(verify, runner.allocate_slots(verify)).clone()
    runner.free_request_slots(a, 6)
    runner.free_request_slots(b, 4)
    runner.forward(prompts, runner.allocate_slots(prompts))
    scored = [BatchRow(a, 3, [11, 12, 13], prompt_logits=True), BatchRow(b, 2, [14, 15], prompt_logits=True)]
    assert not runner.build_batch(scored, torch.zeros(5, dtype=torch.int64)).is_decode
    torch.testing.assert_close(
        runner.forward(scored, runner.allocate_slots(scored)), decoded, rtol=1e-5, atol=1e-5
    )


def test_a_decode_row_reads_the_token_the_previous_step_sampled_on_the_device():
    runner = tiny_runner(page_size=4)
    rows_idx = [runner.req_to_token_pool.alloc() for _ in range(2)]
    prefill = [BatchRow(rows_idx[0], 0, [5, 6, 7]), BatchRow(rows_idx[1], 0, [9, 10])]
    logits = runner.forward(prefill, runner.allocate_slots(prefill))
    tokens = runner.sample_on_device(logits, [SamplingParams()] * 2, None, rows_idx)
    known = tokens.tolist()
    ahead = [BatchRow(rows_idx[0], 3, [FUTURE_TOKEN]), BatchRow(rows_idx[1], 2, [known[1]])]
    from_device = runner.forward(ahead, runner.allocate_slots(ahead)).clone()
    for row, length in zip(rows_idx, (3, 2)):
        runner.free_request_slots(row, length + 1)
    again = runner.forward(prefill, runner.allocate_slots(prefill))
    assert runner.sampler(again, [SamplingParams()] * 2).tolist() == known
    plain = [BatchRow(rows_idx[0], 3, [known[0]]), BatchRow(rows_idx[1], 2, [known[1]])]
    torch.testing.assert_close(
        runner.forward(plain, runner.allocate_slots(plain)), from_device, rtol=0, atol=0
    )


def test_the_host_copy_of_the_table_follows_every_write_and_a_stray_write_is_caught():
    runner = tiny_runner(page_size=4)
    pool = runner.req_to_token_pool
    row = pool.alloc()
    runner.allocate_slots([BatchRow(row, 0, [1, 2, 3])])
    runner.allocate_slots([BatchRow(row, 3, [4])])
    other = pool.alloc()
    pool.write(other, 0, pool.slots_of(row, 2))  # a shared prefix, as admission writes it
    assert pool.slots_of(row, 4).tolist() == pool.req_to_token[row, :4].tolist() == [4, 5, 6, 7]
    assert pool.req_to_token[other, :2].tolist() == [4, 5]
    pool.check_host_copy()
    pool.req_to_token[row, 1] = 99  # a write that bypassed the pool
    with pytest.raises(RuntimeError, match="position 1 holds slot 99 on the device but 5 in the host copy"):
        pool.check_host_copy()


@pytest.mark.parametrize("rows", [[BatchRow(1, 4, [8])], [BatchRow(1, 4, [8]), BatchRow(2, 0, [5, 6, 7])]])
def test_every_index_tensor_starts_16_bytes_aligned(rows):
    """Triton compiles another variant of a kernel for a pointer off a 16-byte boundary: views of
    the one packed copy must not hand it one for an odd row or token count."""
    fb = _build(rows)
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "prefix_lens", "extend_lens",
                 "extend_start_loc", "logits_indices"):  # fmt: skip
        assert getattr(fb, name).data_ptr() % 16 == 0, name
