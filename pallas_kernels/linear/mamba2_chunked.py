"""Mamba2 tree verify in chunked (SSD) form: every node at once, the ancestor mask in place of the
causal mask. The ReplaySSM default of the Mamba2 layer (`Mamba2CommitConfig.verify_form="auto"`;
results: mamba2-chunked).

Why: the recurrent tree scan (`mamba2_tree.mamba2_tree_scan`) walks nodes one by one and, at a
branch, replays the parent's ancestors, so its tree is slower than its chain. Mamba2's
update is linear with a scalar decay per head and node, so the output of node t is a masked
matrix product over its ancestors, with no serial dependency and no replay:

    c_t   = sum over ancestors-or-self s of t of  dt'_s A            (cumulative log decay)
    y_t   = sum_s [s anc-or-self t] (C_t . B_s) exp(c_t - c_s) dt'_s x_s
            + exp(c_t) (C_t . h0) + D x_t                             (h0: the committed state)

(`mamba2_reference.mamba2_tree_scan_reference` computes the same sums.) Per (request, head, tile
of `block_p` channels) one program builds the `[T, T]` weight matrix from C B^T, the decays and the
unpacked ancestor mask, and takes two matrix products: weights @ (dt' x) and C @ h0^T. A chain is
the tree whose mask is lower-triangular. No node state is formed, so only the outputs and, in
"replay" mode, the ReplaySSM payload rows `[B | x | dt]` are written (the commit replays the
accepted path as a chain, unchanged); "staged" mode, which needs every node's state, is refused.

Bounds: T <= MAX_CHUNKED_NODES = 64 (the ancestor mask is two 32-bit words per row), padded to a
power of two >= 16 (Triton dot operands); C B^T multiplies 16-bit inputs natively (exact
products, fp32 sums); the fp32 products are IEEE by default, or three TF32 passes (`fp32_dots`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, require_power_of_two, resolve_backend, with_overrides
from pallas_kernels.linear.chunked_common import FP32_DOTS, MAX_CHUNKED_NODES, load_ancestor_tile
from pallas_kernels.linear.mamba2_reference import mamba2_tree_scan_reference, softplus
from pallas_kernels.linear.mamba2_tree import _check, launch_head_tiles, program_coords
from pallas_kernels.tree_masks import ancestor_mask, chain_parents

CHUNKED_MODES = ("replay", "outputs")


def _chunked_kernel(mask_ref, slots_ref, x_ref, dt_ref, alog_ref, dtb_ref, d_ref, b_ref, c_ref, *refs,
                    T, TP, H, P, N, G, BP, NP, has_z, mode, layout, precision):
    refs = list(refs)
    z_ref = refs.pop(0) if has_z else None
    pool_ref = refs.pop(0)
    if mode == "replay":
        refs.pop(0)  # the aliased payload input; written through its output ref
    y_ref = refs.pop(0)
    side_ref = refs.pop(0) if mode == "replay" else None

    b, h, pt, p0, g, slot, live = program_coords(slots_ref, BP, H, G)
    t_idx = jnp.arange(TP)
    tmask = t_idx < T
    pmask = (p0 + jnp.arange(BP)) < P
    nmask = jnp.arange(NP) < N

    anc = load_ancestor_tile(mask_ref, b, TP, tmask) & tmask[:, None] & tmask[None, :]  # [t, s]

    dt_raw = plgpu.load(dt_ref.at[b, pl.ds(0, TP), h], mask=tmask, other=0.0)
    dtp = jnp.where(tmask, softplus(dt_raw.astype(jnp.float32) + dtb_ref[h].astype(jnp.float32)), 0.0)
    log_decay = dtp * -jnp.exp(alog_ref[h].astype(jnp.float32))
    cum = jnp.sum(jnp.where(anc, log_decay[None, :], 0.0), axis=1)  # [T]
    # s an ancestor of t: c_t - c_s <= 0 (A < 0), so exp never overflows; other pairs are zeroed first.
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, cum[:, None] - cum[None, :], 0.0)), 0.0)

    rows_n = tmask[:, None] & nmask[None, :]
    b_raw = plgpu.load(b_ref.at[b, pl.ds(0, TP), g, pl.ds(0, NP)], mask=rows_n, other=0.0)
    c_raw = plgpu.load(c_ref.at[b, pl.ds(0, TP), g, pl.ds(0, NP)], mask=rows_n, other=0.0)
    rows_p = tmask[:, None] & pmask[None, :]
    x_raw = plgpu.load(x_ref.at[b, pl.ds(0, TP), h, pl.ds(p0, BP)], mask=rows_p, other=0.0)
    xf = x_raw.astype(jnp.float32)

    if jnp.dtype(c_raw.dtype).itemsize == 2:  # 16-bit B/C: exact products on the tensor cores, fp32 sums
        cb = jnp.dot(c_raw, b_raw.T, preferred_element_type=jnp.float32)  # [T, T]
    else:
        cb = jnp.dot(c_raw.astype(jnp.float32), b_raw.astype(jnp.float32).T, precision=precision)
    weights = cb * decay * dtp[None, :]
    y = jnp.dot(weights, xf, precision=precision)  # [T, BP]
    h0 = plgpu.load(pool_ref.at[jnp.maximum(slot, 0), h, pl.ds(p0, BP), pl.ds(0, NP)],
                    mask=(pmask[:, None] & nmask[None, :]) & live, other=0.0).astype(jnp.float32)
    y = y + jnp.exp(cum)[:, None] * jnp.dot(c_raw.astype(jnp.float32), h0.T, precision=precision)
    y = y + d_ref[h].astype(jnp.float32) * xf
    if has_z:
        zf = plgpu.load(z_ref.at[b, pl.ds(0, TP), h, pl.ds(p0, BP)], mask=rows_p, other=0.0).astype(jnp.float32)
        y = y * (zf * jax.nn.sigmoid(zf))
    y = jnp.where(live, y, 0.0)
    plgpu.store(y_ref.at[b, pl.ds(0, TP), h, pl.ds(p0, BP)], y.astype(y_ref.dtype), mask=rows_p)
    if mode == "replay":
        pdt = side_ref.dtype
        plgpu.store(side_ref.at[b, pl.ds(0, TP), pl.ds(layout.x_offset + h * P + p0, BP)], x_raw.astype(pdt),
                    mask=rows_p & live)
        # One program per group writes B and one per head writes dt, so no word is written twice.
        first_of_group = (h % (H // G) == 0) & (pt == 0) & live
        plgpu.store(side_ref.at[b, pl.ds(0, TP), pl.ds(layout.b_offset + g * N, NP)], b_raw.astype(pdt),
                    mask=rows_n & first_of_group)
        plgpu.store(side_ref.at[b, pl.ds(0, TP), layout.dt_offset + h], dt_raw.astype(pdt),
                    mask=tmask & (pt == 0) & live)


@dataclasses.dataclass(frozen=True)
class Mamba2ChunkedConfig:
    """Launch knobs of `mamba2_tree_chunked`; `default_config(headdim)` gives the default."""

    block_p: int  # channels per program (power of two >= 16: a Triton dot operand dim)
    num_warps: int = 4  # Triton warps per program (power of two)
    # fp32 products (`FP32_DOTS`): "ieee" (exact fp32 on the FMA units) or "tf32x3" (three TF32
    # tensor-core passes, about fp32 accuracy; compiled runs only, interpreted runs stay IEEE). The
    # kernel keeps the exact products by default; the Mamba2 layer passes its
    # `Mamba2CommitConfig.fp32_dots` ("tf32x3", faster; results: mamba2-chunked) as
    # `mamba2_tree_chunked`'s `fp32_dots`, which overrides this field.
    fp32_dots: str = "ieee"

    def __post_init__(self):
        require_power_of_two(self, "block_p", minimum=16)
        require_power_of_two(self, "num_warps")
        if self.fp32_dots not in FP32_DOTS:
            raise ValueError(f"Mamba2ChunkedConfig.fp32_dots must be one of {tuple(FP32_DOTS)}, got {self.fp32_dots!r}")


def default_config(headdim: int) -> Mamba2ChunkedConfig:
    """The chunked form's config when given none: next_pow2(headdim) channels per program, at least
    16 (dot operands) and at most 64, 4 warps and IEEE fp32 products."""
    return Mamba2ChunkedConfig(block_p=min(max(16, next_pow2(headdim)), 64))


def mamba2_tree_chunked(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents=None, *, mask=None,
                        z=None, mode="outputs", payload=None, block_p=None, num_warps=None, fp32_dots=None,
                        config=None, backend=None):
    """Chunked Mamba2 tree verify; see the module docstring.

    Shapes as `mamba2_tree.mamba2_tree_scan`: `x [B, T, H, P]`, `dt [B, T, H]`, `A_log/D/dt_bias [H]`,
    `B/C [B, T, G, N]`, `state_pool [S, H, P, N]`, `state_slots [B] int32` (< 0: padded request),
    `parents [B, T] int32` (None: the chain), `z [B, T, H, P]`. `mask [B, T, 2] uint32`: the packed
    ancestor-or-self rows (`tree.masks.ancestor_mask(parents)`; pass the one attention already uses
    to build it once per step). `mode`: "outputs" or "replay" (payload rows `[B | x | dt]` into
    `payload [B, T, width]`, aliased). `config`: launch knobs (`Mamba2ChunkedConfig`); None =
    `default_config(P)`; `block_p`, `num_warps` and `fp32_dots` ("ieee" or "tf32x3", compiled runs
    only; see FP32_DOTS), when given, override the config's field of that name.
    Returns `(y [B, T, H, P] in x.dtype, payload or None)`.
    """
    if mode not in CHUNKED_MODES:
        raise ValueError(f"mamba2_tree_chunked: mode must be one of {CHUNKED_MODES} (the chunked form keeps no "
                         f"node states, so 'staged' needs mamba2_tree_scan), got {mode!r}")
    layout = _check(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents, z, mode, None, payload)
    nb, T, H, P = x.shape
    if not 1 <= T <= MAX_CHUNKED_NODES:
        raise ValueError(f"mamba2_tree_chunked: T must be in [1, {MAX_CHUNKED_NODES}], got {T}")
    if mask is None:
        mask = ancestor_mask(chain_parents(nb, T) if parents is None else parents.astype(jnp.int32))
    if mask.shape != (nb, T, 2) or mask.dtype != jnp.uint32:
        raise ValueError(f"mamba2_tree_chunked: mask must be [B={nb}, T={T}, 2] uint32, got {mask.shape} {mask.dtype}")
    config = default_config(P) if config is None else config
    config = with_overrides(config, block_p=block_p, num_warps=num_warps, fp32_dots=fp32_dots)
    kind = resolve_backend(backend)
    if kind == "reference":
        y, _ = mamba2_tree_scan_reference(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents, z)
        side = None
        if mode == "replay":
            live = state_slots >= 0
            side = jnp.where(live[:, None, None], layout.pack(B, x, dt).astype(payload.dtype), payload)
        return y.astype(x.dtype), side
    G, N = B.shape[2], B.shape[3]
    TP = max(16, next_pow2(T))
    NP = max(16, next_pow2(N))
    BP = config.block_p
    inputs = [mask, state_slots.astype(jnp.int32), x, dt, A_log, dt_bias, D, B, C]
    inputs += ([z] if z is not None else []) + [state_pool]
    kernel = functools.partial(_chunked_kernel, T=T, TP=TP, H=H, P=P, N=N, G=G, BP=BP, NP=NP,
                               has_z=z is not None, mode=mode, layout=layout,
                               precision=FP32_DOTS["ieee" if kind == "interpret" else config.fp32_dots])
    return launch_head_tiles(kernel, inputs, x, payload if mode == "replay" else None,
                             grid=(nb, H, pl.cdiv(P, BP)), num_warps=config.num_warps, interpret=kind == "interpret",
                             name="mamba2_tree_chunked")


__all__ = ["CHUNKED_MODES", "FP32_DOTS", "MAX_CHUNKED_NODES", "Mamba2ChunkedConfig", "default_config",
           "mamba2_tree_chunked"]
