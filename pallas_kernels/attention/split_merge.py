"""Merge of key-split attention partials by their base-2 log-sum-exp, in one Pallas kernel.

A decode that splits the key axis (to fill the GPU at small batches) leaves per split a partial
output normalised over its own keys and that split's lse2. The merged row is
`sum_s 2^(lse_s - m) out_s / sum_s 2^(lse_s - m)` with m the largest lse; splits that saw no key
(lse = -inf) drop out, and a row no split saw gets output 0 and lse -inf.

`merge_splits_reference` is the XLA form (XLA runs it as two kernels: the weights, then the weighted
sum). `merge_splits` runs one Pallas kernel instead (`MergeConfig.kernel`): each program takes a
block of rows of every split, forms the weights in registers and writes the merged rows in
`out_dtype`, so a bf16 cascade output needs no separate cast either. results: merge-kernel.

Launch knobs: `MergeConfig` (frozen); `default_config()` is what `merge_splits` runs when given none.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_backend

# Rows of one tile of the heads-layout lse order (`head_io_rows`): a Mosaic warpgroup's 64 rows
# (prefix_decode_mgpu.ROWS_PER_WG), G boxes of 64 / G query rows, one per head of the KV head.
HEAD_IO_TILE = 64
# Output dtypes the merge writes (and the decodes that hand it their partials): float32 or 16-bit.
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """Launch knobs of `merge_splits`; `default_config()` gives the default. Read when a caller is
    traced, so a config is part of the traced program (the callers pass it as a static argument)."""
    # Whether compiled merges run the Pallas kernel (False: the XLA reference, then cast).
    # Interpreted runs (the CPU tests) always run the kernel. results: merge-kernel.
    kernel: bool = True
    # Elements of one split's rows a program merges (rows x D): 2,048 gives the B=1, Hq=32, R=64,
    # D=128 merge 128 programs, about one per H200 SM. results: merge-kernel.
    elements_per_program: int = 2048
    # Warps per program. results: merge-kernel.
    num_warps: int = 16

    def __post_init__(self):
        if not isinstance(self.kernel, bool):
            raise ValueError(f"MergeConfig.kernel must be True or False, got {self.kernel!r}")
        if self.elements_per_program < 1 or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"MergeConfig: elements_per_program must be >= 1 and num_warps a power of two, "
                             f"got {self.elements_per_program}, {self.num_warps}")


def default_config() -> MergeConfig:
    """The merge's launch for every shape: the Pallas kernel, 2,048 elements per program, 16 warps
    (one launch served all four split shapes timed; results: merge-kernel)."""
    return MergeConfig()


def merge_splits_reference(out: jax.Array, lse: jax.Array, axis: int = 0):
    """`out [..., S, ..., D]` (the splits at `axis`), `lse` the same without D (base 2) -> (out, lse)
    without that axis, float32. Reductions over the split axis (see the module docstring)."""
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp2(lse - m_safe)  # exp2(-inf) = 0: empty splits drop out
    total = jnp.sum(w, axis=axis)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    acc = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=axis)
    merged = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    return merged, jnp.where(seen, jnp.squeeze(m_safe, axis) + jnp.log2(safe), -jnp.inf)


def split_weights(lses):
    """Inside a kernel: the lse2 rows of S splits -> (m their max, m_safe (0 where m is -inf), the
    per-split weights 2^(lse_s - m_safe), their sum); a split that saw none of a row's keys
    (lse2 -inf) weighs 0. Shared by the merge kernel and the window kernel's split start."""
    m = functools.reduce(jnp.maximum, lses)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    weights = [jnp.exp2(lse - m_safe) for lse in lses]
    return m, m_safe, weights, functools.reduce(jnp.add, weights)


