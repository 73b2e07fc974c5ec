"""Cascade tree attention for MLA layers: latent prefix decode + the shared tree window kernel.

MLA attends over one latent cache per layer, `latent_pool [S, kv_lora_rank + rope_dim]`, with the
absorbed query `q [B, R, Hq, kv_lora_rank + rope_dim]` (the query's no-rope part already multiplied
into latent space). A token's latent row is read once per half: its leading kv_lora_rank channels are
both the key's latent part and the value, its rope channels add a second score term.

- Prefix half: `pallas_kernels.attention.mla_decode` (causal multi-query latent decode, row r sees
  keys [0, P - R + 1 + r), base-2 LSE).
- Window half: `pallas_kernels.attention.tree_window.tree_window_attention` with `rope_dim > 0` and no
  separate value pool; it attends the prefix tail each row missed plus the masked window and merges
  with the prefix partial in the same kernel.

FP8 latent cache (E4M3, unscaled): the absorbed query is quantised to FP8 once. The prefix half
multiplies that FP8 query; the window half gets the same FP8 values widened back to the model dtype
(exact), so both halves score one and the same query. The output is in the model dtype, latent
space `[B, R, Hq, kv_lora_rank]` (the caller applies the value up-projection).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention.mla_decode import FP8, MlaDecodeConfig, mla_decode, quantize_query
from pallas_kernels.attention.mla_decode_mgpu import (EXCHANGES, SCHEDULES, MlaMgpuConfig, check_mla_mgpu_inputs,
                                                       default_schedule, mla_decode_mgpu, mla_mgpu_input_errors)
from pallas_kernels.common import resolve_backend
from pallas_kernels.attention.tree_window import tree_window_attention
from treespec_jax.attention.cascade import covers_tail, lane_window, mosaic_only_errors, optional_flag_errors
from treespec_jax.tree.masks import MAX_TREE_NODES

# Keys per step of the Mosaic GPU latent decode (a multiple of 64, the P V contraction's minimum;
# 64 fits shared memory at L + Dr = 576 with two buffers).
MLA_MGPU_BLOCK_K = 64


@dataclasses.dataclass(frozen=True)
class MlaCascadeConfig:
    # Latent channels of a row: the key's latent part and, as a view, the value.
    kv_lora_rank: int
    # Rotary channels after the latent ones (DeepSeek-V3: 64).
    rope_dim: int
    # Tokens per page of the latent pool (power of two >= 16).
    page_size: int
    # Softmax scale for q.k; MLA's scale comes from the model's head dims, so it is required.
    scale: float
    # dtype the window half multiplies in (an FP8 query is widened back to it); the output dtype.
    model_dtype: str = "bfloat16"
    # Kernel backend: None/"pallas" (compiled on GPU, interpret on CPU), "interpret", "reference".
    backend: str | None = None
    # Tiling of the prefix half's latent decode.
    decode: MlaDecodeConfig = MlaDecodeConfig()
    # Prefix-half kernel. "auto": "mosaic_gpu" wherever it runs compiled (a GPU, 16-bit or FP8
    # latent cache, page a multiple of 64: its cascade is faster than with the Triton latent decode
    # for both cache dtypes; results: mla-mosaic), else "triton". "triton": Pallas Triton, every
    # cache dtype. "mosaic_gpu": wgmma/TMA over whole pages (the window kernel covers the partial
    # last page), refused where it cannot run. See pallas_kernels.attention.mla_decode_mgpu.
    prefix_kernel: str = "auto"
    # As CascadeConfig.prefix_covers_tail: the latent decode runs every row to P (its whole-page
    # bound under "mosaic_gpu"), so the window kernel reads the window (and the partial last page)
    # but no causal tail of committed rows. Same result. None: True under the Mosaic latent decode
    # (the faster there; results: prefix-covers-tail), else False.
    prefix_covers_tail: bool | None = None
    # How the Mosaic latent decode's two compute warpgroups share a step: "seesaw" (they score
    # alternate steps whole and hand each step's P to the other), "split" (each scores half of the
    # keys, P exchanged), "turns" or "together" (both score every key, taking turns on the tensor
    # cores or not). None: mla_decode_mgpu.default_schedule ("seesaw", the fastest for bf16 and FP8
    # caches; results: mla-schedule).
    schedule: str | None = None
    # Fuse the tree window into the Mosaic latent decode (prefix_kernel "mosaic_gpu", schedule
    # "seesaw" or "split"): one kernel gives every row the keys [0, P + window), window key j under bit
    # j of the row's mask, and writes the final output in the model dtype (no partial, no window
    # kernel). Over an FP8 cache its window keys are scored as its prefix's are, the FP8 query by the
    # FP8 rows on the tensor cores (the window kernel widens both, exactly, and accumulates in
    # float32; the values are the same, the accumulation is the FP8 wgmma's). None: fused under those
    # schedules with prefix_covers_tail not False (`fuses_window`), over 16-bit and FP8 caches (the
    # fused cascade is faster over both; results: mla-fuse-window). True demands it (prefix_kernel
    # "mosaic_gpu"); False keeps the window kernel.
    fuse_window: bool | None = None
    # The Mosaic latent decode's default rules (`mla_decode_mgpu.MlaMgpuConfig`: P handed over in
    # the ring, wgmma descriptors built in the key loop); None: `mla_decode_mgpu.default_config()`.
    decode_mgpu: MlaMgpuConfig | None = None

    def __post_init__(self):
        """Every bad field at once."""
        errors = []
        if self.prefix_kernel not in ("auto", "triton", "mosaic_gpu"):
            errors.append(f"MlaCascadeConfig.prefix_kernel must be 'auto', 'triton' or 'mosaic_gpu', "
                          f"got {self.prefix_kernel!r}")
        for name in ("kv_lora_rank", "rope_dim", "page_size"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                errors.append(f"MlaCascadeConfig.{name} must be a power of two >= 16, got {value}")
        if not self.scale > 0:
            errors.append(f"MlaCascadeConfig.scale must be positive, got {self.scale}")
        if jnp.dtype(self.model_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                               jnp.dtype(jnp.float32)):
            errors.append(f"MlaCascadeConfig.model_dtype must be bfloat16, float16 or float32, "
                          f"got {self.model_dtype!r}")
        errors += optional_flag_errors(self, "prefix_covers_tail")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            errors.append(f"MlaCascadeConfig.schedule must be None or one of {SCHEDULES}, got {self.schedule!r}")
        if self.decode_mgpu is not None and not isinstance(self.decode_mgpu, MlaMgpuConfig):
            errors.append(f"MlaCascadeConfig.decode_mgpu must be None or a MlaMgpuConfig, got {self.decode_mgpu!r}")
        errors += optional_flag_errors(self, "fuse_window") or mosaic_only_errors(
            self, "fuse_window", "the window is fused into that kernel")
        if self.fuse_window is True:
            if self.schedule not in (None, *EXCHANGES):
                errors.append(f"MlaCascadeConfig.fuse_window=True runs under schedules {EXCHANGES}, "
                              f"got {self.schedule!r}")
            if self.prefix_covers_tail is False:
                errors.append("MlaCascadeConfig.fuse_window=True reads every row's whole prefix in one kernel, so "
                              "prefix_covers_tail=False (a causal tail for the window kernel) contradicts it")
        if errors:
            raise ValueError("; ".join(errors))


def _check(q, latent_pool, config: MlaCascadeConfig):
    width = config.kv_lora_rank + config.rope_dim
    if q.ndim != 4 or q.shape[-1] != width:
        raise ValueError(f"q must be [B, R, Hq, kv_lora_rank + rope_dim = {width}], got shape {q.shape}")
    if latent_pool.ndim != 2 or latent_pool.shape[1] != width:
        raise ValueError(f"latent_pool must be [S, {width}], got shape {latent_pool.shape}")


def quantize_absorbed_query(q: jax.Array, latent_dtype) -> jax.Array:
    """The query both halves score with: quantised to FP8 under an FP8 latent cache, else unchanged.

    `quantize_query` pins the rounding so XLA cannot fold FP8 -> model dtype back into the original.
    """
    return quantize_query(q, latent_dtype) if jnp.dtype(latent_dtype) == jnp.dtype(FP8) else q


def uses_mosaic_latent_decode(config: MlaCascadeConfig, kind: str, q, latent_pool) -> bool:
    """Whether the prefix half runs the Mosaic GPU latent decode (`kind` from resolve_backend; `q`
    already quantised). "auto" takes it only compiled on a GPU and only where
    `mla_mgpu_input_errors` finds nothing; an explicit "mosaic_gpu" raises those errors."""
    if config.prefix_kernel == "triton" or kind == "reference":
        return False
    if config.prefix_kernel == "mosaic_gpu":
        check_mla_mgpu_inputs(q, latent_pool, config.kv_lora_rank, config.page_size, MLA_MGPU_BLOCK_K)
        return True
    # FP8 caches too: the Mosaic FP8 cascade is several times faster than the Triton one (results:
    # mla-mosaic).
    return (kind == "compiled"
            and not mla_mgpu_input_errors(q, latent_pool, config.kv_lora_rank, config.page_size, MLA_MGPU_BLOCK_K))


def fuses_window(config: MlaCascadeConfig, mosaic: bool, latent_dtype) -> bool:
    """Whether the tree window runs inside the Mosaic latent decode: an explicit setting wins; None
    fuses under the Mosaic decode (`mosaic`, resolved), schedule "split" or "seesaw" (given or the
    dtype's default) and a prefix that covers every row's tail (None or True), over any cache dtype."""
    if config.fuse_window is not None:
        return config.fuse_window
    schedule = config.schedule or default_schedule(latent_dtype)
    return mosaic and schedule in EXCHANGES and config.prefix_covers_tail is not False


def mla_cascade_attention(q: jax.Array, latent_pool: jax.Array, page_table: jax.Array,
                          prefix_lengths: jax.Array, mask: jax.Array, *, window: int,
                          config: MlaCascadeConfig) -> jax.Array:
    """Causal latent prefix + tail + masked window, merged.

    `q [B, R, Hq, L + Dr]` (FP8 or model dtype), `latent_pool [S, L + Dr]`, `page_table [B, maxp] int32`
    (must map every position below P + window), `prefix_lengths [B] int32` (P, the window starts at
    position P), `mask [B, R, 2] uint32` (packed ancestor rows over the window) -> `[B, R, Hq, L]`
    in the model dtype.
    """
    _check(q, latent_pool, config)
    model = jnp.dtype(config.model_dtype)
    q = quantize_absorbed_query(q, latent_pool.dtype)
    mosaic = uses_mosaic_latent_decode(config, resolve_backend(config.backend), q, latent_pool)
    b, r, hq, c = q.shape
    # The decodes bound the rows of query row r by P - R + 1 + r; as one query row of R * Hq heads
    # every row's bound is P (`prefix_covers_tail`). The latent cache has one KV head, so regrouping
    # the heads changes nothing else.
    if fuses_window(config, mosaic, latent_pool.dtype):  # the Mosaic decode, its inputs checked above
        out, _ = mla_decode_mgpu(
            q, latent_pool, page_table, prefix_lengths, mask, kv_lora_rank=config.kv_lora_rank,
            page_size=config.page_size, scale=config.scale, block_k=MLA_MGPU_BLOCK_K, schedule=config.schedule,
            window=window, out_dtype=model, interpret=resolve_backend(config.backend) == "interpret",
            config=config.decode_mgpu)
        return out
    covers = covers_tail(config.prefix_covers_tail, mosaic)
    q_dec = q.reshape(b, 1, r * hq, c) if covers else q
    if mosaic:
        prefix_out, prefix_lse2 = mla_decode_mgpu(
            q_dec, latent_pool, page_table, prefix_lengths, kv_lora_rank=config.kv_lora_rank,
            page_size=config.page_size, scale=config.scale, block_k=MLA_MGPU_BLOCK_K,
            schedule=config.schedule, interpret=resolve_backend(config.backend) == "interpret",
            config=config.decode_mgpu)
    else:
        prefix_out, prefix_lse2 = mla_decode(
            q_dec, latent_pool, page_table, prefix_lengths, kv_lora_rank=config.kv_lora_rank,
            page_size=config.page_size, scale=config.scale, backend=config.backend, config=config.decode)
    prefix_out = prefix_out.reshape(b, r, hq, -1)
    prefix_lse2 = prefix_lse2.reshape(b, r, hq)
    # FP8 -> model dtype is exact; the window kernel widens the FP8 latent rows to the same dtype.
    out = tree_window_attention(
        q.astype(model), latent_pool, None, page_table, prefix_lengths, mask, prefix_out, prefix_lse2,
        window=window, page_size=config.page_size, scale=config.scale,
        causal_prefix=not covers, rope_dim=config.rope_dim, value_dim=config.kv_lora_rank,
        prefix_whole_pages=mosaic,
        backend=config.backend)
    return out.astype(model)


def mla_verify_attention(q, latent_pool, page_table, prefix_lengths, mask, *, config: MlaCascadeConfig):
    """Verify: the N tree nodes are the query rows and the window (R = W = N).

    `q [B, N, Hq, L + Dr]`, `mask [B, N, 2] uint32` (ancestor-or-self rows) -> `[B, N, Hq, L]`.
    """
    n = q.shape[1]
    if not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"mla_verify_attention: N={n} nodes must be in [1, {MAX_TREE_NODES}]")
    return mla_cascade_attention(q, latent_pool, page_table, prefix_lengths, mask, window=n, config=config)


def mla_lane_attention(q, latent_pool, page_table, frontier, lane_mask, *, steps: int,
                       config: MlaCascadeConfig):
    """Draft lanes: R = K lane rows over the lane window of W = (steps - 1) * K keys at the frontier.

    `q [B, K, Hq, L + Dr]`, `frontier [B]`, `lane_mask [B, K, 2] uint32` -> `[B, K, Hq, L]`.
    """
    window = lane_window(q.shape[1], steps, "mla_lane_attention")
    return mla_cascade_attention(q, latent_pool, page_table, frontier, lane_mask, window=window, config=config)


__all__ = ["MlaCascadeConfig", "fuses_window", "mla_cascade_attention", "mla_verify_attention", "mla_lane_attention",
           "quantize_absorbed_query"]
