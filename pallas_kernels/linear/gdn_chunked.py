"""GDN chunked tree form: all nodes of a tree (T <= MAX_CHUNKED_NODES = 64) at once, no node states kept.

The ancestor mask replaces the causal mask of the chunked delta rule (see `gdn_chunked_reference`
for the math). Parents precede children, so M (strict ancestors) is strictly lower triangular and
(I + M) is inverted by recursive 2 x 2 block inversion (log2(chunk) levels of dots), then applied.
Rows are padded to `chunk = max(16, next power of two >= T)` (16, 32 or 64): Triton block shapes
must be powers of two and dot operands at least 16 wide. Padded rows (t >= T) have an all-zero mask
row: they are nobody's ancestor and are never stored. The packed ancestor row holds bits 0..31 in
word 0 and 32..63 in word 1 (`pallas_kernels.tree_masks`); word 1 is read only when chunk > 32.

Fused form: one program per (request b, value head hv, dv-tile); every dv column of
the solve is independent, so each program recomputes the small `[chunk, chunk]` matrices and
handles `block_v` columns. Two-pass form (`two_pass=True`; by default past 16 padded rows, and at
16 on grids of at least `GdnKernelConfig.two_pass_min_programs` (b, hv) pairs): `_factor_kernel` per (b, hv) folds the key side into Q' and P
once, `_apply_kernel` per dv tile computes out = Q' h0 + P v; its variant (`apply_reads_keys`, by
default from 64 padded rows) keeps only P and decay in the first kernel and has the second read q
and k. The factor kernels work on whole [chunk, chunk] tiles: 16-row tiles with block forward
substitution (88 small dots at 64 rows instead of 15 large ones) are slower
(results: gdn-factor). Every form writes the node's replay payload row pieces `[k | v | a | b]`
as they are read (v by every value head's tiles, a/b by every value head, k by the first value head
of each key head). With 16-bit q and k every form by default (`input_dtype_grams`) forms q k^T and
k k^T from the rows as loaded in one tensor-core pass and applies the row factors afterwards.

Public entry point: `gdn_chunked_verify(...)` with `backend=None|"pallas"|"interpret"|"reference"`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, resolve_backend, with_overrides
from pallas_kernels.linear.chunked_common import FP32_DOTS, MAX_CHUNKED_NODES, load_ancestor_tile
from pallas_kernels.linear.gdn_common import default_scale, gates, gdn_dims, l2_norm_factor
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_reference import gdn_chunked_reference
from pallas_kernels.linear.gdn_tree import MAX_NUM_WARPS, GdnKernelConfig, check_payload, default_config, pick_launch
from pallas_kernels.tree_masks import unpack_mask_rows

# Fewest padded rows: a Triton dot needs every operand dim >= 16.
MIN_CHUNK = 16

# Two-pass form launches: the factor kernel's warps, the apply kernel's default dv tile (by padded
# rows: 64 columns up to 32 rows, 32 at 64) and warps. The fewest (B, HV) programs at which it runs
# at 16 padded rows is `GdnKernelConfig.two_pass_min_programs`.
# results: gdn-block-v
TWO_PASS_FACTOR_WARPS = 4
TWO_PASS_BLOCK_V = {16: 64, 32: 64, 64: 32}
TWO_PASS_APPLY_WARPS = 4
# Fewest padded rows at which `apply_reads_keys=None` runs the two-pass variant whose apply kernel
# reads q and k (below it the other two-pass form is as fast or faster).
# results: gdn-apply-reads-keys
APPLY_READS_KEYS_MIN_ROWS = 64
# Input dtypes whose pairwise products are exact in fp32 (8- and 11-bit significands), so that
# `input_dtype_grams` loses nothing against fp32 rows; `input_dtype_grams=None` turns it on for them
# (faster than fp32 rows, agreeing to 1e-6-5e-5).
# results: gdn-grams
INPUT_DTYPE_GRAM_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def chunk_rows(num_nodes: int) -> int:
    """Rows a tree of num_nodes nodes pads to in the chunked forms: 16, 32 or 64."""
    return max(MIN_CHUNK, next_pow2(num_nodes))


def default_two_pass(batch: int, num_v_heads: int, chunk: int = MIN_CHUNK,
                     config: GdnKernelConfig | None = None) -> bool:
    """Whether `gdn_chunked_verify(two_pass=None)` runs the two-pass form at `chunk` padded rows:
    always past MIN_CHUNK rows, and at MIN_CHUNK rows when its factor kernel's (B, HV) grid has at
    least `config.two_pass_min_programs` programs (None: the field's default)."""
    min_programs = (config or GdnKernelConfig()).two_pass_min_programs
    return chunk > MIN_CHUNK or batch * num_v_heads >= min_programs


def default_input_dtype_grams(q_dtype, k_dtype) -> bool:
    """Whether `gdn_chunked_verify(input_dtype_grams=None)` forms the grams from the rows as loaded:
    when q and k share one INPUT_DTYPE_GRAM_DTYPES dtype."""
    return jnp.dtype(q_dtype) == jnp.dtype(k_dtype) and jnp.dtype(q_dtype) in INPUT_DTYPE_GRAM_DTYPES


def two_pass_block_v(chunk: int, head_v_dim: int) -> int:
    """The two-pass apply kernel's default dv tile at `chunk` padded rows (TWO_PASS_BLOCK_V)."""
    return min(TWO_PASS_BLOCK_V[chunk], head_v_dim)


def default_apply_reads_keys(chunk: int) -> bool:
    """Whether the two-pass form runs its apply-reads-keys variant by default at `chunk` padded rows."""
    return chunk >= APPLY_READS_KEYS_MIN_ROWS


def _dot_t(x, y, precision):
    """x @ y^T for 2-D tiles."""
    return jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _dot(x, y, precision):
    return jnp.dot(x, y, precision=precision, preferred_element_type=jnp.float32)


def _load_qk_raw(q_ref, k_ref, *, b, kh, node_rows, live, use_qk_l2norm: bool, scale: float):
    """Key head kh's query and key rows as loaded (input dtype) and the per-row factors that make them
    what the update uses: q = q_raw * q_scale[:, None], k = k_raw * k_scale[:, None] (fp32; L2
    normalisation, optional, and the query scale). Returns (q_raw, k_raw, q_scale, k_scale)."""
    k_raw = plgpu.load(k_ref.at[b, node_rows, kh, :], mask=live[:, None], other=0)
    q_raw = plgpu.load(q_ref.at[b, node_rows, kh, :], mask=live[:, None], other=0)
    if use_qk_l2norm:
        q_scale, k_scale = (l2_norm_factor(x) for x in (q_raw, k_raw))
    else:
        q_scale = k_scale = jnp.ones((q_raw.shape[0],), jnp.float32)
    return q_raw, k_raw, q_scale * scale, k_scale


def _load_qk(q_ref, k_ref, *, b, kh, node_rows, live, use_qk_l2norm: bool, scale: float):
    """Key head kh's query and key rows as the update uses them: fp32, optionally L2-normalised, q
    scaled. Returns (q, k, k_raw) with k_raw as loaded (the payload keeps it)."""
    q_raw, k_raw, q_scale, k_scale = _load_qk_raw(q_ref, k_ref, b=b, kh=kh, node_rows=node_rows, live=live,
                                                  use_qk_l2norm=use_qk_l2norm, scale=scale)
    return (q_raw.astype(jnp.float32) * q_scale[:, None], k_raw.astype(jnp.float32) * k_scale[:, None], k_raw)


def _store_out_and_v_payload(o_ref, payload_ref, out, v_raw, *, b, hv, vt, block_v: int, dv: int, node_rows, live,
                             layout: GdnPayloadLayout):
    """One dv tile's output rows, and the v columns of the payload rows (as loaded)."""
    plgpu.store(o_ref.at[b, node_rows, hv, pl.ds(vt * block_v, block_v)], out.astype(o_ref.dtype),
                mask=live[:, None])
    plgpu.store(payload_ref.at[b, node_rows, pl.ds(layout.v_offset + hv * dv + vt * block_v, block_v)],
                v_raw, mask=live[:, None])


def _invert_unit_lower(m, rows: int, precision):
    """(I + m)^-1 for a strictly lower triangular `[rows, rows]` m, by recursive block inversion:
    log2(rows) levels, all but the first of two dots each (no serial substitution). X holds the
    inverses of the diagonal blocks of size s; for each 2s block [[A, 0], [C, D]] the inverse is
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]], i.e. X <- X - X N X with N the C blocks of I + m. Unlike the
    power series sum (-m)^j, whose terms grow like beta^j C(depth, j) and cancel (1e6 relative error
    at 64 nodes of correlated keys), every product here is of true inverse blocks."""
    idx = jnp.arange(rows, dtype=jnp.int32)

    def level_blocks(s):  # N at level s: the C blocks of m, (odd s-block row, its left neighbour)
        row_block, col_block = idx[:, None] // s, idx[None, :] // s
        return jnp.where((row_block % 2 == 1) & (col_block == row_block - 1), m, 0.0)

    # The first level needs no dots: with X = I (1 x 1 blocks of a unit diagonal), X - X N X = I - N.
    inv = (idx[:, None] == idx[None, :]).astype(jnp.float32) - level_blocks(1)
    s = 2
    while s < rows:
        inv = inv - _dot(_dot(inv, level_blocks(s), precision), inv, precision)
        s *= 2
    return inv


def _key_side(mask_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, *, nodes: int, chunk: int, group: int,
              use_qk_l2norm: bool, scale: float, precision, input_dtype_grams: bool = False):
    """The value-independent part of the program's (request b, value head hv) = program ids 0, 1 (key
    head kh = hv // group; all three are returned): inputs as loaded, the gates and the
    [chunk, chunk] factors, A = decay_ts * q k^T among them (formed before the inversion, so a caller
    that needs no [chunk, dk] tile afterwards does not hold q and k through it). Rows t >= nodes are
    padding (zero inputs, all-zero mask rows). `input_dtype_grams`: q k^T and k k^T come from the
    16-bit rows as loaded (every product exact in fp32, one tensor-core pass) scaled by the row factors
    afterwards, instead of from the fp32 normalised rows with `precision`; q and k are then the
    normalised rows formed on use."""
    b = pl.program_id(0)
    hv = pl.program_id(1)
    kh = hv // group
    rows = jnp.arange(chunk, dtype=jnp.int32)
    live = rows < nodes
    node_rows = pl.ds(0, chunk)

    anc = load_ancestor_tile(mask_ref, b, chunk, live)  # [t, s]
    q_raw, k_raw, q_scale, k_scale = _load_qk_raw(q_ref, k_ref, b=b, kh=kh, node_rows=node_rows, live=live,
                                                  use_qk_l2norm=use_qk_l2norm, scale=scale)
    q = q_raw.astype(jnp.float32) * q_scale[:, None]
    k = k_raw.astype(jnp.float32) * k_scale[:, None]
    if input_dtype_grams:
        kk = _dot_t(k_raw, k_raw, None) * k_scale[:, None] * k_scale[None, :]
        qk = _dot_t(q_raw, k_raw, None) * q_scale[:, None] * k_scale[None, :]
    else:
        kk, qk = _dot_t(k, k, precision), _dot_t(q, k, precision)
    a_raw = plgpu.load(a_ref.at[b, node_rows, hv], mask=live, other=0)
    b_raw = plgpu.load(b_ref.at[b, node_rows, hv], mask=live, other=0)

    g, beta = gates(a_raw, b_raw, alog_ref[hv], dtb_ref[hv])
    g = jnp.where(live, g, 0.0)
    big_g = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)  # log-decay from the root to t
    # G_t - G_s <= 0 on ancestor pairs (g <= 0); the min keeps masked pairs from overflowing.
    decay_ts = jnp.where(anc, jnp.exp(jnp.minimum(big_g[:, None] - big_g[None, :], 0.0)), 0.0)
    strict = anc & (rows[:, None] != rows[None, :])
    m = jnp.where(strict, beta[:, None] * decay_ts * kk, 0.0)
    attn = decay_ts * qk

    inv = _invert_unit_lower(m, chunk, precision)
    return dict(b=b, hv=hv, kh=kh, live=live, node_rows=node_rows, k_raw=k_raw, a_raw=a_raw, b_raw=b_raw, k=k,
                q=q, beta=beta, big_g=big_g, inv=inv, attn=attn)


