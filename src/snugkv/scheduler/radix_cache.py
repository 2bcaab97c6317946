"""Prefix cache: a radix tree from token ids to the KV slots that already hold them.

Keys are token ids, cut into whole pages (`page_size` tokens per page); a node's value holds
the slots of its key, page for page. Requests lock the path they reuse (`lock`/`unlock`),
so locked nodes are never evicted. Unlocked leaves are evicted least recently used first, and
their slots go back to the allocator. The cache owns the slots it holds: the scheduler never
frees a slot that the cache holds, and the cache never frees a slot it does not hold.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from snugkv.memory.allocator import SlotAllocator
from snugkv.memory.moves import PageMoves

_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0  # the cache's logical clock (not wall time: ranks must order alike)
    node_id: int = field(default_factory=lambda: next(_ids))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    slots: torch.Tensor  # int64 CPU slots of the cached prefix (a page multiple)
    node: TreeNode  # deepest matched node: lock it while the request uses the prefix

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())


class RadixCache:
    def __init__(self, allocator: SlotAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.enabled = enabled
        self.root = TreeNode()
        self.root.lock_count = 1  # the root is never evicted
        self._cached_tokens = 0
        self._locked_tokens = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self._clock = itertools.count(1)  # one tick per lookup or insert: LRU order without wall time

    # -- accounting -------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def evictable_tokens(self) -> int:
        return self._cached_tokens - self._locked_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def _page_key(self, token_ids: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(token_ids[start : start + self.page_size])

    # -- lookups ----------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], count_stats: bool = True) -> PrefixMatch:
        """The longest cached page-aligned prefix of `token_ids`."""
        usable = len(token_ids) // self.page_size * self.page_size
        if count_stats:
            self.query_tokens += len(token_ids)
        if not self.enabled or usable == 0:
            return PrefixMatch(torch.empty(0, dtype=torch.int64), self.root)
        node, matched, pieces = self.root, 0, []
        now = next(self._clock)
        while matched < usable:
            child = node.children.get(self._page_key(token_ids, matched))
            if child is None:
                break
            shared = self._shared_len(child.key, token_ids, matched, usable)
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            pieces.append(child.value)
            matched += shared
            node = child
        if count_stats:
            self.hit_tokens += matched
        slots = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(slots, node)

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
        upper = TreeNode(
            key=node.key[:at],
            value=node.value[:at],
            parent=node.parent,
            lock_count=node.lock_count,
            last_access=node.last_access,
        )
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    # -- updates ----------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache the page-aligned part of `token_ids` -> `slots`.

        Returns how many leading tokens were already cached: the caller still owns
        `slots[:returned]` that are not the cache's own (it must free those it computed
        itself), and hands `slots[returned:usable]` to the cache.
        """
        usable = len(token_ids) // self.page_size * self.page_size
        if not self.enabled or usable == 0:
            return 0
        slots = slots[:usable].to("cpu", torch.int64)
        node, done = self.root, 0
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
                return done
            shared = self._shared_len(child.key, token_ids, done, usable)
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            done += shared
            node = child
        return done

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

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` cached tokens (LRU unlocked leaves); returns tokens freed."""
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in self._leaves() if leaf.lock_count == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._cached_tokens -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def evict_at_or_above(self, first_slot: int) -> int:
        """Evict every unlocked entry holding a slot >= `first_slot` (with its subtree: an unlocked
        node has only unlocked descendants); returns tokens freed. Locked entries stay: a shrink
        moves their pages instead."""
        freed, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                if child.lock_count == 0 and self._reaches(child, first_slot):
                    del node.children[key]
                    freed += self._free_subtree(child)
                else:
                    stack.append(child)
        return freed

    def _reaches(self, node: TreeNode, first_slot: int) -> bool:
        stack = [node]
        while stack:
            current = stack.pop()
            if current.value.numel() and int(current.value.max()) >= first_slot:
                return True
            stack.extend(current.children.values())
        return False

    def _free_subtree(self, node: TreeNode) -> int:
        values, stack = [], [node]
        while stack:
            current = stack.pop()
            values.append(current.value)
            stack.extend(current.children.values())
        slots = torch.cat(values)
        self.allocator.free(slots)
        self._cached_tokens -= slots.numel()
        return int(slots.numel())

    def remap_slots(self, moves: PageMoves) -> None:
        """Follow a shrink that moved pages the cache holds (locked entries of running requests)."""
        if not moves.num_pages:
            return
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.value = moves.remap_slots(node.value, self.page_size)
            stack.extend(node.children.values())

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and not node.children:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def all_slots(self) -> torch.Tensor:
        """Every slot the cache holds (for integrity checks)."""
        pieces, stack = [], [self.root]
        while stack:
            node = stack.pop()
            pieces.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)

    def reset(self) -> None:
        """Drop every unlocked entry (e.g. after a resize)."""
        self.evict(self._cached_tokens)
