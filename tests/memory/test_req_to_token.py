"""The request-to-token table: row hand-out, the padding row, writes, and the request cap."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snugkv.memory.req_to_token import ReqToTokenPool


def test_table_is_int32_with_a_padding_row_on_top_of_max_requests() -> None:
    pool = ReqToTokenPool(max_requests=4, max_context_len=16, device="cpu")
    assert pool.req_to_token.shape == (5, 16)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.available_requests == 4


def test_row_zero_is_never_handed_out_and_stays_zero() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    rows = [pool.alloc() for _ in range(3)]
    assert rows == [1, 2, 3]
    for row in rows:
        assert row is not None
        pool.write(row, 0, torch.arange(1, 9))
    assert pool.alloc() is None
    assert torch.count_nonzero(pool.req_to_token[0]) == 0
    with pytest.raises(ValueError, match="row 0: it is the padding row"):
        pool.write(0, 0, torch.tensor([5]))
    with pytest.raises(ValueError, match="padding row"):
        pool.free(0)


def test_alloc_hands_out_the_lowest_free_row() -> None:
    pool = ReqToTokenPool(4, 8, "cpu")
    assert [pool.alloc() for _ in range(4)] == [1, 2, 3, 4]
    pool.free(3)
    pool.free(2)
    assert pool.alloc() == 2
    assert pool.available_requests == 1


def test_double_free_names_the_row() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    row = pool.alloc()
    assert row is not None
    pool.free(row)
    with pytest.raises(ValueError, match=f"double free of request row {row}"):
        pool.free(row)


def test_free_of_a_row_outside_the_table_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rows are 1\.\.2"):
        ReqToTokenPool(2, 8, "cpu").free(3)


def test_write_stores_slots_at_positions_as_int32() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    row = pool.alloc()
    assert row is not None
    pool.write(row, 2, torch.tensor([40, 41, 42], dtype=torch.int64))
    assert pool.req_to_token[row].tolist() == [0, 0, 40, 41, 42, 0, 0, 0]


def test_write_past_max_context_len_is_refused_with_the_positions() -> None:
    pool = ReqToTokenPool(1, 8, "cpu")
    row = pool.alloc()
    assert row is not None
    with pytest.raises(ValueError, match=r"positions 6\.\.9, outside the table's 0\.\.7"):
        pool.write(row, 6, torch.arange(4))


def test_write_to_a_row_that_is_not_allocated_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot write to free request row 1"):
        ReqToTokenPool(2, 8, "cpu").write(1, 0, torch.tensor([1]))


def test_cap_requests_hides_rows_above_the_cap_from_alloc() -> None:
    pool = ReqToTokenPool(4, 8, "cpu")
    high = [pool.alloc() for _ in range(4)]
    assert high == [1, 2, 3, 4]
    pool.cap_requests(2)
    assert pool.request_cap == 2
    pool.write(4, 0, torch.tensor([7]))  # a running request above the cap keeps its row
    pool.free(4)
    pool.free(3)
    assert pool.available_requests == 0 and pool.alloc() is None
    pool.free(1)
    assert pool.available_requests == 1 and pool.alloc() == 1


def test_cap_requests_refuses_more_rows_than_the_table_has() -> None:
    with pytest.raises(ValueError, match=r"cap_requests takes 0\.\.4"):
        ReqToTokenPool(4, 8, "cpu").cap_requests(5)


def test_constructor_refuses_an_empty_table() -> None:
    with pytest.raises(ValueError, match="max_requests and max_context_len must be >= 1"):
        ReqToTokenPool(0, 8, "cpu")


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "cap"]), st.integers(0, 8)), max_size=40))
def test_random_alloc_free_cap_sequences_match_a_set_model(ops: list[tuple[str, int]]) -> None:
    pool = ReqToTokenPool(8, 4, "cpu")
    used: set[int] = set()
    cap = 8
    for op, arg in ops:
        if op == "alloc":
            row = pool.alloc()
            free_below_cap = sorted(set(range(1, cap + 1)) - used)
            assert row == (free_below_cap[0] if free_below_cap else None)
            if row is not None:
                used.add(row)
        elif op == "free" and used:
            row = sorted(used)[arg % len(used)]
            pool.free(row)
            used.discard(row)
        elif op == "cap":
            pool.cap_requests(arg)
            cap = arg
        assert pool.available_requests == len(set(range(1, cap + 1)) - used)
    assert torch.count_nonzero(pool.req_to_token[0]) == 0