def _store_key_payload(payload_ref, x, *, group: int, dk: int, layout: GdnPayloadLayout, first_tile):
    """The payload row pieces one value head owns besides its v columns: a and b (every value head,
    on its first dv tile) and k (the first value head of each key head); `x` is `_key_side`'s."""
    b, hv, kh, live, node_rows = (x[n] for n in ("b", "hv", "kh", "live", "node_rows"))

    @pl.when(first_tile)
    def _():
        plgpu.store(payload_ref.at[b, node_rows, layout.a_offset + hv], x["a_raw"], mask=live)
        plgpu.store(payload_ref.at[b, node_rows, layout.b_offset + hv], x["b_raw"], mask=live)

    @pl.when(first_tile & (hv % group == 0))
    def _():
        plgpu.store(payload_ref.at[b, node_rows, pl.ds(kh * dk, dk)], x["k_raw"], mask=live[:, None])


def _chunked_kernel(mask_ref, slots_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref,
                    pool_ref, _payload_in_ref, o_ref, payload_ref, *, block_v: int, layout: GdnPayloadLayout,
                    precision, **key_side):
    """Fused form, one program per (request, value head, dv tile); `key_side`: `_key_side`'s options."""
    x = _key_side(mask_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, precision=precision, **key_side)
    b, hv, live, node_rows, k, q, beta, big_g, attn, inv = (x[n] for n in (
        "b", "hv", "live", "node_rows", "k", "q", "beta", "big_g", "attn", "inv"))
    vt = pl.program_id(2)
    cols = pl.ds(vt * block_v, block_v)
    v_raw = plgpu.load(v_ref.at[b, node_rows, hv, cols], mask=live[:, None], other=0)

    h0 = pool_ref[slots_ref[b], hv, :, cols].astype(jnp.float32)  # [dk, block_v]
    decay = jnp.exp(big_g)[:, None]
    rhs = beta[:, None] * (v_raw.astype(jnp.float32) - decay * _dot(k, h0, precision))
    u = _dot(inv, rhs, precision)
    out = decay * _dot(q, h0, precision) + _dot(attn, u, precision)
    _store_out_and_v_payload(o_ref, payload_ref, out, v_raw, b=b, hv=hv, vt=vt, block_v=block_v, dv=v_ref.shape[-1],
                             node_rows=node_rows, live=live, layout=layout)
    _store_key_payload(payload_ref, x, group=key_side["group"], dk=k_ref.shape[-1], layout=layout,
                       first_tile=vt == 0)


