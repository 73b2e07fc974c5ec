"""MLA latent prefix decode: causal multi-query paged attention over the latent cache, base-2 LSE.

Shapes and semantics (one request b):
- `q [B, R, Hq, L + Dr]`: the absorbed query (L = kv_lora_rank latent channels, then Dr = rope_dim
  rotary channels) for R window rows.
- `latent_pool [S, L + Dr]`: slot-major latent rows of one layer; slot of position p is
  `page_table[b, p // page_size] * page_size + p % page_size` (see pallas_kernels/paging.py).
- `prefix_len [B] int32`: P, the committed keys. Row r sees keys [0, P - R + 1 + r) (clipped at 0),
  the same coverage rule as the GQA prefix decode; the window kernel attends the rest.
- score(row, key) = (q_lat . k_lat + q_rope . k_rope) * scale; value = the key's leading L channels.
- Returns `out [B, R, Hq, L] f32` (softmax-weighted values) and `lse2 [B, R, Hq] f32` =
  log2(sum_k 2^(score * log2 e)). A row that sees no key gets out = 0 and lse2 = -inf.

FP8 latent cache (E4M3, unscaled): the query is cast to FP8 (the decode's defined input; the
reference quantises it the same way). The QK products then run either as a native FP8 x FP8 dot
(`fp8_score_dot=True`, Hopper FP8 MMA) or on both operands widened to bf16 (exact); the P.V product
widens the FP8 values to bf16.

Kernel layout: grid (query tile, split, request). The R * Hq query rows of a request (flat index
r * Hq + h, padded to a power of two >= 16) are cut into tiles of `block_q` rows; each program walks
its split's key blocks (`block_k` keys inside one page) with a base-2 online softmax and writes a
normalised partial (out, lse2). The query tile is the fastest grid axis, so the tiles of one
request stream the same latent pages at about the same time and share them through L2. Split-K
partials (used when B * tiles alone cannot fill the GPU) are merged by LSE in plain jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.prefix_decode import split_key_blocks
from pallas_kernels.attention.reference import is_fp8, quantize_query_for_pool
from pallas_kernels.attention.split_merge import merge_splits
from pallas_kernels.common import LOG2E, next_pow2, resolve_backend

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    # Query rows (flat r * Hq + h) per program; power of two >= 16 (dot operand minimum).
    block_q: int = 32
    # Keys per inner step; power of two >= 16 (capped at the page size: a step never crosses a page).
    # None: 64 for 16-bit caches, 32 for FP8 (64 FP8 keys with the FP8 dot spill registers).
    # results: mla.
    block_k: int | None = None
    # Key-axis splits merged by LSE; None picks enough to give the GPU ~2 programs per SM.
    num_splits: int | None = None
    # Streaming multiprocessors to fill when num_splits is None (132: an H200's).
    num_sms: int = 132
    # Triton warps and software-pipeline stages per program (32 rows / 4 warps run as fast as 64 / 8).
    # results: mla.
    num_warps: int = 4
    num_stages: int = 2
    # Under an FP8 cache: multiply FP8 query x FP8 latent natively (Hopper FP8 MMA); False widens
    # both to bf16 first. Same values either way (FP8 is exact in bf16); native is faster.
    # results: mla.
    fp8_score_dot: bool = True
    # Run the key blocks every row of the tile fully sees without masks, reading the next block's
    # page id while the current one computes (faster for both cache dtypes at 2 stages; 3 stages is
    # slower for bf16). results: mla.
    prefetch_page_ids: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if v is None and name == "block_k":
                continue
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two <= 16 and num_stages >= 1, got "
                             f"{self.num_warps}, {self.num_stages}")

    def key_block(self, pool_dtype, page_size: int) -> int:
        """Keys per step for this cache dtype and page size."""
        block = self.block_k
        if block is None:
            block = 32 if jnp.dtype(pool_dtype) == jnp.dtype(FP8) else 64
        if page_size < 16:
            raise ValueError(f"page_size {page_size} is below the 16-key minimum block")
        return min(block, page_size)


def _check(q, latent_pool, page_table, prefix_len, kv_lora_rank, page_size):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, R, Hq, L + Dr], got shape {q.shape}")
    b, _, _, c = q.shape
    if latent_pool.ndim != 2 or latent_pool.shape[1] != c:
        raise ValueError(f"latent_pool must be [S, {c}] to match q's channels, got shape {latent_pool.shape}")
    if not 1 <= kv_lora_rank <= c:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must be in [1, {c}] (q has {c} channels)")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be [B={b}, max_pages] int32, got {page_table.dtype}{list(page_table.shape)}")
    if prefix_len.shape != (b,) or not jnp.issubdtype(prefix_len.dtype, jnp.integer):
        raise ValueError(f"prefix_len must be [B={b}] int32, got {prefix_len.dtype}{list(prefix_len.shape)}")
    if latent_pool.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32),
                                 jnp.dtype(FP8)):
        raise ValueError(f"latent_pool dtype {latent_pool.dtype} is not bf16, f16, f32 or float8_e4m3fn")


def _query_dtype(pool_dtype):
    """dtype the query enters the decode in: the cache's own dtype (FP8 under an FP8 cache)."""
    return jnp.dtype(pool_dtype)


