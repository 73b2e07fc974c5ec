"""Row moves inside a buffer: the primitive behind KV-row compaction and ReplaySSM payload packing.

`move_rows(buf, src_rows, dst_rows)` sets `buf[dst_rows[m]] = buf[src_rows[m]]` for every pair m
whose source is >= 0 and differs from its destination. The pairs come from an accepted path
(dst = depth d, src = path[d] >= d), so a sequential in-place pass in increasing d never reads a
row it already overwrote; the result equals "gather all sources, then scatter". Rows are moved as
raw words, so every dtype (bf16, FP8, fp32, int) moves the same way.

Pairs may be grouped: `src_rows/dst_rows [G, M]` are G independent groups (one per request) of M
pairs. Groups run in parallel and must touch disjoint rows; inside a group the pairs are applied in
order m = 0, 1, ..., which is exactly the gather-then-scatter result whenever no pair reads a row
that an earlier pair of its group wrote (true for path-derived pairs: src = path[d] >= d > every
earlier destination).

Pallas kernel: the buffer is viewed as `[S, words]` of 32-, 16- or 8-bit unsigned words (the widest
that divides the row's byte size). One program owns one group and one power-of-two column tile of
words; it walks the group's pairs in order, loading a source tile and storing it at the
destination. Every tile has the same 1-D shape and layout, so a given column is always handled by
the same thread and the load of row path[d] happens-before any later store to that row: no race,
no barrier. The buffer is updated in place through `input_output_aliases`; donate it at the jit
boundary (`jax.jit(..., donate_argnums=...)`) so XLA does not copy the pool to honour the alias.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, resolve_backend

# Pairs per group: the kernel unrolls a group's pairs (their order is the correctness argument), so
# its compile time grows with M. A verify window has at most 64 rows; one flat group of B*T pairs
# for all requests takes minutes to compile at B=32, T=64.
MAX_PAIRS_PER_GROUP = 64


@dataclasses.dataclass(frozen=True)
class RowMoveConfig:
    """Launch knobs of `move_rows`; `default_config()` is what it runs when given none."""

    # Words per program along the row (power of two); rows longer than this use several programs.
    max_block_words: int = 1024
    # Triton warps per program; a 1-D tile of 1024 words is 8 words per thread at 4 warps.
    num_warps: int = 4

    def __post_init__(self):
        if self.max_block_words < 1 or self.max_block_words & (self.max_block_words - 1):
            raise ValueError(f"max_block_words must be a power of two, got {self.max_block_words}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


def default_config() -> RowMoveConfig:
    """The row move's config when given none, the same for every buffer: tiles of up to 1024 words
    (a row of more words takes several programs) at 4 warps."""
    return RowMoveConfig()


def _check_args(buf: jax.Array, src_rows: jax.Array, dst_rows: jax.Array) -> None:
    if buf.ndim < 1 or buf.shape[0] < 1:
        raise ValueError(f"buf must be [S, ...row] with S >= 1, got shape {buf.shape}")
    if src_rows.shape != dst_rows.shape:
        raise ValueError(f"src_rows {src_rows.shape} and dst_rows {dst_rows.shape} must have one shape")
    if src_rows.ndim not in (1, 2):
        raise ValueError(f"src_rows/dst_rows must be [M] or [G, M], got shape {src_rows.shape}")
    for name, rows in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if not jnp.issubdtype(rows.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {rows.dtype}")
    if src_rows.ndim and src_rows.shape[-1] > MAX_PAIRS_PER_GROUP:
        raise ValueError(f"move_rows takes at most {MAX_PAIRS_PER_GROUP} pairs per group, got "
                         f"{src_rows.shape[-1]} (shape {src_rows.shape}); pass independent requests as "
                         f"[G, M] groups")


def move_rows_reference(buf: jax.Array, src_rows: jax.Array, dst_rows: jax.Array) -> jax.Array:
    """Pure-jnp reference. `buf [S, ...]`, `src_rows/dst_rows [M] or [G, M] int32` -> `buf [S, ...]`."""
    _check_args(buf, src_rows, dst_rows)
    src_rows = src_rows.reshape(-1).astype(jnp.int32)
    dst_rows = dst_rows.reshape(-1).astype(jnp.int32)
    live = (src_rows >= 0) & (src_rows != dst_rows)
    rows = buf[jnp.where(live, src_rows, 0)]
    # Dead pairs scatter out of bounds, which `mode="drop"` discards.
    dst = jnp.where(live, dst_rows, buf.shape[0])
    return buf.at[dst].set(rows, mode="drop")


# -- raw-word view --------------------------------------------------------------------------------

_WORD_DTYPES = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}


def _word_view(buf: jax.Array) -> tuple[jax.Array, int]:
    """`buf [S, ...row]` -> (`words [S, W] uint{32,16,8}`, word bytes). A bitcast, not a copy."""
    if buf.dtype == jnp.bool_ or jnp.dtype(buf.dtype).itemsize not in (1, 2, 4):
        raise ValueError(f"move_rows moves 1-, 2- or 4-byte elements, got dtype {buf.dtype}")
    item = jnp.dtype(buf.dtype).itemsize
    row_elems = int(np.prod(buf.shape[1:], dtype=np.int64))
    row_bytes = row_elems * item
    word = next(w for w in (4, 2, 1) if row_bytes % w == 0 and w >= item)
    flat = buf.reshape(buf.shape[0], row_elems)
    if word == item:
        return jax.lax.bitcast_convert_type(flat, _WORD_DTYPES[word]), word
    per_word = word // item
    grouped = flat.reshape(buf.shape[0], row_elems // per_word, per_word)
    return jax.lax.bitcast_convert_type(grouped, _WORD_DTYPES[word]), word


def _from_word_view(words: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of `_word_view`: `[S, W]` words -> the buffer's dtype and shape."""
    out = jax.lax.bitcast_convert_type(words, like.dtype)  # [S, W] or [S, W, word // item]
    return out.reshape(like.shape)


