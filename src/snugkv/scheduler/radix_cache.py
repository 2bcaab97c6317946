"""Prefix cache: a radix tree from token ids to the KV pages that already hold them, on the device
and, with a host tier, in host memory.

Keys are token ids, cut into whole pages (`page_size` tokens per page). A node's `value` holds the
device slots of its key, page for page (empty: the node is in the host tier only), and
`host_pages` its copy in the host tier (snugkv.memory.host_tier), if it has one. The nodes on the
device are the top of the tree (a node on the device has its parent there), so a match is some
nodes on the device, then some in the host tier only.

Requests lock the path they reuse (`lock`/`unlock`), so locked nodes never leave the device.
Eviction takes unlocked nodes with nothing below them on the device, least recently used first.
With a host tier their pages are written there first and their device slots go back to the
allocator at once, the device's later work ordered after the writes (`_leave_device`); without one,
or when the host tier has no room for them even after dropping its own entries used before them
(its LRU), they are dropped. A copy is made
only under a parent that stays somewhere (on the device or in the host tier): a host-only node
below a dropped one could never be matched. A move with a `SpillBudget` (memory pressure: what
its time budget writes at the host tier's measured bandwidth) keeps copies, parents first, until
the budget is spent and drops the rest. A hit on host pages loads them into device slots
(`load_back`) before the request's prefill reads them. A node keeps its host copy after a load, so
leaving the device again costs no copy.

The cache owns the device slots and the host pages it holds: the scheduler never frees a slot the
cache holds, and the cache never frees a slot it does not hold. It decides what moves between
the tiers; the copies themselves are the host tier's.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from snugkv.core.reports import HostTierStats
from snugkv.memory.allocator import SlotAllocator
from snugkv.memory.host_tier import COPIED, CopyDone, HostKvTier
from snugkv.memory.moves import PageMoves

_ids = itertools.count()
EVICT_BATCH_BYTES = 64 << 20  # an eviction into the host tier frees at least this much (the staging's size)
HOST_ROOM_BATCH_DIVISOR = 64  # a full host tier frees 1/64 of itself at once (`_host_room`)


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=_no_slots)  # device slots; empty: host tier only
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0  # the cache's logical clock (not wall time: ranks must order alike)
    node_id: int = field(default_factory=lambda: next(_ids))
    host_pages: torch.Tensor | None = None  # its copy in the host tier: one host page per page
    loading: CopyDone | None = None  # the load that filled `value`, which may still be running

    @property
    def on_device(self) -> bool:
        return self.value.numel() > 0


@dataclass(slots=True)
class SpillBudget:
    """The tokens a move may still write to the host tier; what leaves the device beyond them is
    dropped (`RadixCache.spill_budget`)."""

    tokens: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    slots: torch.Tensor  # int64 CPU slots of the cached prefix on the device (a page multiple)
    node: TreeNode  # deepest matched node on the device: lock it while the request uses the prefix
    host_nodes: tuple[TreeNode, ...] = ()  # the match goes on in the host tier only (`load_back`)

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())

    @property
    def host_tokens(self) -> int:
        return sum(len(node.key) for node in self.host_nodes)


class RadixCache:
    def __init__(
        self, allocator: SlotAllocator, enabled: bool = True, host_tier: HostKvTier | None = None
    ) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.enabled = enabled
        self.host_tier = host_tier if enabled else None
        self.root = TreeNode()
        self.root.lock_count = 1  # the root is never evicted
        self._cached_tokens = 0  # on the device
        self._locked_tokens = 0
        self._host_tokens = 0  # with a copy in the host tier
        self.hit_tokens = 0  # served from the device
        self.host_hit_tokens = 0  # served from the host tier (loaded back)
        self.query_tokens = 0
        self.spilled_tokens = 0  # written to the host tier when they left the device
        self.dropped_tokens = 0  # left the device with no copy kept
        self.budget_dropped_tokens = 0  # of those, dropped because a move's spill budget was spent
        self._protected: set[int] = set()  # node ids the host tier's LRU must not drop now
        # kept as the tree changes, so that an eviction walks no tree: the nodes on the device with
        # no child there (`_mark`), and the nodes with a host copy
        self._device_leaves: dict[int, TreeNode] = {}
        self._host_nodes: dict[int, TreeNode] = {}
        self._clock = itertools.count(1)  # one tick per lookup or insert: LRU order without wall time

    # -- accounting -------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        """Tokens the cache holds on the device."""
        return self._cached_tokens

    @property
    def host_cached_tokens(self) -> int:
        """Tokens the cache holds in the host tier (some of them on the device too)."""
        return self._host_tokens

    @property
    def evictable_tokens(self) -> int:
        return self._cached_tokens - self._locked_tokens

    @property
    def hit_rate(self) -> float:
        hits = self.hit_tokens + self.host_hit_tokens
        return hits / self.query_tokens if self.query_tokens else 0.0

    def _page_key(self, token_ids: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(token_ids[start : start + self.page_size])

    def _device_pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slots[:: self.page_size] // self.page_size

    # -- lookups ----------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], count_stats: bool = True) -> PrefixMatch:
        """The longest cached page-aligned prefix of `token_ids`: its part on the device, then the
        nodes that hold the rest in the host tier only."""
        usable = len(token_ids) // self.page_size * self.page_size
        if count_stats:
            self.query_tokens += len(token_ids)
        if not self.enabled or usable == 0:
            return PrefixMatch(_no_slots(), self.root)
        node, matched, pieces, host_nodes = self.root, 0, [], []
        deepest = self.root  # on the device
        now = next(self._clock)
        while matched < usable:
            child = node.children.get(self._page_key(token_ids, matched))
            if child is None:
                break
            shared = self._shared_len(child.key, token_ids, matched, usable)
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            if child.on_device:
                pieces.append(child.value)
                deepest = child
            else:
                host_nodes.append(child)
            matched += shared
            node = child
        slots = torch.cat(pieces) if pieces else _no_slots()
        if count_stats:
            self.hit_tokens += int(slots.numel())
        return PrefixMatch(slots, deepest, tuple(host_nodes))

    def _shared_len(self, key: tuple[int, ...], token_ids: Sequence[int], start: int, usable: int) -> int:
        shared = 0
        limit = min(len(key), usable - start)
        while shared + self.page_size <= limit and key[shared : shared + self.page_size] == tuple(
            token_ids[start + shared : start + shared + self.page_size]
        ):
            shared += self.page_size
        return shared

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; returns the new upper half (it keeps node's locks)."""
        assert node.parent is not None
        pages_at = at // self.page_size
        host = node.host_pages
        upper = TreeNode(
            key=node.key[:at],
            value=node.value[:at],
            parent=node.parent,
            lock_count=node.lock_count,
            last_access=node.last_access,
            host_pages=None if host is None else host[:pages_at],
            loading=node.loading,
        )
        node.parent.children[self._page_key(upper.key, 0)] = upper
        if upper.host_pages is not None:
            self._host_nodes[upper.node_id] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        node.host_pages = None if host is None else host[pages_at:]
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def load_back(self, match: PrefixMatch, count_stats: bool = True) -> PrefixMatch:
        """Load the host-tier part of `match` into device slots, as much of it as the device has
        room for (evicting other entries); returns the match as it is on the device now. The
        device's next work reads the pages after the copy (`HostKvTier.load`)."""
        tier = self.host_tier
        if tier is None or not match.host_nodes:
            return match
        self.lock(match.node)  # the device part stays while room is made
        self._protected = {node.node_id for node in match.host_nodes}
        try:
            short = match.host_tokens - self.allocator.available_tokens
            if short > 0:
                self.evict_for_room(short)
            room, nodes, tokens = self.allocator.available_tokens, [], 0
            for node in match.host_nodes:
                if tokens + len(node.key) > room:
                    break
                nodes.append(node)
                tokens += len(node.key)
            slots = self._alloc_pages(tokens) if nodes else None
        finally:
            self._protected = set()
            self.unlock(match.node)
        if slots is None:
            return match
        slots = slots.to("cpu", torch.int64)
        host_pages = torch.cat([node.host_pages for node in nodes if node.host_pages is not None])
        done = tier.load(host_pages, self._device_pages(slots))
        offset = 0
        for node in nodes:
            node.value, node.loading = slots[offset : offset + len(node.key)], done
            offset += len(node.key)
        self._mark_around(nodes)
        self._cached_tokens += tokens
        if count_stats:
            self.host_hit_tokens += tokens
        return PrefixMatch(torch.cat([match.slots, slots]), nodes[-1], match.host_nodes[len(nodes) :])

    def _alloc_pages(self, tokens: int) -> torch.Tensor | None:
        """`tokens` device slots in whole pages (a page multiple), lowest pages first."""
        return self.allocator.alloc(tokens)

    # -- updates ----------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache the page-aligned part of `token_ids` -> `slots`.

        Returns how many leading tokens were already cached on the device: the caller still owns
        `slots[:returned]` that are not the cache's own (it must free those it computed itself), and
        hands `slots[returned:usable]` to the cache. Nodes found in the host tier only take the
        caller's slots (they are on the device again, with no load).
        """
        usable = len(token_ids) // self.page_size * self.page_size
        if not self.enabled or usable == 0:
            return 0
        slots = slots[:usable].to("cpu", torch.int64)
        node, done, on_device = self.root, 0, None
        refilled: list[TreeNode] = []  # host-only nodes on the device again
        now = next(self._clock)
        while done < usable:
            child = node.children.get(self._page_key(token_ids, done))
            if child is None:
                leaf = TreeNode(
                    key=tuple(token_ids[done:usable]),
                    value=slots[done:usable].clone(),
                    parent=node,
                    last_access=now,
                )
                node.children[self._page_key(leaf.key, 0)] = leaf
                self._cached_tokens += usable - done
                self._mark_around([*refilled, leaf])
                return done if on_device is None else on_device
            shared = self._shared_len(child.key, token_ids, done, usable)
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            if not child.on_device:
                on_device = done if on_device is None else on_device
                child.value = slots[done : done + shared].clone()
                self._cached_tokens += shared
                refilled.append(child)
            done += shared
            node = child
        self._mark_around(refilled)
        return done if on_device is None else on_device

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction while a request uses them."""
        while node is not self.root and node is not None:
            if node.lock_count == 0:
                self._locked_tokens += len(node.key)
            node.lock_count += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root and node is not None:
            if node.lock_count <= 0:
                raise RuntimeError(f"prefix-cache node {node.node_id} unlocked more often than locked")
            node.lock_count -= 1
            if node.lock_count == 0:
                self._locked_tokens -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # -- leaving the device -----------------------------------------------------------
    def spill_budget(self, seconds: float | None) -> SpillBudget | None:
        """What `seconds` of writes to the host tier carry at its measured bandwidth, for one move
        to spend (`evict`, `evict_at_or_above`); None: no limit (no time given, no host tier, or its
        bandwidth was not measured)."""
        if seconds is None or self.host_tier is None:
            return None
        tokens = self.host_tier.spill_tokens_within(seconds)
        return None if tokens is None else SpillBudget(tokens)

    def evict(self, num_tokens: int, budget: SpillBudget | None = None) -> int:
        """Free at least `num_tokens` device slots (least recently used unlocked entries with
        nothing below them on the device; into the host tier where it has room, and the budget
        where one is given); returns the tokens freed. The slots are back in the allocator when
        this returns."""
        return self._leave_device(self._lru_device_leaves(num_tokens), budget=budget)

    def evict_for_room(self, num_tokens: int) -> int:
        """`evict` for slots a request needs now (a prefill, a decode step, a load back): with a host
        tier at least `eviction_floor` tokens leave at once. A pressure move's evictions, which a
        spill budget bounds, take `evict` itself: what they free beyond the need would be dropped."""
        return self.evict(max(num_tokens, self.eviction_floor()) if num_tokens > 0 else 0)

    def eviction_floor(self) -> int:
        """The fewest tokens an eviction frees: with a host tier, what leaves is written there and
        the scheduler waits for the write, so a page or two at a time (a decode batch crossing page
        ends) would pay a copy's launch and a host wait per step; `EVICT_BATCH_BYTES` at once (at
        most 1/16 of the cache) makes it a few large chunks every several steps. The H100 run
        at be28b89 wrote to the tier at 16.4 GB/s while serving, against 45 for batched copies."""
        tier = self.host_tier
        if tier is None or tier.page_bytes <= 0:
            return 0
        pages = min(
            EVICT_BATCH_BYTES // tier.page_bytes, self.allocator.capacity_tokens // 16 // self.page_size
        )
        return max(pages, 1) * self.page_size

    def spill_all(self) -> int:
        """Every unlocked entry leaves the device, into the host tier as far as it holds them
        (sleep: the prefix cache outlives the KV cache's memory)."""
        return self.evict(self._cached_tokens)

    def evict_at_or_above(self, first_slot: int, budget: SpillBudget | None = None) -> int:
        """Every unlocked entry holding a slot >= `first_slot` leaves the device, with what is below
        it there (an unlocked node has only unlocked descendants), into the host tier as far as it
        and the budget hold them; returns tokens freed. Locked entries stay: a shrink moves their
        pages instead."""
        tops, stack = [], [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.on_device and child.lock_count == 0 and self._reaches(child, first_slot):
                    tops.append(child)
                elif child.on_device:
                    stack.append(child)
        return self._leave_device([node for top in tops for node in self._device_subtree(top)], budget=budget)

    def _reaches(self, node: TreeNode, first_slot: int) -> bool:
        stack = [node]
        while stack:
            current = stack.pop()
            if current.value.numel() and int(current.value.max()) >= first_slot:
                return True
            stack.extend(current.children.values())
        return False

    def _device_subtree(self, top: TreeNode) -> list[TreeNode]:
        """The nodes on the device from `top` down, every node after all of its descendants."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(child for child in node.children.values() if child.on_device)
        return order[::-1]

    def _lru_device_leaves(self, num_tokens: int) -> list[TreeNode]:
        """Unlocked device entries holding at least `num_tokens` (or all there are), least recently
        used first, each after every one of its descendants on the device."""
        heap = [
            (leaf.last_access, leaf.node_id, leaf)
            for leaf in self._device_leaves.values()
            if leaf.lock_count == 0
        ]
        heapq.heapify(heap)
        chosen: list[TreeNode] = []
        taken: set[int] = set()
        tokens = 0
        while tokens < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            chosen.append(node)
            taken.add(node.node_id)
            tokens += len(node.key)
            parent = node.parent
            assert parent is not None
            if (
                parent is not self.root
                and parent.lock_count == 0
                and all(not c.on_device or c.node_id in taken for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return chosen

    def _leave_device(
        self, nodes: list[TreeNode], *, keep_in_host: bool = True, budget: SpillBudget | None = None
    ) -> int:
        """Take `nodes` (unlocked, on the device, each after its descendants there) off the device:
        write their pages into the host tier where it has room (`keep_in_host`) and `budget` allows,
        parents first, each under a parent that stays somewhere; free their slots with the device's
        later work ordered after those writes (`CopyDone.before_device_reuse`: a page is not reused
        before it is written, and the host does not wait), and drop the nodes kept nowhere.
        Returns the tokens freed on the device."""
        tier = self.host_tier if keep_in_host else None
        sources, targets = [], []
        leaving = {node.node_id for node in nodes}
        over_budget: set[int] = set()
        for node in reversed(nodes) if tier is not None else ():  # every parent before its children
            parent = node.parent
            assert parent is not None
            if node.host_pages is not None:
                continue
            if parent.node_id in leaving and parent.host_pages is None:  # the parent is dropped
                if parent.node_id in over_budget:
                    over_budget.add(node.node_id)
                continue
            tokens = len(node.key)
            if budget is not None and tokens > budget.tokens:
                over_budget.add(node.node_id)
                continue
            pages = self._host_room(tokens // self.page_size, node, leaving)
            if pages is not None:
                node.host_pages = pages
                self._host_nodes[node.node_id] = node
                self._host_tokens += tokens
                self.spilled_tokens += tokens
                if budget is not None:
                    budget.tokens -= tokens
                sources.append(self._device_pages(node.value))
                targets.append(pages)
        written = (
            tier.write(torch.cat(sources), torch.cat(targets)) if tier is not None and sources else COPIED
        )
        written.before_device_reuse()  # the slots go back now; the device reuses them after the write
        freed = 0
        if nodes:  # one free for all (each free checks its slots against the allocator's pages)
            self.allocator.free(torch.cat([node.value for node in nodes]))
        for node in nodes:
            if node.loading is not None:  # a load may still fill these slots: reused only after it
                node.loading.before_device_reuse()
                node.loading = None
            freed += len(node.key)
            node.value = _no_slots()
            if node.host_pages is None:
                self.dropped_tokens += len(node.key)
                self.budget_dropped_tokens += len(node.key) if node.node_id in over_budget else 0
                self._drop(node)
        self._mark_around(nodes)
        self._cached_tokens -= freed
        return freed

    def _mark(self, node: TreeNode) -> None:
        """Keep `_device_leaves` right for `node` after a change to it or to its children."""
        if node.on_device and node is not self.root and not any(c.on_device for c in node.children.values()):
            self._device_leaves[node.node_id] = node
        else:
            self._device_leaves.pop(node.node_id, None)

    def _mark_around(self, nodes: Iterable[TreeNode]) -> None:
        """`_mark` the nodes that came onto or left the device, and their parents."""
        for node in nodes:
            self._mark(node)
            if node.parent is not None:
                self._mark(node.parent)

    # -- the host tier's own LRU ------------------------------------------------------
    def _host_room(self, num_pages: int, newcomer: TreeNode, leaving: set[int]) -> torch.Tensor | None:
        """`num_pages` host pages for `newcomer`: free ones, or pages of host-tier entries used
        before it (least recently used first: a copy of a node still on the device, or a node in
        the host tier only with nothing below it). None when even that leaves too few."""
        tier = self.host_tier
        assert tier is not None
        pages = tier.alloc(num_pages)
        if pages is not None or num_pages > tier.capacity_pages:
            return pages
        spared = leaving | self._protected

        def may_drop(node: TreeNode) -> bool:
            return (
                node.host_pages is not None
                and node.node_id not in spared
                and node.last_access <= newcomer.last_access
                and (node.on_device or not node.children)
            )

        heap = [
            (node.last_access, node.node_id, node) for node in self._host_nodes.values() if may_drop(node)
        ]
        heapq.heapify(heap)
        # a batch at once (at most 1/64 of the tier), so that the entries' scan above is not paid
        # for every page that comes in while the tier is full
        want = min(max(num_pages, tier.capacity_pages // HOST_ROOM_BATCH_DIVISOR), tier.capacity_pages)
        while tier.free_pages < want and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if node.on_device:
                self._forget_host_copy(node)
            else:
                self._drop(node)
                if parent is not None and parent is not self.root and may_drop(parent):
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return tier.alloc(num_pages)

    def _forget_host_copy(self, node: TreeNode) -> None:
        if node.host_pages is not None and self.host_tier is not None:
            self.host_tier.free(node.host_pages)
            self._host_tokens -= len(node.key)
        node.host_pages = None
        self._host_nodes.pop(node.node_id, None)

    def _drop(self, node: TreeNode) -> None:
        """Remove `node` and everything below it (none of it on the device) from the tree."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._page_key(node.key, 0)]
        stack = [node]
        while stack:
            current = stack.pop()
            if current.on_device:
                raise RuntimeError(f"prefix-cache node {current.node_id} dropped while on the device")
            self._forget_host_copy(current)
            self._device_leaves.pop(current.node_id, None)
            stack.extend(current.children.values())

    # -- shrinks, resets and checks ---------------------------------------------------
    def remap_slots(self, moves: PageMoves) -> None:
        """Follow a shrink that moved pages the cache holds (locked entries of running requests)."""
        if not moves.num_pages:
            return
        if self.host_tier is not None:
            self.host_tier.order_after_compute()  # a later write reads the moved pages after the move
        for node in self._walk():
            node.value = moves.remap_slots(node.value, self.page_size)

    def _walk(self) -> Iterable[TreeNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        """Every device slot the cache holds (for integrity checks)."""
        pieces = [node.value for node in self._walk()]
        return torch.cat(pieces) if pieces else _no_slots()

    def reset(self) -> None:
        """Drop every unlocked entry, in both tiers (new weights, sleep level 2, a failed step)."""
        self._leave_device(self._lru_device_leaves(self._cached_tokens), keep_in_host=False)
        for node in list(self._walk()):
            parent = node.parent
            assert parent is not None
            if node.on_device:  # locked: only its host copy goes
                self._forget_host_copy(node)
            elif parent is self.root or parent.on_device:  # the top of a host-only subtree
                self._drop(node)

    def check_indexes(self) -> None:
        """The sets kept as the tree changes are what a walk of the tree finds."""
        nodes = list(self._walk())
        leaves = {
            node.node_id
            for node in nodes
            if node.on_device and not any(child.on_device for child in node.children.values())
        }
        if set(self._device_leaves) != leaves:
            raise RuntimeError(
                f"prefix cache: device leaves {sorted(self._device_leaves)}, the tree has {sorted(leaves)}"
            )
        hosted = {node.node_id for node in nodes if node.host_pages is not None}
        if set(self._host_nodes) != hosted:
            raise RuntimeError(
                f"prefix cache: host copies {sorted(self._host_nodes)}, the tree has {sorted(hosted)}"
            )

    def check_host_tier(self) -> None:
        """The host tier's pages in use are exactly the cache's host copies."""
        self.check_indexes()
        tier = self.host_tier
        if tier is None:
            return
        tier.check_integrity()
        if tier.used_pages * self.page_size != self._host_tokens:
            raise RuntimeError(
                f"host tier: {tier.used_pages} pages in use, but the cache holds {self._host_tokens} tokens there"
            )

    def host_tier_stats(self) -> HostTierStats | None:
        tier = self.host_tier
        if tier is None:
            return None
        traffic = tier.traffic()
        return HostTierStats(
            capacity_tokens=tier.capacity_tokens,
            capacity_bytes=tier.capacity_bytes,
            cached_tokens=self._host_tokens,
            used_bytes=tier.used_pages * tier.page_bytes,
            pinned=tier.pinned,
            device_hit_tokens=self.hit_tokens,
            host_hit_tokens=self.host_hit_tokens,
            host_hit_rate=self.host_hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            query_tokens=self.query_tokens,
            spilled_tokens=self.spilled_tokens,
            dropped_tokens=self.dropped_tokens,
            budget_dropped_tokens=self.budget_dropped_tokens,
            bytes_to_host=traffic.bytes_to_host,
            bytes_to_device=traffic.bytes_to_device,
            write_s=traffic.write_s,
            load_s=traffic.load_s,
        )