def quantize_query(q: jax.Array, pool_dtype) -> jax.Array:
    """The query the decode multiplies, in the cache's dtype (FP8 under an FP8 cache).

    The barrier keeps the rounding: under jit XLA may otherwise fold a narrowing convert followed by
    a widening one into nothing (excess precision), which would skip the FP8 quantisation.
    """
    target = _query_dtype(pool_dtype)
    if q.dtype == target:
        return q
    if is_fp8(target):  # saturating at +-448, as the GQA query (one FP8 query semantics)
        return quantize_query_for_pool(q, target)
    return jax.lax.optimization_barrier(q.astype(target))


def _qk_dtype(pool_dtype, fp8_score_dot: bool):
    """Operand dtype of the QK product."""
    if jnp.dtype(pool_dtype) == jnp.dtype(FP8) and not fp8_score_dot:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(pool_dtype)


def _pv_dtype(pool_dtype):
    """Operand dtype of the P.V product: FP8 values widen to bf16 (exact)."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(pool_dtype) == jnp.dtype(FP8) else jnp.dtype(pool_dtype)


# -- reference ------------------------------------------------------------------------------------


def mla_decode_reference(q, latent_pool, page_table, prefix_len, *, kv_lora_rank: int, page_size: int,
                         scale: float, whole_pages: bool = False):
    """Pure-jnp fp32 reference; same signature and outputs as `mla_decode`.

    Under an FP8 cache the query is quantised to FP8 first (the decode's defined input); all
    arithmetic after that is fp32. `whole_pages` caps every row's keys at (P // page_size) *
    page_size, the contract of the Mosaic GPU decode (`mla_decode_mgpu`).
    """
    _check(q, latent_pool, page_table, prefix_len, kv_lora_rank, page_size)
    b, r, hq, _ = q.shape
    max_keys = page_table.shape[1] * page_size
    pos = jnp.arange(max_keys, dtype=jnp.int32)
    slots = page_table[:, pos // page_size] * page_size + pos % page_size  # [B, K]
    plen = prefix_len.astype(jnp.int32)
    # Slots past P are never read: clamp them to a slot that exists, then mask K and V to zero.
    in_prefix = pos[None, :] < plen[:, None]
    rows = latent_pool[jnp.where(in_prefix, jnp.clip(slots, 0, latent_pool.shape[0] - 1), 0)]
    rows = jnp.where(in_prefix[..., None], rows.astype(jnp.float32), 0.0)  # [B, K, C]
    qf = quantize_query(q, latent_pool.dtype).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST  # a true fp32 reference on GPU too (no TF32)
    s = jnp.einsum("brhc,bkc->brhk", qf, rows, precision=hi) * (scale * LOG2E)
    cover = plen[:, None] - r + 1 + jnp.arange(r, dtype=jnp.int32)[None, :]  # [B, R]
    if whole_pages:
        cover = jnp.minimum(cover, ((plen // page_size) * page_size)[:, None])
    vis = pos[None, None, :] < cover[:, :, None]  # [B, R, K]
    s = jnp.where(vis[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp2(s - m_safe)
    l = jnp.sum(p, axis=-1)
    out = jnp.einsum("brhk,bkc->brhc", p, rows[..., :kv_lora_rank], precision=hi)
    seen = l > 0
    out = jnp.where(seen[..., None], out / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse2 = jnp.where(seen, m_safe[..., 0] + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, lse2


# -- Pallas kernel --------------------------------------------------------------------------------


def _mla_kernel(pt_ref, plen_ref, ql_ref, qr_ref, lat_ref, o_ref, lse_ref, *, rows_per_req: int, heads: int,
                lora: int, rope: int, block_l: int, block_r: int, block_q: int, block_k: int, page_size: int,
                splits: int, qk_dtype, pv_dtype, scale_log2: float, prefetch_page_ids: bool):
    tile = pl.program_id(0)
    split = pl.program_id(1)
    b = pl.program_id(2)
    plen = plen_ref[b]
    flat = tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
    cover = plen - rows_per_req + 1 + flat // heads  # [BQ] keys [0, cover) are this row's prefix
    ql = ql_ref[...].astype(qk_dtype)  # [BQ, BL]
    qr = qr_ref[...].astype(qk_dtype) if rope else None  # [BQ, BR]
    lat_cols = jnp.arange(block_l, dtype=jnp.int32)
    rope_cols = jnp.arange(block_r, dtype=jnp.int32)
    key_iota = jnp.arange(block_k, dtype=jnp.int32)
    # Column masks only where the block is wider than the channels (static), so full-width loads
    # keep a per-row mask that Triton can still vectorise along the row.
    lat_cols_ok = (lat_cols < lora)[None, :] if block_l != lora else True
    rope_cols_ok = (rope_cols < rope)[None, :] if block_r != rope else True

    lo, hi = split_key_blocks(pl.cdiv(plen, block_k), split, splits)

    def body(j, carry, masked: bool = True, page=None):
        m, l, acc = carry
        k0 = j * block_k
        if page is None:
            page = pt_ref[b, k0 // page_size]
        slot0 = pl.multiple_of(page * page_size + k0 % page_size, block_k)
        kpos = k0 + key_iota
        in_prefix = kpos < plen
        if masked:
            # Slots past P (stale, poisoned) load as 0 so 0-weight columns cannot turn NaN into the sum.
            lat_mask = jnp.broadcast_to(in_prefix[:, None] & lat_cols_ok, (block_k, block_l))
            rope_mask = jnp.broadcast_to(in_prefix[:, None] & rope_cols_ok, (block_k, block_r))
        else:
            lat_mask = None if block_l == lora else jnp.broadcast_to(lat_cols_ok, (block_k, block_l))
            rope_mask = None if block_r == rope else jnp.broadcast_to(rope_cols_ok, (block_k, block_r))
        def load(ref, mask):
            return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)

        lat = load(lat_ref.at[pl.ds(slot0, block_k), pl.ds(0, block_l)], lat_mask)
        s = jax.lax.dot_general(ql, lat.astype(qk_dtype), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        if rope:
            kr = load(lat_ref.at[pl.ds(slot0, block_k), pl.ds(lora, block_r)], rope_mask)
            s = s + jax.lax.dot_general(qr, kr.astype(qk_dtype), (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
        s = s * scale_log2
        if masked:
            s = jnp.where(kpos[None, :] < cover[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(pv_dtype), lat.astype(pv_dtype),
                                             preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros((block_q, block_l), jnp.float32))
    end = jnp.maximum(hi, lo)
    if prefetch_page_ids:
        # Blocks below every row's coverage (the tile's first row covers least) and below P need
        # no masks; they run first, with page ids read one block ahead (clamped to the last page
        # this split reads, so no table entry past the request's own is touched).
        min_cover = plen - rows_per_req + 1 + (tile * block_q) // heads
        full_end = jnp.clip(jnp.minimum(min_cover, plen) // block_k, lo, end)
        last_block = jnp.maximum(full_end - 1, lo)

        def page_of(j):
            return pt_ref[b, (jnp.minimum(j, last_block) * block_k) // page_size]

        def full_body(j, carry):
            *mla, page = carry
            nxt = page_of(j + 1)
            return (*body(j, tuple(mla), masked=False, page=page), nxt)

        *carry, _ = jax.lax.fori_loop(lo, full_end, full_body, (*init, page_of(lo)))
        m, l, acc = jax.lax.fori_loop(full_end, end, body, tuple(carry))
    else:
        m, l, acc = jax.lax.fori_loop(lo, end, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), -jnp.inf)


def _num_splits(config: MlaDecodeConfig, programs: int, max_blocks: int) -> int:
    if config.num_splits is not None:
        return min(config.num_splits, max(1, max_blocks))
    want = pl.cdiv(2 * config.num_sms, max(1, programs))
    return max(1, min(want, max_blocks))


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "page_size", "scale", "interpret", "config",
                                             "poison_outputs"))
def _mla_decode_pallas(q, latent_pool, page_table, prefix_len, *, kv_lora_rank, page_size, scale, interpret,
                       config: MlaDecodeConfig, poison_outputs: bool):
    b, r, hq, c = q.shape
    lora, rope = kv_lora_rank, c - kv_lora_rank
    block_k = config.key_block(latent_pool.dtype, page_size)  # both powers of two: divides the page
    rows = r * hq
    block_q = min(config.block_q, max(16, next_pow2(rows)))
    rows_pad = pl.cdiv(rows, block_q) * block_q
    tiles = rows_pad // block_q
    block_l = next_pow2(lora)
    block_r = next_pow2(rope) if rope else 16
    max_blocks = pl.cdiv(page_table.shape[1] * page_size, block_k)
    splits = _num_splits(config, tiles * b, max_blocks)

    # The query enters in the QK operand dtype (FP8 under an FP8 cache): half the bytes, one cast.
    qf = quantize_query(q.reshape(b, rows, c), latent_pool.dtype)
    ql = jnp.pad(qf[..., :lora], ((0, 0), (0, rows_pad - rows), (0, block_l - lora)))
    if rope:
        qr = jnp.pad(qf[..., lora:], ((0, 0), (0, rows_pad - rows), (0, block_r - rope)))
    else:
        qr = jnp.zeros((b, rows_pad, block_r), qf.dtype)

    kernel = functools.partial(
        _mla_kernel, rows_per_req=r, heads=hq, lora=lora, rope=rope, block_l=block_l, block_r=block_r,
        block_q=block_q, block_k=block_k, page_size=page_size, splits=splits,
        qk_dtype=_qk_dtype(latent_pool.dtype, config.fp8_score_dot), pv_dtype=_pv_dtype(latent_pool.dtype),
        scale_log2=float(scale) * LOG2E, prefetch_page_ids=config.prefetch_page_ids)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [
        any_spec,  # page_table
        any_spec,  # prefix_len
        pl.BlockSpec((None, block_q, block_l), lambda t, s, bb: (bb, t, 0)),
        pl.BlockSpec((None, block_q, block_r), lambda t, s, bb: (bb, t, 0)),
        any_spec,  # latent pool
    ]
    out_shape = [jax.ShapeDtypeStruct((b, splits, rows_pad, block_l), jnp.float32),
                 jax.ShapeDtypeStruct((b, splits, rows_pad), jnp.float32)]
    args = [page_table, prefix_len.astype(jnp.int32), ql, qr, latent_pool]
    aliases = {}
    if poison_outputs:
        # Outputs start as NaN (aliased inputs the kernel never reads) so a test proves full coverage.
        in_specs += [any_spec, any_spec]
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
        aliases = {5: 0, 6: 1}
        inner = kernel

        def kernel(*refs):
            return inner(*refs[:5], *refs[7:])
    out_s, lse_s = pl.pallas_call(
        kernel,
        grid=(tiles, splits, b),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_q, block_l), lambda t, s, bb: (bb, s, t, 0)),
            pl.BlockSpec((None, None, block_q), lambda t, s, bb: (bb, s, t)),
        ],
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name="mla_decode",
    )(*args)
    if splits == 1:
        out, lse = out_s[:, 0], lse_s[:, 0]
    else:
        out, lse = merge_splits(out_s, lse_s, axis=1, backend="interpret" if interpret else None)
    out = out[:, :rows, :lora].reshape(b, r, hq, lora)
    return out, lse[:, :rows].reshape(b, r, hq)


def mla_decode(q: jax.Array, latent_pool: jax.Array, page_table: jax.Array, prefix_len: jax.Array, *,
               kv_lora_rank: int, page_size: int, scale: float, backend: str | None = None,
               config: MlaDecodeConfig = MlaDecodeConfig(),
               poison_outputs: bool = False) -> tuple[jax.Array, jax.Array]:
    """Entry point; see module docstring. Returns `(out [B, R, Hq, L] f32, lse2 [B, R, Hq] f32)`.

    `scale` multiplies q.k (MLA: the model's softmax scale, not derived from the latent width).
    `poison_outputs` fills the kernel's output buffers with NaN first (tests: every element written).
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    _check(q, latent_pool, page_table, prefix_len, kv_lora_rank, page_size)
    kind = resolve_backend(backend)
    if kind == "reference":
        return mla_decode_reference(q, latent_pool, page_table, prefix_len, kv_lora_rank=kv_lora_rank,
                                    page_size=page_size, scale=scale)
    return _mla_decode_pallas(q, latent_pool, page_table, prefix_len, kv_lora_rank=kv_lora_rank,
                              page_size=page_size, scale=float(scale), interpret=(kind == "interpret"),
                              config=config, poison_outputs=poison_outputs)
