"""Paged KV pools and cache groups: static descriptions, allocation and page tables.

A *physical buffer* is one slot-major array `[num_pages * page_size, ...row]` (see `paged.py`).
An attention layer names the buffers it reads: GQA layers a key buffer `[S, Hkv, D]` and a value
buffer `[S, Hkv, D]`; MLA layers one latent buffer `[S, kv_lora_rank + rope_dim]` whose leading
kv_lora_rank channels are also the value (the value is a view of the key row, not a buffer).
Layers may alias buffers (cross-layer KV sharing names the same buffer twice).

A *cache group* is a set of layers that share one page size and one page table per request (for
example full-attention target layers, or the draft model's layers). Every physical buffer belongs to
exactly one group: its slots only mean something through that group's page table.

Everything here is static (frozen dataclasses, checked at construction); the arrays (pools, page
tables) are threaded through jitted functions as ordinary pytrees (`dict[str, jax.Array]`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PAGE_SIZES = (16, 32, 64)
KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One physical buffer of a cache group."""

    # Unique buffer name; pools are `dict[name, array]`.
    name: str
    # Shape of one slot's row: GQA K/V `(Hkv, D)`, MLA latent `(kv_lora_rank + rope_dim,)`.
    row_shape: tuple[int, ...]
    # Storage dtype name (one of KV_DTYPES); FP8 is E4M3 and unscaled.
    dtype: str = "bfloat16"

    def __post_init__(self):
        if not self.name:
            raise ValueError("buffer name must be non-empty")
        if not self.row_shape or any(int(n) < 1 for n in self.row_shape):
            raise ValueError(f"buffer {self.name!r}: row_shape must be non-empty and positive, got {self.row_shape}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"buffer {self.name!r}: dtype {self.dtype!r} is not one of {KV_DTYPES}")


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """The buffers one attention layer of a cache group reads and writes."""

    # Model layer index (for tables and error messages).
    layer: int
    # Buffer holding the layer's key rows (MLA: the latent rows).
    key: str
    # Buffer holding the value rows; None when the value is a view of the key row (MLA latent).
    value: str | None
    # MLA only: leading channels of the latent row that form the value view (0 for GQA).
    kv_lora_rank: int = 0

    def __post_init__(self):
        if self.value is None and self.kv_lora_rank < 1:
            raise ValueError(f"layer {self.layer}: a value view of the key row (value=None) needs kv_lora_rank >= 1")
        if self.value is not None and self.kv_lora_rank:
            raise ValueError(f"layer {self.layer}: kv_lora_rank is only for MLA layers (value=None)")

    @property
    def buffers(self) -> tuple[str, ...]:
        """Physical buffers this layer touches, without repeats (MLA: the latent buffer alone)."""
        if self.value is None or self.value == self.key:
            return (self.key,)
        return (self.key, self.value)


@dataclasses.dataclass(frozen=True)
class CacheGroupSpec:
    """Layers sharing one page size and one page table per request."""

    # Unique group name; page tables and window starts are keyed by it.
    name: str
    # Tokens per page (one of PAGE_SIZES).
    page_size: int
    # Pages in each of the group's pools; slots = num_pages * page_size.
    num_pages: int
    # Physical buffers of the group, by name.
    buffers: tuple[BufferSpec, ...]
    # Attention layers of the group, each naming buffers from `buffers`.
    layers: tuple[LayerKV, ...]

    def __post_init__(self):
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"group {self.name!r}: page_size {self.page_size} is not one of {PAGE_SIZES}")
        if self.num_pages < 1:
            raise ValueError(f"group {self.name!r}: num_pages must be >= 1, got {self.num_pages}")
        names = [b.name for b in self.buffers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"group {self.name!r}: buffers named more than once: {dup}")
        known = set(names)
        for layer in self.layers:
            for buf in layer.buffers:
                if buf not in known:
                    raise ValueError(f"group {self.name!r}: layer {layer.layer} names unknown buffer {buf!r}")
            if layer.value is None:
                width = self.buffer(layer.key).row_shape
                if len(width) != 1 or layer.kv_lora_rank > width[0]:
                    raise ValueError(f"group {self.name!r}: layer {layer.layer} value view of {layer.kv_lora_rank} "
                                     f"channels does not fit latent row shape {width}")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"group {self.name!r} has no buffer {name!r}")

    def pool_shape(self, name: str) -> tuple[int, ...]:
        return (self.num_slots,) + tuple(self.buffer(name).row_shape)


def validate_groups(groups: Sequence[CacheGroupSpec]) -> None:
    """Group names are unique and every physical buffer belongs to exactly one group."""
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"cache groups named more than once: {dup}")
    owner: dict[str, str] = {}
    for g in groups:
        for b in g.buffers:
            if b.name in owner:
                raise ValueError(f"buffer {b.name!r} belongs to groups {owner[b.name]!r} and {g.name!r}; "
                                 "a buffer's slots are addressed through one group's page table")
            owner[b.name] = g.name


def allocate_pools(groups: Sequence[CacheGroupSpec], fill: float = 0.0) -> dict[str, jax.Array]:
    """Fresh pools for every buffer of every group, `{name: [num_slots, ...row]}`."""
    validate_groups(groups)
    return {b.name: jnp.full(g.pool_shape(b.name), fill, jnp.dtype(b.dtype)) for g in groups for b in g.buffers}


def check_pools(groups: Sequence[CacheGroupSpec], pools: Mapping[str, jax.Array]) -> None:
    """Every group buffer is present with its spec's shape and dtype (trace-time check)."""
    for g in groups:
        for b in g.buffers:
            if b.name not in pools:
                raise ValueError(f"group {g.name!r}: pool {b.name!r} is missing")
            arr = pools[b.name]
            if tuple(arr.shape) != g.pool_shape(b.name) or arr.dtype != jnp.dtype(b.dtype):
                raise ValueError(f"group {g.name!r}: pool {b.name!r} is {arr.dtype}{list(arr.shape)}, expected "
                                 f"{b.dtype}{list(g.pool_shape(b.name))}")


def check_page_table(page_table: jax.Array, batch: int | None = None, name: str = "page_table") -> None:
    """`page_table [B, max_pages] int32` (trace-time shape/dtype check)."""
    if page_table.ndim != 2 or page_table.dtype != jnp.int32:
        raise ValueError(f"{name} must be [B, max_pages] int32, got {page_table.dtype}{list(page_table.shape)}")
    if batch is not None and page_table.shape[0] != batch:
        raise ValueError(f"{name} has {page_table.shape[0]} rows, expected batch {batch}")


def disjoint_page_table(seed: int, batch: int, pages_per_request: int, num_pages: int) -> np.ndarray:
    """A random page table in which no two requests share a page: `[batch, pages_per_request] int32`.

    Host-side helper for tests and benchmarks (serving assigns pages in its allocator).
    """
    need = batch * pages_per_request
    if need > num_pages:
        raise ValueError(f"{batch} requests x {pages_per_request} pages need {need} pages, pool has {num_pages}")
    perm = np.random.default_rng(seed).permutation(num_pages)[:need]
    return perm.reshape(batch, pages_per_request).astype(np.int32)
