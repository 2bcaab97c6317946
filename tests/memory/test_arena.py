"""Arena placement, watermarks, all-or-nothing commits and safe closing."""

from __future__ import annotations

import gc

import pytest
import torch

from snugkv.memory.arena import SHRINK_EXCESS_BYTES, ArenaClosedError, KvArena, auto_chunk_bytes
from snugkv.memory.layout import BufferLayout, KVLayout
from snugkv.memory.vmm import MIB, CommitError
from snugkv.memory.vmm_host import HostVmm


def make_arena(capacity_bytes: int | None = None) -> KvArena:
    return KvArena(
        HostVmm(granularity_bytes=2 * MIB, capacity_bytes=capacity_bytes), 1024 * MIB, label="test"
    )


def k_layout(name: str = "k") -> BufferLayout:
    return BufferLayout(name, torch.float16, (4, 64), page_size=1, layout=KVLayout.TOKEN_MAJOR)


def test_buffers_sit_at_granularity_aligned_offsets():
    arena = make_arena()
    first = arena.add_buffer(k_layout("a"), 1000)
    second = arena.add_buffer(k_layout("b"), 1000)
    assert first.offset == 0
    assert second.offset % (2 * MIB) == 0 and second.offset >= first.reserved_bytes


def test_commit_grows_with_one_extension_and_shrinks_back_by_whole_extensions():
    arena = make_arena()
    buffer = arena.add_buffer(k_layout(), 100_000)
    arena.commit({"k": 3 * MIB})
    assert buffer.committed_bytes == 4 * MIB and len(buffer.extensions) == 1
    arena.commit({"k": 20 * MIB})
    assert buffer.committed_bytes == 20 * MIB and len(buffer.extensions) == 2
    arena.commit({"k": 6 * MIB})  # falls in the second extension (4-20 MiB): it stays whole
    assert buffer.committed_bytes == 20 * MIB
    arena.commit({"k": 4 * MIB})  # the second lies wholly above: it goes
    assert buffer.committed_bytes == 4 * MIB
    assert arena.vmm.committed_bytes == 4 * MIB


def test_failed_commit_rolls_back_every_buffer_of_the_call():
    arena = make_arena(capacity_bytes=10 * MIB)
    arena.add_buffer(k_layout("a"), 100_000)
    arena.add_buffer(k_layout("b"), 100_000)
    arena.commit({"a": 2 * MIB, "b": 2 * MIB})
    with pytest.raises(CommitError):
        arena.commit({"a": 6 * MIB, "b": 6 * MIB})
    assert [b.committed_bytes for b in arena.buffers] == [2 * MIB, 2 * MIB]
    arena.commit({"a": 4 * MIB, "b": 4 * MIB})  # still usable afterwards
    assert arena.committed_bytes == 8 * MIB


def test_view_covers_the_upper_bound_and_writes_land_in_committed_memory():
    arena = make_arena()
    buffer = arena.add_buffer(k_layout(), 10_000)
    arena.commit({"k": buffer.layout.bytes_for_tokens(100)})
    view = arena.view(buffer)
    assert view.shape == (10_001, 4, 64)
    view[:101] = 1.5
    assert view[100].float().mean().item() == 1.5


def test_close_refuses_while_a_view_lives_then_succeeds():
    arena = make_arena()
    buffer = arena.add_buffer(k_layout(), 1000)
    arena.commit({"k": 1})
    view = arena.view(buffer)
    sliced = view[10:20]
    del view
    with pytest.raises(RuntimeError, match="live tensor view"):
        arena.close()
    del sliced
    gc.collect()
    arena.close()
    arena.close()  # idempotent
    assert arena.vmm.committed_bytes == 0
    with pytest.raises(ArenaClosedError):
        arena.add_buffer(k_layout("late"), 10)