def _factor_kernel(mask_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, _payload_in_ref,
                   qf_ref, p_ref, payload_ref, *, layout: GdnPayloadLayout, precision, **key_side):
    """Two-pass form, pass 1, one program per (request, value head): out = Q' h0 + P v with
    W = (I + M)^-1 diag(beta * decay) k, A = decay_ts * (q k^T) on ancestor-or-self pairs,
    Q' = diag(decay) q - A W  [chunk, dk] and P = A (I + M)^-1 diag(beta)  [chunk, chunk]."""
    x = _key_side(mask_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, precision=precision, **key_side)
    b, hv, k, q, beta, big_g, attn, inv = (x[n] for n in ("b", "hv", "k", "q", "beta", "big_g", "attn", "inv"))
    decay = jnp.exp(big_g)
    w = _dot(inv, (beta * decay)[:, None] * k, precision)
    qf_ref[b, hv] = decay[:, None] * q - _dot(attn, w, precision)
    p_ref[b, hv] = _dot(attn, inv, precision) * beta[None, :]
    _store_key_payload(payload_ref, x, group=key_side["group"], dk=k_ref.shape[-1], layout=layout, first_tile=True)


def _p_factor_kernel(mask_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, _payload_in_ref,
                     p_ref, decay_ref, payload_ref, *, layout: GdnPayloadLayout, precision, **key_side):
    """Two-pass form whose apply kernel reads the keys, pass 1, one program per (request, value head):
    only [chunk, chunk] products leave it, P = A (I + M)^-1 diag(beta) and decay = exp(G) [chunk]; the
    fp32 [chunk, dk] tiles q, k are not used after q k^T and k k^T (no W, no Q'; the raw bf16 k stays
    for the payload store)."""
    x = _key_side(mask_ref, q_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, precision=precision, **key_side)
    b, hv = x["b"], x["hv"]
    p_ref[b, hv] = _dot(x["attn"], x["inv"], precision) * x["beta"][None, :]
    decay_ref[b, hv] = jnp.exp(x["big_g"])
    _store_key_payload(payload_ref, x, group=key_side["group"], dk=k_ref.shape[-1], layout=layout, first_tile=True)