# -- Pallas kernel --------------------------------------------------------------------------------


def _move_rows_kernel(src_ref, dst_ref, words_in_ref, words_ref, *, pairs: int, words: int, block: int):
    """One group (program axis 0) x one column tile (axis 1). `words_ref` aliases `words_in_ref`."""
    del words_in_ref  # same buffer as words_ref; read and write through one ref to keep order
    group = pl.program_id(0)
    cols = pl.program_id(1) * block + jnp.arange(block, dtype=jnp.int32)
    in_row = cols < words
    for m in range(pairs):  # static unroll; M <= 64 for a verify window
        src = src_ref[group, m]
        dst = dst_ref[group, m]
        live = (src >= 0) & (src != dst)
        mask = in_row & live
        # Dead pairs read row 0 under an all-false mask, so no address is ever out of range.
        tile = plgpu.load(words_ref.at[jnp.where(live, src, 0), pl.ds(pl.program_id(1) * block, block)],
                          mask=mask, other=0)
        plgpu.store(words_ref.at[jnp.where(live, dst, 0), pl.ds(pl.program_id(1) * block, block)],
                    tile, mask=mask)


def _move_rows_pallas(buf, src_rows, dst_rows, *, interpret: bool, config: RowMoveConfig):
    src = src_rows.astype(jnp.int32)
    dst = dst_rows.astype(jnp.int32)
    if src.ndim == 1:
        src, dst = src[None], dst[None]
    groups, pairs = src.shape
    if pairs == 0 or groups == 0:
        return buf
    words, _ = _word_view(buf)
    num_words = words.shape[1]
    block = min(next_pow2(num_words), config.max_block_words)
    grid = (groups, pl.cdiv(num_words, block))
    kernel = functools.partial(_move_rows_kernel, pairs=pairs, words=num_words, block=block)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    moved = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(words.shape, words.dtype),
        grid=grid,
        in_specs=[any_spec, any_spec, any_spec],
        out_specs=any_spec,
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="move_rows",
    )(src, dst, words)
    return _from_word_view(moved, buf)


def move_rows(buf: jax.Array, src_rows: jax.Array, dst_rows: jax.Array, *, backend: str | None = None,
              config: RowMoveConfig | None = None) -> jax.Array:
    """Entry point; see module docstring. `buf [S, ...]`, `src_rows/dst_rows [M] or [G, M] int32`,
    `config` None = `default_config()`.

    Returns the updated buffer; with `buf` donated at the jit boundary the update is in place.
    """
    _check_args(buf, src_rows, dst_rows)
    kind = resolve_backend(backend)
    if kind == "reference":
        return move_rows_reference(buf, src_rows, dst_rows)
    config = default_config() if config is None else config
    return _move_rows_pallas(buf, src_rows, dst_rows, interpret=(kind == "interpret"), config=config)


def pack_path_rows(buf: jax.Array, path: jax.Array, accept_len: jax.Array, *,
                   backend: str | None = None, config: RowMoveConfig | None = None) -> jax.Array:
    """Moves row path[b, d] of request b to row d for d < accept_len[b], in place.

    `buf [B, T, ...]`, `path [B, T] int32` (path[b, d] = node at depth d, increasing),
    `accept_len [B] int32` -> buf whose row d holds the old row path[b, d] for d < accept_len;
    rows at and after accept_len keep whatever they held. One group of pairs per request (rows
    disjoint, so requests move in parallel); path[d] >= d keeps the in-place walk safe. The
    ReplaySSM commits of GDN ([k | v | a | b] rows) and Mamba2 ([B | x | dt] rows) both pack this way.
    """
    nb, t = buf.shape[:2]
    if path.shape != (nb, t) or accept_len.shape != (nb,):
        raise ValueError(f"path must be [B, T] = {(nb, t)} and accept_len [B] = {(nb,)}, got {path.shape}, "
                         f"{accept_len.shape}")
    depth = jnp.arange(t, dtype=jnp.int32)[None, :]
    base = (jnp.arange(nb, dtype=jnp.int32) * t)[:, None]
    src = jnp.where(depth < accept_len[:, None], base + path.astype(jnp.int32), -1)
    flat = move_rows(buf.reshape((nb * t,) + buf.shape[2:]), src, base + depth, backend=backend, config=config)
    return flat.reshape(buf.shape)
