"""The life of a request's KV slots: admission, room, release, and the check that nothing leaked.

Slot ownership along a request's table row: `[0, prefix_len)` belongs to the prefix cache
(locked while the request runs), `[prefix_len, kv_len + in_flight)` to the request (`in_flight`:
slots of launched steps whose results the host has not taken yet). Admission gives a request
a table row and its cached prefix; room for new tokens comes from the allocator, evicting prefix
cache entries (into its host tier, if it has one) when it runs short; release hands computed KV to
the cache and duplicates, the partial last page and the slots of a failed step back to the
allocator, once no launched step that the host has not read holds the request (`launched`,
`read_back`): a free slot is then one no queued device work touches.
`check_accounting` proves free + cached + held == capacity. This module decides nothing about
which requests run (the scheduler's policy) and never touches outputs.
"""

from __future__ import annotations

from collections.abc import Iterable

from snugkv.runner.model_runner import ModelRunner
from snugkv.scheduler.radix_cache import RadixCache
from snugkv.scheduler.request import Request


class SlotAccountingError(RuntimeError):
    """free + cached + held by requests != capacity: a slot leaked or was handed out twice."""


class RequestSlots:
    def __init__(self, runner: ModelRunner, cache: RadixCache) -> None:
        self.runner = runner
        self.cache = cache
        self.page_size = runner.allocator.page_size
        # Launched steps whose results the host has not read: key -> ids of their requests. A
        # request released while one of them holds it (it finished at the step before, or was
        # aborted) is released once that step is read: the step may still write its slots and read
        # its prefix, so nothing else (a host-tier load above all, which does not wait for the
        # device's queued work) may get them before.
        self._unread: dict[int, set[int]] = {}
        self._held_back: dict[int, tuple[int, Request]] = {}  # id(request) -> (step key, request)

    def new_slots(self, kv_len: int, num_tokens: int) -> int:
        """Slots `num_tokens` more tokens take from the pool: whole pages, minus the room left in
        the request's last, partly filled page."""
        page = self.page_size
        return (-(-(kv_len + num_tokens) // page) - -(-kv_len // page)) * page

    def admit(self, request: Request) -> bool:
        """Give `request` a table row and its cached prefix (at least one token left to compute)."""
        row = self.runner.req_to_token_pool.alloc()
        if row is None:
            return False
        # A request scoring its prompt computes every position: a cached prefix would have no logits.
        reusable = [] if request.scores_prompt else request.all_ids[:-1]
        match = self.cache.match_prefix(reusable, count_stats=request.retractions == 0)
        if match.host_nodes:  # the rest of the prefix is in the host tier: loaded before the prefill
            match = self.cache.load_back(match, count_stats=request.retractions == 0)
        request.req_pool_idx = row
        if match.num_tokens:
            self.cache.lock(match.node)
            request.prefix_node = match.node
            self.runner.req_to_token_pool.write(row, 0, match.slots)
        request.prefix_len = request.kv_len = match.num_tokens
        if request.retractions == 0:
            request.cached_tokens = match.num_tokens
        return True

    def make_room(self, num_tokens: int) -> bool:
        """Whether `num_tokens` slots are free, evicting prefix-cache entries to free them."""
        allocator = self.runner.allocator
        if allocator.available_tokens < num_tokens:
            self.cache.evict_for_room(num_tokens - allocator.available_tokens)
        return allocator.available_tokens >= num_tokens

    def release_rejected(self, request: Request, end: int) -> None:
        """Give back the slots a verify step filled past what the request kept: positions
        `[kv_len, end)` held KV of rejected draft tokens (or of tokens after a stop). Whole pages
        only: the page that also holds kept positions stays the request's, and its next step writes
        into it. Their KV never reaches the prefix cache (release inserts up to `kv_len` only)."""
        page = self.page_size
        first = -(-request.kv_len // page) * page
        if request.req_pool_idx is None or end <= first:
            return
        slots = self.runner.req_to_token_pool.slots_of(request.req_pool_idx, end)[first:]
        self.runner.allocator.free(slots)

    def launched(self, key: int, requests: Iterable[Request]) -> None:
        """A step of `requests` was launched (`key`: the step's own, until `read_back(key)`)."""
        self._unread[key] = {id(request) for request in requests}

    def read_back(self, key: int) -> None:
        """The step `key` is read back (done on the device): what was held back for it goes."""
        self._unread.pop(key, None)
        self._release_held_back()

    def forget_unread(self) -> None:
        """No launched step will be read (a step failed): release what was held back now."""
        self._unread.clear()
        self._release_held_back()

    def _release_held_back(self) -> None:
        """Release each held-back request whose step is no longer unread."""
        for rid, (waits_for, request) in list(self._held_back.items()):
            if waits_for not in self._unread:
                del self._held_back[rid]
                self._release_now(request)

    @property
    def held_back(self) -> list[Request]:
        return [request for _, request in self._held_back.values()]

    def release(self, request: Request, *, ending: bool = False) -> None:
        """Give a request's slots back: computed KV to the prefix cache, the rest (including slots of
        a step that failed before computing them) to the allocator. A request `ending` (it will not
        come back) that an unread step holds is released once that step is read; one that goes back
        to the queue (a retraction) is released now: its callers read the step in flight first."""
        if request.req_pool_idx is None or id(request) in self._held_back:
            return
        for key in reversed(self._unread) if ending else ():  # the latest launch first
            if id(request) in self._unread[key]:
                self._held_back[id(request)] = (key, request)
                return
        self._release_now(request)

    def _release_now(self, request: Request) -> None:
        row = request.req_pool_idx
        if row is None:
            return
        slots = self.runner.req_to_token_pool.slots_of(row, request.launched_len)
        usable = request.kv_len // self.page_size * self.page_size
        computed = slots[: request.kv_len]
        existing = self.cache.insert(request.all_ids[: request.kv_len], computed) if self.cache.enabled else 0
        owned_duplicates = slots[request.prefix_len : max(existing, request.prefix_len)]
        tail = slots[max(usable if self.cache.enabled else request.prefix_len, request.prefix_len) :]
        for part in (owned_duplicates, tail):
            if part.numel():
                self.runner.allocator.free(part)
        if request.prefix_node is not None:
            self.cache.unlock(request.prefix_node)
        self.runner.req_to_token_pool.free(row)
        request.req_pool_idx, request.prefix_node = None, None
        request.prefix_len = request.kv_len = request.in_flight = 0

    def held_tokens(self, requests: Iterable[Request]) -> int:
        """Slots held by admitted requests themselves (not the cache), in whole pages."""
        page = self.page_size
        return sum(-(-r.launched_len // page) * page - r.prefix_len for r in requests if r.is_admitted)

    def check_accounting(self, requests: Iterable[Request]) -> None:
        allocator = self.runner.allocator
        held = self.held_tokens([*requests, *self.held_back])
        total = allocator.available_tokens + self.cache.cached_tokens + held
        if total != allocator.capacity_tokens:
            raise SlotAccountingError(
                f"free {allocator.available_tokens} + cached {self.cache.cached_tokens} + held {held} = {total} "
                f"!= capacity {allocator.capacity_tokens}"
            )
        allocator.check_integrity()
        self.cache.check_host_tier()