def _apply_keys_kernel(slots_ref, q_ref, k_ref, p_ref, decay_ref, v_ref, pool_ref, _payload_in_ref, o_ref,
                       payload_ref, *, nodes: int, chunk: int, group: int, block_v: int, use_qk_l2norm: bool,
                       scale: float, layout: GdnPayloadLayout, precision):
    """Pass 2 of that form, one program per (request, value head, dv tile):
    out = diag(decay) q h0 + P (v - diag(decay) k h0), the fused kernel's expression with P read."""
    b = pl.program_id(0)
    hv = pl.program_id(1)
    vt = pl.program_id(2)
    kh = hv // group
    cols = pl.ds(vt * block_v, block_v)
    live = jnp.arange(chunk, dtype=jnp.int32) < nodes
    node_rows = pl.ds(0, chunk)
    q, k, _ = _load_qk(q_ref, k_ref, b=b, kh=kh, node_rows=node_rows, live=live, use_qk_l2norm=use_qk_l2norm,
                       scale=scale)
    v_raw = plgpu.load(v_ref.at[b, node_rows, hv, cols], mask=live[:, None], other=0)
    h0 = pool_ref[slots_ref[b], hv, :, cols].astype(jnp.float32)  # [dk, block_v]
    decay = decay_ref[b, hv][:, None]
    delta = v_raw.astype(jnp.float32) - decay * _dot(k, h0, precision)
    out = decay * _dot(q, h0, precision) + _dot(p_ref[b, hv], delta, precision)
    _store_out_and_v_payload(o_ref, payload_ref, out, v_raw, b=b, hv=hv, vt=vt, block_v=block_v, dv=v_ref.shape[-1],
                             node_rows=node_rows, live=live, layout=layout)


