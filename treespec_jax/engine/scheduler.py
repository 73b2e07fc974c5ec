"""Host-side page allocation and slot bookkeeping for continuous batching.

A request's token limit is prompt + max_new_tokens. Its pages are reserved in full when it is
admitted, covering every position a round can touch for it: the verify window reaches vc + N - 1,
the drafter's step 0 rewrites the same window, and the lanes reach up to one more window behind it
(N - 1 further slots). vc stays below the limit while the request runs, and the round after the
one that finishes it (launched before the host sees the finish, `Engine.stream`) starts from at
most limit - 1 + N, so `limit + 3N` positions. Reserving at admission
means a running request never waits for pages and never competes with another for them; a request
that does not fit yet waits in the queue, and one that can never fit (more pages than the pool
has, or more than a page-table row holds) is refused with the numbers.

Page 0 is the scratch page (`treespec_jax.models.attention.SCRATCH_PAGE`): never handed out, the
target of every unused page-table entry.
"""

from __future__ import annotations

import numpy as np

from treespec_jax.models.attention import SCRATCH_PAGE


class PageAllocator:
    """Free list over pages 1..num_pages-1 (page 0 is scratch)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs the scratch page and at least one more, got num_pages={num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low pages first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        owned = set(self._free)
        bad = [p for p in pages if p in owned or not SCRATCH_PAGE < p < self.num_pages]
        if bad:
            raise RuntimeError(f"pages {bad} are free already or outside 1..{self.num_pages - 1}")
        self._free.extend(sorted(pages, reverse=True))


def pages_needed(limit: int, num_nodes: int, page_size: int) -> int:
    """Pages covering positions [0, limit + 3N) (module docstring)."""
    return -(-(limit + 3 * num_nodes) // page_size)


def table_row(pages: list[int], width: int) -> np.ndarray:
    """`[width] int32` page-table row: the request's pages, then scratch."""
    row = np.full((width,), SCRATCH_PAGE, np.int32)
    row[: len(pages)] = pages
    return row


def pool_pages(*, slots: int, table_width: int, page_size: int, page_bytes: int, max_total_tokens: int | None,
               mem_fraction: float, weight_bytes: int, device_bytes: int | None,
               host_kv_bytes: int | None = None) -> tuple[int, list[str]]:
    """(pages of the KV pools, the scratch page included; the problems that refuse that size).

    `max_total_tokens` given: that many tokens, in whole pages. Otherwise every slot's full context
    (`slots * table_width` pages, so no admission ever waits for pages), cut to a budget at
    `page_bytes` a page across every pool (target and drafter): `mem_fraction` of the device's
    memory (`device_bytes`) less the weights; on a device that reports no memory, `host_kv_bytes`
    (a CPU: `kv_cache.host_kv_gib`, since full pools for a long-context model would take most of
    the host's memory); neither given (pools sharded over devices): the full size. Fewer pages than
    one request of the full context needs refuse the run, with the numbers.
    """
    if max_total_tokens is not None:
        return -(-max_total_tokens // page_size) + 1, []
    full = slots * table_width
    gib = 2 ** 30
    if device_bytes is not None:
        budget = int(mem_fraction * device_bytes) - weight_bytes
        budget_said = (f"kv_cache.mem_fraction_static = {mem_fraction} of {device_bytes / gib:.2f} GiB leaves "
                       f"{budget / gib:.2f} GiB after {weight_bytes / gib:.2f} GiB of weights")
        remedy = "raise mem_fraction_static"
    elif host_kv_bytes is not None:
        budget = host_kv_bytes
        budget_said, remedy = f"kv_cache.host_kv_gib = {host_kv_bytes / gib:g}", "raise host_kv_gib"
    else:
        return full + 1, []
    fit = max(budget, 0) // page_bytes - 1  # less the scratch page
    if fit < table_width:
        return full + 1, [
            f"KV pools: {budget_said}, {max(fit, 0)} pages of {page_size} tokens ({page_bytes} bytes each); one "
            f"request of the full context needs {table_width} ({remedy}, or set kv_cache.max_total_tokens or "
            f"model.context_length)"]
    return min(full, fit) + 1, []