def test_a_view_keeps_its_arena_alive():
    buffer_holder = {}

    def make_view() -> torch.Tensor:
        arena = make_arena()
        buffer = arena.add_buffer(k_layout(), 1000)
        arena.commit({"k": buffer.layout.bytes_for_tokens(1000)})
        buffer_holder["arena"] = id(arena)
        return arena.view(buffer)

    view = make_view()  # the arena's last Python reference is gone here
    gc.collect()
    view.fill_(2.0)  # would crash if the range had been unmapped
    assert view.float().sum().item() == 2.0 * view.numel()


def test_two_arenas_do_not_interfere():
    one, two = make_arena(), make_arena()
    view_one = one.view(one.add_buffer(k_layout(), 1000))
    view_two = two.view(two.add_buffer(k_layout(), 1000))
    one.commit({"k": 1 * MIB})
    two.commit({"k": 1 * MIB})
    view_one[0] = 1.0
    view_two[0] = 2.0
    assert view_one[0, 0, 0].item() == 1.0 and view_two[0, 0, 0].item() == 2.0
    assert view_one.data_ptr() != view_two.data_ptr()


def test_buffer_larger_than_the_reserved_range_is_refused_with_sizes():
    arena = KvArena(HostVmm(), 1 * MIB, label="small")
    with pytest.raises(ValueError, match="reserve a larger range"):
        arena.add_buffer(k_layout(), 1_000_000)


def test_a_backend_error_that_is_not_out_of_memory_also_rolls_the_commit_back():
    """All or nothing holds for any failure of the backend mid-commit, not only CommitError."""
    from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
    from snugkv.memory.vmm import MIB, VmmError
    from snugkv.memory.vmm_host import HostVmm

    class FailsOnThirdCommit(HostVmm):
        calls = None

        def commit(self, address, size_bytes):
            if self.calls is not None:
                self.calls += 1
                if self.calls == 3:
                    raise VmmError("injected: mprotect failed")
            return super().commit(address, size_bytes)

    memory = FailsOnThirdCommit(capacity_bytes=64 * MIB)
    pool = MHAKVPool(KVPoolSpec.of(dtype="float32", page_size=16, layout="nhd", device="cpu", mode="post-capture", memory=memory), reserved_tokens=4096, num_layers=2, num_kv_heads=2, head_dim=64)  # fmt: skip
    pool.ensure_prefix()
    before = memory.committed_bytes
    memory.calls = 0
    with pytest.raises(VmmError, match="injected"):
        pool.finalize_backing(2048)
    assert memory.committed_bytes == before and pool.committed_tokens == 0
    memory.calls = None
    pool.finalize_backing(2048)  # the pool is usable afterwards
    assert pool.committed_tokens == 2048
    pool.close()


def chunked_arena(chunk_mib: int = 4, capacity_bytes: int | None = None) -> KvArena:
    vmm = HostVmm(granularity_bytes=2 * MIB, capacity_bytes=capacity_bytes)
    return KvArena(vmm, 1024 * MIB, label="chunked", chunk_bytes=chunk_mib * MIB)