def _apply_kernel(slots_ref, qf_ref, p_ref, v_ref, pool_ref, _payload_in_ref, o_ref, payload_ref, *,
                  nodes: int, chunk: int, block_v: int, layout: GdnPayloadLayout, precision):
    """Two-pass form, pass 2, one program per (request, value head, dv tile): out = Q' h0 + P v."""
    b = pl.program_id(0)
    hv = pl.program_id(1)
    vt = pl.program_id(2)
    cols = pl.ds(vt * block_v, block_v)
    live = jnp.arange(chunk, dtype=jnp.int32) < nodes
    node_rows = pl.ds(0, chunk)
    v_raw = plgpu.load(v_ref.at[b, node_rows, hv, cols], mask=live[:, None], other=0)
    h0 = pool_ref[slots_ref[b], hv, :, cols].astype(jnp.float32)  # [dk, block_v]
    out = _dot(qf_ref[b, hv], h0, precision) + _dot(p_ref[b, hv], v_raw.astype(jnp.float32), precision)
    _store_out_and_v_payload(o_ref, payload_ref, out, v_raw, b=b, hv=hv, vt=vt, block_v=block_v, dv=v_ref.shape[-1],
                             node_rows=node_rows, live=live, layout=layout)


def gdn_chunked_verify(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, ancestor_mask, payload,
                       *, use_qk_l2norm: bool = True, scale: float | None = None,
                       config: GdnKernelConfig | None = None, fp32_dots: str | None = None,
                       two_pass: bool | None = None, factor_warps: int | None = None,
                       apply_reads_keys: bool | None = None, input_dtype_grams: bool | None = None,
                       backend: str | None = None):
    """Chunked GDN verify of a tree with T <= MAX_CHUNKED_NODES (64) nodes. Shapes in `gdn_common`.

    ancestor_mask: `[B, T, 2] uint32` packed ancestor-or-self rows (`tree.masks.ancestor_mask`),
    node order with parents before children. payload: `[B, T, width]` buffer for the replay payload
    rows, written in place. Returns `(out [B, T, HV, dv], payload)`. The committed pool is only read.
    `fp32_dots`: "ieee" or "tf32x3" (see FP32_DOTS); None: `config.fp32_dots` ("ieee" by default),
    given: overrides that field.
    `two_pass`: one kernel per (request, value head) folds everything that does not touch v or the
    state into Q' [T, dk] and P [T, T] (fp32, `_factor_kernel`), then one per dv tile computes
    out = Q' h0 + P v (`_apply_kernel`): the key-side work is done once instead of per dv tile and
    neither kernel holds both the key-side tiles and a state tile. False: the single fused kernel.
    None (default): `default_two_pass(B, HV, padded rows, config)`, or two-pass wherever apply_reads_keys
    or factor_warps asks for it. `config` (None = `gdn_tree.default_config(dims)`) sets the fused
    kernel's launch and the two-pass second kernel's (default: `two_pass_block_v` columns, 4 warps) and
    the two-pass grid threshold; `factor_warps` the first kernel's warps (default TWO_PASS_FACTOR_WARPS).
    `apply_reads_keys` (a two-pass variant: True with two_pass=False is refused; None =
    `default_apply_reads_keys(chunk)`, on from 64 padded rows): the first kernel keeps only
    [T, T] products (P and decay, `_p_factor_kernel`) and the second reads q and k itself and computes
    out = diag(decay) q h0 + P (v - diag(decay) k h0) (`_apply_keys_kernel`): two fewer [T, T] x
    [T, dk] products per (request, value head) and no [T, dk] fp32 Q' in HBM, for one more
    [T, dk] x [dk, block_v] product per dv tile. `input_dtype_grams` (16-bit q and k only; every form):
    the key-side kernel forms q k^T and k k^T from the rows as loaded, whose products are exact in
    fp32, in one tensor-core pass, and applies the L2 / query-scale row factors afterwards, instead of
    multiplying the normalised fp32 rows with `fp32_dots` (three passes under "tf32x3"); None
    (default) = `default_input_dtype_grams(q.dtype, k.dtype)`, on for 16-bit q and k.
    """
    if input_dtype_grams is None:
        input_dtype_grams = default_input_dtype_grams(q.dtype, k.dtype)
    elif input_dtype_grams and not default_input_dtype_grams(q.dtype, k.dtype):
        raise ValueError(f"gdn_chunked_verify: input_dtype_grams=True needs q and k of one 16-bit float dtype "
                         f"(their products exact in fp32); got q {q.dtype}, k {k.dtype}")
    dims = gdn_dims(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots)
    if dims.nodes > MAX_CHUNKED_NODES:
        raise ValueError(f"the chunked GDN form covers at most {MAX_CHUNKED_NODES} nodes, got T={dims.nodes}")
    if ancestor_mask.shape != (dims.batch, dims.nodes, 2) or ancestor_mask.dtype != jnp.uint32:
        raise ValueError(f"ancestor_mask must be uint32 [B, T, 2] = {(dims.batch, dims.nodes, 2)}; got "
                         f"{ancestor_mask.dtype} {ancestor_mask.shape}")
    layout = check_payload(dims, payload, k, v, a, b)
    config = with_overrides(default_config(dims) if config is None else config, fp32_dots=fp32_dots)
    scale = default_scale(dims.head_k_dim) if scale is None else float(scale)
    kind = resolve_backend(backend)
    if kind == "reference":
        anc = unpack_mask_rows(ancestor_mask, dims.nodes)
        out, _ = gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, anc,
                                       use_qk_l2norm=use_qk_l2norm, scale=scale)
        return out.astype(v.dtype), pack_payload(k, v, a, b)
    chunk = chunk_rows(dims.nodes)
    precision = FP32_DOTS["ieee" if kind == "interpret" else config.fp32_dots]
    if two_pass is False and apply_reads_keys:
        raise ValueError("gdn_chunked_verify: apply_reads_keys=True is a two-pass form, but two_pass=False "
                         "runs the fused kernel")
    if two_pass is False and factor_warps is not None:
        raise ValueError(f"gdn_chunked_verify: factor_warps={factor_warps} sets the two-pass form's factor kernel, "
                         "but two_pass=False runs the fused kernel")
    if two_pass is None:  # a two-pass knob set explicitly selects the two-pass form
        two_pass = (bool(apply_reads_keys) or factor_warps is not None
                    or default_two_pass(dims.batch, dims.num_v_heads, chunk, config))
    if apply_reads_keys is None:
        apply_reads_keys = two_pass and default_apply_reads_keys(chunk)
    if two_pass:
        return _two_pass(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, ancestor_mask, payload, dims=dims,
                         chunk=chunk, layout=layout, use_qk_l2norm=use_qk_l2norm, scale=scale, config=config,
                         precision=precision, interpret=kind == "interpret",
                         factor_warps=TWO_PASS_FACTOR_WARPS if factor_warps is None else factor_warps,
                         apply_reads_keys=apply_reads_keys, input_dtype_grams=input_dtype_grams)
    block_v, num_warps, num_stages = pick_launch(dims, config, chunked=True)
    kernel = functools.partial(_chunked_kernel, nodes=dims.nodes, chunk=chunk, group=dims.group, block_v=block_v,
                               use_qk_l2norm=use_qk_l2norm, scale=scale, layout=layout, precision=precision,
                               input_dtype_grams=input_dtype_grams)
    out, payload = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(payload.shape, payload.dtype)),
        grid=(dims.batch, dims.num_v_heads, dims.head_v_dim // block_v),
        input_output_aliases={10: 1},
        interpret=kind == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gdn_chunked_verify",
    )(ancestor_mask, state_slots.astype(jnp.int32), q, k, v, a, b, A_log.astype(jnp.float32),
      dt_bias.astype(jnp.float32), state_pool, payload)
    return out, payload