def _merge_kernel(o_ref, l_ref, out_ref, lse_ref, *, splits: int, lse_transposed: bool):
    """o_ref [S, rows, D], l_ref [S, rows] -> out_ref [rows, D], lse_ref [rows]; with
    `lse_transposed` o_ref [S, per, G, dc], l_ref [S, G, per] -> out_ref [per, G, dc], lse_ref
    [per, G] (a heads-layout tile, its lse read in the kernel-row order)."""
    _, m_safe, weights, total = split_weights(
        [l_ref[s, :, :].T if lse_transposed else l_ref[s, :] for s in range(splits)])
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for s, w in enumerate(weights):
        acc = acc + w[..., None] * o_ref[s].astype(jnp.float32)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out_ref[...] = jnp.where(seen[..., None], acc / safe[..., None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_safe + jnp.log2(safe), -jnp.inf)


def rows_per_program(rows: int, d: int, config: MergeConfig | None = None) -> int:
    """The largest power of two dividing `rows` up to `config.elements_per_program // d` (at least 1;
    None: `default_config()`)."""
    cap = max(1, (config or default_config()).elements_per_program // d)
    return math.gcd(rows & -rows, 1 << (cap.bit_length() - 1))


def kept_rows_errors(kept_rows: int, rows: int) -> list[str]:
    """Why the first `kept_rows` of each T = `rows`-row tile cannot be merged alone (empty: they
    can): they are one Triton block, so a power of two dividing T."""
    if kept_rows < 1 or kept_rows & (kept_rows - 1) or rows % kept_rows:
        return [f"merge_splits: kept_rows must be a power of two (a Triton block) dividing T={rows}, got {kept_rows}"]
    return []


def merge_split_errors(out, lse, axis: int, out_dtype, heads_group: int = 0, kept_rows: int = 0) -> list[str]:
    """Why (out, lse) cannot be merged over `axis` (empty: they can)."""
    errors = []
    if kept_rows:
        rows = lse.shape[-1] if lse.ndim else 0
        if heads_group or axis != 0 or lse.ndim < 2:
            errors.append(f"merge_splits: kept_rows takes splits on axis 0 of lse [S, ..., T] without heads_group, "
                          f"got axis {axis}, lse {lse.shape}, heads_group {heads_group}")
        else:
            errors += kept_rows_errors(kept_rows, rows)
    if not 0 <= axis < lse.ndim:
        errors.append(f"merge_splits: axis must be in [0, {lse.ndim}) for lse {lse.shape}, got {axis}")
    d = out.shape[-1] if out.ndim else 0
    if heads_group:
        errors += _heads_layout_errors(out, lse, axis, heads_group)
    elif out.shape[:-1] != lse.shape:
        errors.append(f"merge_splits: out {out.shape} must be lse {lse.shape} plus a trailing D")
    if d < 1 or d & (d - 1):
        errors.append(f"merge_splits: D must be a power of two (a Triton block), got {d}")
    return errors + out_dtype_errors(out_dtype, "merge_splits")


def _heads_layout_errors(out, lse, axis: int, group: int) -> list[str]:
    """Why out [S, B, R, Hq, D] and lse [S, B, Hkv, R * G] (the `head_io_rows` order) are not a
    heads-layout split set of group G (empty: they are)."""
    if group < 1 or group & (group - 1) or HEAD_IO_TILE % group:
        return [f"merge_splits: heads_group must be a power of two dividing {HEAD_IO_TILE}, got {group}"]
    if axis != 0 or out.ndim != 5 or lse.ndim != 4:
        return [f"merge_splits: heads_group needs out [S, B, R, Hq, D] and lse [S, B, Hkv, R * G] split on "
                f"axis 0, got out {out.shape}, lse {lse.shape}, axis {axis}"]
    s, b, r, hq, _ = out.shape
    expect = (s, b, hq // group, r * group)
    if hq % group or lse.shape != expect or (r * group) % HEAD_IO_TILE:
        return [f"merge_splits: heads_group {group}: out {out.shape} needs Hq a multiple of G, lse {expect} "
                f"(got {lse.shape}) and R * G a multiple of {HEAD_IO_TILE}"]
    return []


def head_io_rows(x, group: int, inverse: bool = False):
    """The heads-layout kernel row order: row t = 64 w + g (64 / G) + i is query row w (64 / G) + i
    of head g of the KV head (tile w; 64 = HEAD_IO_TILE). `x [..., B, R, Hkv * G]` -> that order
    `[..., B, Hkv, R * G]`; with `inverse` back."""
    per = HEAD_IO_TILE // group
    nlead = x.ndim - 3
    lead = tuple(range(nlead))
    if inverse:
        *shape, b, hkv, total = x.shape
        x = x.reshape(*shape, b, hkv, total // HEAD_IO_TILE, group, per)
        x = jnp.transpose(x, lead + tuple(nlead + a for a in (0, 2, 4, 1, 3)))  # [B, W, per, Hkv, G]
        return x.reshape(*shape, b, total // group, hkv * group)
    *shape, b, r, hq = x.shape
    x = x.reshape(*shape, b, r // per, per, hq // group, group)
    x = jnp.transpose(x, lead + tuple(nlead + a for a in (0, 3, 1, 4, 2)))  # [B, Hkv, W, G, per]
    return x.reshape(*shape, b, hq // group, r * group)


def head_io_rows_errors(query_rows: int, group: int, what: str) -> list[str]:
    """Why R query rows of G heads per KV head have no `head_io_rows` order (empty: they do): a
    64-row tile must be whole boxes of 64 / G >= 8 query rows (one shared-memory tile row group of
    the Mosaic kernels), one per head, so G must be a power of two up to 8 and R a multiple of
    64 / G. `what` names the caller in the message."""
    if group & (group - 1) or not 1 <= group <= 8:
        return [f"{what} needs a GQA group of 1, 2, 4 or 8 heads, got {group}"]
    if query_rows % (HEAD_IO_TILE // group):
        return [f"{what} needs R a multiple of 64 / G = {HEAD_IO_TILE // group}, got R={query_rows}"]
    return []


def out_dtype_errors(out_dtype, what: str) -> list[str]:
    """Why `out_dtype` is not one of OUT_DTYPES (empty: it is), naming `what` refuses it."""
    try:
        if jnp.dtype(out_dtype) in OUT_DTYPES:
            return []
        got = jnp.dtype(out_dtype).name
    except TypeError:
        got = repr(out_dtype)
    return [f"{what}: out_dtype must be one of {[t.name for t in OUT_DTYPES]}, got {got}"]


def merge_splits(out: jax.Array, lse: jax.Array, axis: int = 0, *, out_dtype=jnp.float32,
                 backend: str | None = None, heads_group: int = 0, kept_rows: int = 0,
                 config: MergeConfig | None = None):
    """LSE merge of key-split partials: `out [..., S, ..., D]` (the splits at `axis`; float32 or
    16-bit), `lse` the same without D (float32, base 2) -> (out in `out_dtype`, lse float32)
    without that axis. `backend` as `pallas_kernels.common`: "reference" is
    `merge_splits_reference` (then cast), as is a compiled merge under `MergeConfig(kernel=False)`.
    `config`: launch knobs (`MergeConfig`); None = `default_config()`.

    `heads_group` G > 0: the fused Mosaic prefix's heads layout, `out [S, B, R, Hq, D]` with
    `lse [S, B, Hkv, R * G]` in `head_io_rows` order -> `[B, R, Hq, D]`, `[B, R, Hq]`. The kernel
    reads lse in that order itself (each program a tile of 64 / G query rows x G heads), so no
    transpose runs before it (an XLA transpose would be one more kernel).

    `kept_rows` k > 0 (splits on axis 0, `lse [S, ..., T]`): only the first k of the last axis's T
    rows are merged and returned, `[..., k, D]` and `[..., k]`: a padded row tile's real rows, so
    no slice runs after the merge (at the 8B step's B = 1 that slice was a launch a layer)."""
    errors = merge_split_errors(out, lse, axis, out_dtype, heads_group, kept_rows)
    if errors:
        raise ValueError("; ".join(errors))
    config = default_config() if config is None else config
    kind = resolve_backend(backend)
    if kind == "reference" or (kind == "compiled" and not config.kernel):
        if kept_rows:
            out, lse = out[..., :kept_rows, :], lse[..., :kept_rows]
        merged, merged_lse = merge_splits_reference(
            out, head_io_rows(lse, heads_group, inverse=True) if heads_group else lse, axis)
        return merged.astype(out_dtype), merged_lse
    call = functools.partial(
        pl.pallas_call, interpret=kind == "interpret", name="merge_splits",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1))
    if heads_group:
        return _merge_heads_layout(call, out, lse.astype(jnp.float32), heads_group, out_dtype, config)
    if kept_rows:
        return _merge_kept_rows(call, out, lse.astype(jnp.float32), kept_rows, out_dtype)
    splits, d = lse.shape[axis], out.shape[-1]
    lead = math.prod(lse.shape[:axis])
    rows = math.prod(lse.shape[axis + 1:])
    block = rows_per_program(rows, d, config)
    merged, merged_lse = call(
        functools.partial(_merge_kernel, splits=splits, lse_transposed=False),
        grid=(rows // block, lead),
        in_specs=[pl.BlockSpec((None, splits, block, d), lambda i, a: (a, 0, i, 0)),
                  pl.BlockSpec((None, splits, block), lambda i, a: (a, 0, i))],
        out_specs=(pl.BlockSpec((None, block, d), lambda i, a: (a, i, 0)),
                   pl.BlockSpec((None, block), lambda i, a: (a, i))),
        out_shape=(jax.ShapeDtypeStruct((lead, rows, d), out_dtype),
                   jax.ShapeDtypeStruct((lead, rows), jnp.float32)),
    )(out.reshape(lead, splits, rows, d), lse.astype(jnp.float32).reshape(lead, splits, rows))
    kept = lse.shape[:axis] + lse.shape[axis + 1:]
    return merged.reshape(kept + (d,)), merged_lse.reshape(kept)


def _merge_kept_rows(call, out, lse, kept: int, out_dtype):
    """The kernel over the first `kept` rows of each row tile (see merge_splits): program i merges
    rows [0, kept) of tile i of `out [S, ..., T, D]`, `lse [S, ..., T]`; the other rows are never
    read."""
    splits, *tiles_shape, rows = lse.shape
    d = out.shape[-1]
    tiles = math.prod(tiles_shape)
    merged, merged_lse = call(
        functools.partial(_merge_kernel, splits=splits, lse_transposed=False),
        grid=(tiles,),
        in_specs=[pl.BlockSpec((splits, None, kept, d), lambda i: (0, i, 0, 0)),
                  pl.BlockSpec((splits, None, kept), lambda i: (0, i, 0))],
        out_specs=(pl.BlockSpec((None, kept, d), lambda i: (i, 0, 0)),
                   pl.BlockSpec((None, kept), lambda i: (i, 0))),
        out_shape=(jax.ShapeDtypeStruct((tiles, kept, d), out_dtype),
                   jax.ShapeDtypeStruct((tiles, kept), jnp.float32)),
    )(out.reshape(splits, tiles, rows, d), lse.reshape(splits, tiles, rows))
    return merged.reshape(*tiles_shape, kept, d), merged_lse.reshape(*tiles_shape, kept)


def _merge_heads_layout(call, out, lse, group: int, out_dtype, config: MergeConfig):
    """The kernel over heads-layout tiles (see merge_splits): program (D chunk, tile w, KV head h,
    request b) merges query rows [w per, (w + 1) per) x heads [h G, (h + 1) G) x one D chunk."""
    s, b, r, hq, d = out.shape
    hkv, per = hq // group, HEAD_IO_TILE // group
    tiles = r // per
    dc = min(d, max(1, config.elements_per_program // HEAD_IO_TILE))
    merged, merged_lse = call(
        functools.partial(_merge_kernel, splits=s, lse_transposed=True),
        grid=(d // dc, tiles, hkv, b),
        in_specs=[pl.BlockSpec((s, None, None, per, None, group, dc), lambda c, w, h, bb: (0, bb, w, 0, h, 0, c)),
                  pl.BlockSpec((s, None, None, None, group, per), lambda c, w, h, bb: (0, bb, h, w, 0, 0))],
        # Every D chunk's program writes its tile's lse (the same values).
        out_specs=(pl.BlockSpec((None, None, per, None, group, dc), lambda c, w, h, bb: (bb, w, 0, h, 0, c)),
                   pl.BlockSpec((None, None, per, None, group), lambda c, w, h, bb: (bb, w, 0, h, 0))),
        out_shape=(jax.ShapeDtypeStruct((b, tiles, per, hkv, group, d), out_dtype),
                   jax.ShapeDtypeStruct((b, tiles, per, hkv, group), jnp.float32)),
    )(out.reshape(s, b, tiles, per, hkv, group, d), lse.reshape(s, b, hkv, tiles, group, per))
    return merged.reshape(b, r, hq, d), merged_lse.reshape(b, r, hq)


__all__ = ["HEAD_IO_TILE", "MergeConfig", "OUT_DTYPES", "default_config", "head_io_rows", "kept_rows_errors",
           "merge_splits", "split_weights", "merge_splits_reference", "merge_split_errors",
           "out_dtype_errors", "rows_per_program"]