def fill_pattern(arena: KvArena, name: str, size_bytes: int) -> torch.Tensor:
    view = arena.view(next(b for b in arena.buffers if b.name == name)).view(torch.uint8).reshape(-1)
    pattern = torch.randint(
        0, 256, (size_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    view[:size_bytes] = pattern
    del view
    return pattern


def read_bytes(arena: KvArena, name: str, size_bytes: int) -> torch.Tensor:
    view = arena.view(next(b for b in arena.buffers if b.name == name)).view(torch.uint8).reshape(-1)
    return view[:size_bytes].clone()


def test_growth_commits_extensions_of_at_most_one_chunk_cut_at_chunk_multiples():
    arena = chunked_arena(chunk_mib=4)
    buffer = arena.add_buffer(k_layout(), 100_000)
    arena.commit({"k": 3 * MIB})
    arena.commit({"k": 13 * MIB})
    sizes = [extension.size_bytes // MIB for extension in buffer.extensions]
    assert sizes == [4, 4, 4, 2]  # 0-4 (first growth), then 4-8, 8-12, 12-14
    starts = [
        (extension.address - arena.base_address - buffer.offset) // MIB for extension in buffer.extensions
    ]
    assert starts == [0, 4, 8, 12]
    assert arena.vmm.committed_bytes == 14 * MIB


def test_shrink_keeps_every_byte_below_the_new_end_and_gives_whole_extensions_back():
    arena = chunked_arena(chunk_mib=4)
    arena.add_buffer(k_layout("a"), 100_000)
    arena.add_buffer(k_layout("b"), 100_000)
    arena.commit({"a": 14 * MIB, "b": 10 * MIB})
    a_pattern, b_pattern = fill_pattern(arena, "a", 14 * MIB), fill_pattern(arena, "b", 10 * MIB)
    assert arena.backing_bytes("a", 6 * MIB + 1) == 8 * MIB  # what the commit below will keep
    arena.commit({"a": 6 * MIB + 1, "b": 2 * MIB})  # a: ends inside its second chunk; b: inside its first
    a, b = arena.buffers
    assert a.committed_bytes == 8 * MIB and b.committed_bytes == 4 * MIB  # the extensions they fall in
    assert arena.vmm.committed_bytes == 12 * MIB
    assert torch.equal(read_bytes(arena, "a", 8 * MIB), a_pattern[: 8 * MIB])
    assert torch.equal(read_bytes(arena, "b", 4 * MIB), b_pattern[: 4 * MIB])
    arena.commit({"a": 12 * MIB, "b": 10 * MIB})  # grows again, chunks still bounded
    assert max(extension.size_bytes for extension in a.extensions) <= 4 * MIB
    assert torch.equal(read_bytes(arena, "a", 8 * MIB), a_pattern[: 8 * MIB])


def test_a_shrink_on_a_full_backend_gives_memory_back_without_asking_for_any():
    arena = chunked_arena(chunk_mib=2, capacity_bytes=16 * MIB)
    buffer = arena.add_buffer(k_layout(), 100_000)
    arena.commit({"k": 16 * MIB})  # the backend is full: nothing could be committed for a moment
    pattern = fill_pattern(arena, "k", 16 * MIB)
    arena.commit({"k": 10 * MIB - 1})
    assert buffer.committed_bytes == 10 * MIB and arena.vmm.committed_bytes == 10 * MIB
    assert torch.equal(read_bytes(arena, "k", 10 * MIB), pattern[: 10 * MIB])


def test_backing_bytes_of_a_grow_is_the_target_rounded_to_a_granule():
    arena = chunked_arena(chunk_mib=4)
    arena.add_buffer(k_layout(), 100_000)
    arena.commit({"k": 6 * MIB})
    assert arena.backing_bytes("k", 6 * MIB) == 6 * MIB
    assert arena.backing_bytes("k", 9 * MIB) == 10 * MIB
    assert arena.backing_bytes("k", 5 * MIB) == 6 * MIB  # inside the 4-6 MiB extension a grow made
    assert arena.backing_bytes("k", 4 * MIB) == 4 * MIB and arena.backing_bytes("k", 0) == 0


@pytest.mark.parametrize("num_buffers", [1, 2, 27, 64, 96, 300])
def test_auto_chunk_keeps_a_shrink_within_512_mib_of_its_target(num_buffers):
    granule = 2 * MIB
    chunk = auto_chunk_bytes(num_buffers, granule)
    assert chunk % granule == 0 and chunk >= granule
    if num_buffers * granule <= SHRINK_EXCESS_BYTES:
        assert num_buffers * chunk <= SHRINK_EXCESS_BYTES
        assert num_buffers * (chunk + granule) > SHRINK_EXCESS_BYTES  # the largest that does


def test_auto_chunk_keeps_a_small_arenas_shrink_within_a_32nd_of_it():
    page = 4096
    assert auto_chunk_bytes(60, page, 64 * MIB) == 2 * MIB // 60 // page * page  # 2 MiB over 60 buffers
    assert auto_chunk_bytes(60, page, 1 << 40) == auto_chunk_bytes(60, page)  # a large one: 512 MiB
    assert auto_chunk_bytes(60, page, 1 * MIB) == page  # at least one granule