def _two_pass(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, ancestor_mask, payload, *, dims, chunk, layout,
              use_qk_l2norm, scale, config, precision, interpret, factor_warps, apply_reads_keys=False,
              input_dtype_grams=False):
    """`gdn_chunked_verify(two_pass=True)`: `_factor_kernel` then `_apply_kernel` (or, with
    `apply_reads_keys`, `_p_factor_kernel` then `_apply_keys_kernel`)."""
    config = config or GdnKernelConfig()
    dv = dims.head_v_dim
    block_v = config.block_v or two_pass_block_v(chunk, dv)
    if block_v < MIN_CHUNK or block_v & (block_v - 1) or dv % block_v:
        raise ValueError(f"gdn_chunked_verify(two_pass=True): block_v={block_v} must be a power of two "
                         f">= {MIN_CHUNK} dividing dv={dv}")
    factor = two_pass_factor(q, k, a, b, A_log, dt_bias, ancestor_mask, payload, dims=dims, chunk=chunk,
                             layout=layout, use_qk_l2norm=use_qk_l2norm, scale=scale, precision=precision,
                             interpret=interpret, factor_warps=factor_warps, p_only=apply_reads_keys,
                             input_dtype_grams=input_dtype_grams)
    payload = factor[-1]
    if apply_reads_keys:  # (P, decay): the apply kernel reads q and k itself
        apply = functools.partial(_apply_keys_kernel, nodes=dims.nodes, chunk=chunk, group=dims.group,
                                  block_v=block_v, use_qk_l2norm=use_qk_l2norm, scale=scale, layout=layout,
                                  precision=precision)
        operands, name = (q, k) + factor[:2], "gdn_chunked_apply_keys"
    else:  # (Q', P)
        apply = functools.partial(_apply_kernel, nodes=dims.nodes, chunk=chunk, block_v=block_v, layout=layout,
                                  precision=precision)
        operands, name = factor[:2], "gdn_chunked_apply"
    return pl.pallas_call(
        apply,
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(payload.shape, payload.dtype)),
        grid=(dims.batch, dims.num_v_heads, dv // block_v),
        input_output_aliases={len(operands) + 3: 1},  # the payload, after slots, the folds, v and the pool
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps or TWO_PASS_APPLY_WARPS,
                                             num_stages=config.num_stages or 1),
        name=name,
    )(state_slots.astype(jnp.int32), *operands, v, state_pool, payload)


def two_pass_factor(q, k, a, b, A_log, dt_bias, ancestor_mask, payload, *, dims, chunk, layout, use_qk_l2norm,
                    scale, precision, interpret, factor_warps, p_only: bool = False,
                    input_dtype_grams: bool = False):
    """The two-pass form's first kernel alone (the bench times it on its own to split the form's
    time between its passes): `(Q' [B, HV, chunk, dk] f32, P [B, HV, chunk, chunk] f32, payload)`,
    or with `p_only` (the form whose apply kernel reads the keys)
    `(P [B, HV, chunk, chunk] f32, decay [B, HV, chunk] f32, payload)`."""
    if not 1 <= factor_warps <= MAX_NUM_WARPS or factor_warps & (factor_warps - 1):
        raise ValueError(f"two_pass_factor: factor_warps={factor_warps} must be a power of two in [1, {MAX_NUM_WARPS}]")
    bsz, hv, dk = dims.batch, dims.num_v_heads, dims.head_k_dim
    factor = functools.partial(_p_factor_kernel if p_only else _factor_kernel, nodes=dims.nodes, chunk=chunk,
                               group=dims.group, use_qk_l2norm=use_qk_l2norm, scale=scale, layout=layout,
                               precision=precision, input_dtype_grams=input_dtype_grams)
    folds = ((jax.ShapeDtypeStruct((bsz, hv, chunk, chunk), jnp.float32),
              jax.ShapeDtypeStruct((bsz, hv, chunk), jnp.float32)) if p_only else
             (jax.ShapeDtypeStruct((bsz, hv, chunk, dk), jnp.float32),
              jax.ShapeDtypeStruct((bsz, hv, chunk, chunk), jnp.float32)))
    return pl.pallas_call(
        factor,
        out_shape=folds + (jax.ShapeDtypeStruct(payload.shape, payload.dtype),),
        grid=(bsz, hv),
        input_output_aliases={7: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=factor_warps, num_stages=1),
        name="gdn_chunked_p_factor" if p_only else "gdn_chunked_factor",
    )(ancestor_mask, q, k, a, b, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32), payload)
