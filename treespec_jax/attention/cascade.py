"""Cascade tree attention for GQA layers: paged prefix decode + tree window kernel + merge.

Every query row of a tree sees the request's committed prefix and, inside the last `window` keys,
only the slots its ancestor mask names. The prefix (where the time goes at long context) runs as a
multi-query paged decode (`pallas_kernels.attention.prefix_decode`) that returns its base-2 LSE,
causal or, with `prefix_covers_tail` (the default under the Mosaic kernel), every row to P; on a
GPU with page 64/128 it is the Mosaic GPU kernel over whole pages
(`prefix_decode_mgpu`, chosen by `CascadeConfig.prefix_kernel="auto"`). The window kernel
(`pallas_kernels.attention.tree_window`) attends what the prefix half missed and merges both in one
kernel. One path for every size. Under the Mosaic prefix with 16-bit pools the window is folded
into that kernel instead (`CascadeConfig.fuse_window`, the default there): one launch reads
[0, P + window) per row, the window keys under the row's mask bits.

- Verify: R = W = N rows/keys; the window is the verify forward's N freshly written slots.
- Draft lanes: R = K rows over the lane window of W = (S - 1) * K keys starting at the frontier.
- Sliding-window draft lanes: each lane row has its own page table and length (the draft layer's
  window frozen at the round's prefix end); each row decodes its prefix alone (q_len 1, an optional
  `sliding_window`) and the window kernel attends the tree window only (`causal_prefix=False`).
- FP8 E4M3 pools (unscaled): the prefix half multiplies the query cast to FP8, the window half the
  unquantised query with K/V widened after loading. Nothing else changes.

Shapes: `q [B, R, Hq, D]`, `k_pool/v_pool [S, Hkv, D]` (slot-major, `treespec_jax/cache/paged.py`),
`page_table [B, maxp] int32` (must map every position below P + W), `prefix_lengths [B] int32`,
`mask [B, R, 2] uint32` (packed ancestor rows over the window) -> out `[B, R, Hq, D]` in q's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention.prefix_decode import (check_paged_inputs, heads_to_rows, num_sms, padded_rows,
                                                    prefix_decode, prefix_decode_row_layout, rows_to_heads)
from pallas_kernels.attention.prefix_decode_mgpu import (ROWS_PER_WG, PrefixMgpuConfig, check_mgpu_inputs,
                                                         fused_window_words, fused_fp8_fits, heads_io_errors,
                                                         mgpu_input_errors, warpgroup_layout,
                                                         widens_values_by_default, prefix_decode_mgpu_row_layout)
from pallas_kernels.attention.split_merge import MergeConfig, kept_rows_errors
from pallas_kernels.attention.tree_window import (heads_in_errors, tree_window_attention, tree_window_row_layout,
                                                  window_block_rows)
from pallas_kernels.common import resolve_backend
from treespec_jax.tree.masks import MAX_TREE_NODES


PREFIX_KERNELS = ("auto", "triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    # Tokens per page of the paged pools (power of two >= 16; the kernels' key block).
    page_size: int
    # Softmax scale for s = scale * q.k; None means head_dim^-1/2.
    scale: float | None = None
    # Splits of the prefix's key axis (merged by LSE), for either prefix kernel; None lets the kernel
    # choose (Triton: enough programs to fill the GPU; Mosaic GPU: one wave of one CTA per SM).
    num_splits: int | None = None
    # Kernel backend: None/"pallas" (compiled on GPU, interpret on CPU), "interpret", "reference".
    backend: str | None = None
    # Native FP8 x FP8 score dot in the prefix half on GPU (else FP8 K is widened to bf16).
    fp8_score_dot: bool = False
    # Prefix-half kernel. "auto": "mosaic_gpu" wherever it runs compiled (a GPU, bf16/fp16 or FP8
    # pools, page 64/128, fewer than 64 rows per KV head padded to one tile, `uses_mosaic_prefix`;
    # results: prefix-kernel, auto-pads-small-rows), else "triton".
    # "triton": Pallas Triton, every shape and dtype. "mosaic_gpu": wgmma/TMA over whole pages (the
    # window kernel then covers the partial last page), refused where it cannot run. See
    # prefix_decode_mgpu.
    prefix_kernel: str = "auto"
    # Which half reads the committed keys the causal prefix leaves to the window kernel (row r's
    # P - R + 1 + r .. P - 1). False: the window kernel (the causal split). True: the prefix
    # half runs every row to P (its whole-page bound under "mosaic_gpu"), so the window kernel reads
    # only the window, plus the partial last page under "mosaic_gpu": the latency-bound window
    # kernel skips the causal tail's pages (at most one under "mosaic_gpu", up to R / page under
    # "triton") for up to R - 1 more keys per row in the prefix kernel. Same result; the
    # "reference" backend, which defines it, ignores the flag. None: True under the Mosaic prefix,
    # the faster there (results: prefix-covers-tail), False under the Triton prefix (not timed with it).
    prefix_covers_tail: bool | None = None
    # The dtype the prefix kernel writes its partial output in before the window kernel merges it:
    # "float32", or "bfloat16" for a bf16 query (refused otherwise). Without key splits that halves
    # the bytes written and read between the two kernels (split partials are merged to float32
    # first) and rounds the normalised partial to bf16 once before the merge (results:
    # prefix-partial-dtype). Opt-in, so the default output is not rounded once more. Verify and
    # lanes (`cascade_attention`) only: the "reference" backend and `sliding_lane_attention` keep
    # float32.
    prefix_partial_dtype: str = "float32"
    # Fold the tree window into the Mosaic prefix kernel: every row reads
    # [0, P + window) there, the window keys under its mask bits, so no window kernel runs and no
    # partial output makes a round trip through memory (and, where the group allows, q and the
    # output keep the head layout: no transposes). None: on wherever the Mosaic prefix runs on
    # 16-bit pools, unless `prefix_covers_tail=False` or a bf16 partial was asked for; FP8 pools
    # fuse only where the prefix kernel's programs leave SMs idle and the unfused prefix would not
    # widen V in its memory warpgroup (fused, their window steps score the unquantised query
    # against K widened in shared memory; `fuses_window`; results: fuse-window, fuse-fp8); True:
    # required (prefix_kernel="mosaic_gpu"); False: off.
    fuse_window: bool | None = None
    # Launch the Mosaic prefix kernel persistent: one CTA per SM looping over the work items
    # (split, request, KV head, row tile), so an item's epilogue overlaps the next item's first
    # page fetches. None: `prefix_decode_mgpu.runs_persistent` (where the items outnumber the SMs,
    # on 16-bit pools and on FP8 ones whose V the memory warpgroup widens; results:
    # persistent-prefix); True needs prefix_kernel="mosaic_gpu"; False: one CTA per item.
    persistent_prefix: bool | None = None
    # Whether an unfused cascade hands the prefix half's key-split partials to the window kernel
    # unmerged (each window program merges its rows' splits by lse2 as it starts: no merge kernel,
    # no merged partial written and read) instead of merging them first (`split_merge.merge_splits`).
    # On: it won at every unfused split shape timed (results: window-merges-splits).
    window_merges_splits: bool = True
    # Whether an unfused cascade under the Mosaic prefix keeps the head layout end to end where it
    # can (`unfused_heads_io`): the prefix kernel reads q [B, R, Hq, D] itself and writes its
    # partial by head_io rows, the window kernel reads both and the mask rows itself, so no XLA
    # transpose of q (nor, under FP8, a transposed cast) runs before them. Same bits as the row
    # layout. On: results: unfused-heads-io.
    unfused_heads_io: bool = True
    # The Mosaic prefix kernel's default rules (`prefix_decode_mgpu.PrefixMgpuConfig`: persistent
    # launch, query prefetch, cluster merge, in-kernel query cast, memory-warpgroup widening of FP8
    # V); None: `prefix_decode_mgpu.default_config()`.
    prefix_mgpu: PrefixMgpuConfig | None = None
    # The launch of the key-split merge kernel wherever one runs (`split_merge.MergeConfig`); None:
    # `split_merge.default_config()`.
    merge: MergeConfig | None = None

    def __post_init__(self):
        if self.prefix_kernel not in PREFIX_KERNELS:
            raise ValueError(f"CascadeConfig.prefix_kernel must be one of {PREFIX_KERNELS}, got {self.prefix_kernel!r}")
        if self.page_size < 16 or self.page_size & (self.page_size - 1):
            raise ValueError(f"CascadeConfig.page_size must be a power of two >= 16, got {self.page_size}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"CascadeConfig.scale must be positive, got {self.scale}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"CascadeConfig.num_splits must be >= 1, got {self.num_splits}")
        if self.prefix_partial_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"CascadeConfig.prefix_partial_dtype must be 'float32' or 'bfloat16', "
                             f"got {self.prefix_partial_dtype!r}")
        errors = optional_flag_errors(self, "prefix_covers_tail")
        errors += optional_flag_errors(self, "fuse_window") or mosaic_only_errors(
            self, "fuse_window", "the window is fused into that kernel")
        if self.fuse_window is True:
            if self.prefix_covers_tail is False:
                errors.append("CascadeConfig.fuse_window=True reads every row's prefix in the prefix kernel, "
                              "which contradicts prefix_covers_tail=False")
            if self.prefix_partial_dtype != "float32":
                errors.append(f"CascadeConfig.fuse_window=True writes the final output (no partial), so "
                              f"prefix_partial_dtype={self.prefix_partial_dtype!r} does not apply")
        errors += optional_flag_errors(self, "persistent_prefix") or mosaic_only_errors(
            self, "persistent_prefix", "a launch of the Mosaic prefix kernel")
        for name in ("window_merges_splits", "unfused_heads_io"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"CascadeConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name, kind in (("prefix_mgpu", PrefixMgpuConfig), ("merge", MergeConfig)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
                errors.append(f"CascadeConfig.{name} must be None or a {kind.__name__}, got {getattr(self, name)!r}")
        if errors:
            raise ValueError("; ".join(errors))


def optional_flag_errors(config, name: str) -> list[str]:
    """Why field `name` of a config dataclass is not None, True or False (not merely truthy)."""
    value = getattr(config, name)
    if value is None or isinstance(value, bool):
        return []
    return [f"{type(config).__name__}.{name} must be None, True or False, got {value!r}"]


def mosaic_only_errors(config, name: str, why: str) -> list[str]:
    """Why field `name` set to True cannot apply: it is a property of the Mosaic prefix kernel (`why`),
    so it needs `prefix_kernel="mosaic_gpu"`; "auto" could resolve to the Triton kernel and
    silently drop it, so that is refused when the config is built."""
    if getattr(config, name) is True and config.prefix_kernel != "mosaic_gpu":
        return [f"{type(config).__name__}.{name}=True ({why}) needs prefix_kernel='mosaic_gpu', "
                f"got {config.prefix_kernel!r}"]
    return []


def covers_tail(setting: bool | None, mosaic: bool) -> bool:
    """`prefix_covers_tail` resolved: an explicit setting wins; None follows the prefix kernel (True
    under the Mosaic prefix, where it is faster, False under the Triton one)."""
    return mosaic if setting is None else bool(setting)


def _scale(config: CascadeConfig, q: jax.Array) -> float:
    return float(q.shape[-1] ** -0.5 if config.scale is None else config.scale)


def cascade_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                      prefix_lengths: jax.Array, mask: jax.Array, *, window: int,
                      config: CascadeConfig) -> jax.Array:
    """Causal-prefix cascade: prefix rows [0, P - R + 1 + r), then tail + masked window, merged.

    `q [B, R, Hq, D]`, pools `[S, Hkv, D]`, `page_table [B, maxp]`, `prefix_lengths [B]`,
    `mask [B, R, 2] uint32` -> `[B, R, Hq, D]` (q's dtype).
    """
    scale = _scale(config, q)
    kind = resolve_backend(config.backend)
    if kind == "reference":
        prefix_out, prefix_lse2 = prefix_decode(
            q, k_pool, v_pool, page_table, prefix_lengths, page_size=config.page_size, scale=scale,
            backend="reference")
        out = tree_window_attention(
            q, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out, prefix_lse2, window=window,
            page_size=config.page_size, scale=scale, causal_prefix=True, backend="reference")
        return out.astype(q.dtype)
    # Validate through the public entry points' checks, then run both kernels on the shared row
    # layout (q transposed once in, the output at most once out, the f32 prefix partial never) or,
    # where both can tile it, on the head layout with no transposes (`unfused_heads_io`).
    check_paged_inputs(q, k_pool, v_pool, page_table, prefix_lengths, config.page_size, "cascade_attention")
    if not 1 <= window <= MAX_TREE_NODES:
        raise ValueError(f"cascade_attention: window must be in [1, {MAX_TREE_NODES}], got {window}")
    b, r, hq, d = q.shape
    if mask.shape != (b, r, 2) or mask.dtype != jnp.uint32:
        raise ValueError(f"cascade_attention: mask must be [B={b}, R={r}, 2] uint32, got {mask.shape} {mask.dtype}")
    if k_pool.shape[-1] != d or v_pool.shape[-1] != d or d < 16 or d & (d - 1):
        raise ValueError(f"cascade_attention: head dims q {d}, k {k_pool.shape[-1]}, v {v_pool.shape[-1]} "
                         "must match and be a power of two >= 16")
    if config.prefix_partial_dtype == "bfloat16" and q.dtype != jnp.bfloat16:
        raise ValueError(f"cascade_attention: prefix_partial_dtype='bfloat16' needs a bfloat16 query "
                         f"(a bf16 partial would coarsen a {q.dtype} output), got q {q.dtype}")
    mosaic = uses_mosaic_prefix(config, kind, q, k_pool, v_pool)
    tail = covers_tail(config.prefix_covers_tail, mosaic)
    fuse = fuses_window(config, mosaic, tail, k_pool, q)
    return _cascade_rows(q, k_pool, v_pool, page_table, prefix_lengths, mask, window=window,
                         page_size=config.page_size, scale=scale, num_splits=config.num_splits,
                         fp8_score_dot=config.fp8_score_dot, interpret=kind == "interpret", mosaic=mosaic,
                         prefix_covers_tail=tail, partial_dtype=config.prefix_partial_dtype, fuse_window=fuse,
                         persistent=config.persistent_prefix, window_merges=config.window_merges_splits,
                         mgpu_config=config.prefix_mgpu, merge_config=config.merge,
                         unfused_heads=mosaic and not fuse and config.unfused_heads_io and unfused_heads_io(
                             q.shape, k_pool.shape[1], tail, config.window_merges_splits))


def fuses_window(config: CascadeConfig, mosaic: bool, covers_tail_resolved: bool, k_pool, q) -> bool:
    """Whether the window is folded into the Mosaic prefix kernel: an explicit setting wins; None
    fuses under the Mosaic prefix with the prefix covering every row's tail and the float32
    partial, on 16-bit pools, and on FP8 ones (given a 16-bit query, where the fused FP8 buffers
    fit) where the prefix programs do not fill the SMs and the unfused prefix would not widen V in
    its memory warpgroup (`widens_values_by_default`): fused FP8 won under one wave only, and lost
    to the widened unfused prefix there too (results: fuse-window, fuse-fp8).
    `q [B, R, Hq, D]` (array or ShapeDtypeStruct)."""
    if config.fuse_window is None:
        itemsize = jnp.dtype(k_pool.dtype).itemsize
        pool_ok = itemsize == 2
        if itemsize == 1 and jnp.dtype(q.dtype).itemsize == 2:
            _, r, hq, d = q.shape
            group = hq // k_pool.shape[1]
            fits = fused_fp8_fits(fused_rows(r, group), d, config.page_size)
            unfused_widens = widens_values_by_default(mosaic_rows(r * group), d, config.page_size,
                                                      config=config.prefix_mgpu)
            pool_ok = fits and (not unfused_widens
                                and prefix_programs(q.shape, k_pool.shape[1], itemsize) < num_sms())
        return mosaic and covers_tail_resolved and pool_ok and config.prefix_partial_dtype == "float32"
    return config.fuse_window


def kept_row_count(real: int, total: int) -> int:
    """The rows a KV head's padded tile hands on: its `real` rows where that count can be merged
    alone (`split_merge.kept_rows_errors`), so the padding is never read back; else all `total`
    (0: no cut)."""
    return real if real < total and not kept_rows_errors(real, total) else 0


def fused_rows(r: int, group: int) -> int:
    """Rows per KV head of the fused kernel: R * G in head layout (`heads_io`), else the padded
    row layout's."""
    return r * group if not heads_io_errors(r, group) else mosaic_rows(r * group)


def prefix_programs(q_shape, kv_heads: int, itemsize: int) -> int:
    """(request, KV head, row tile) programs of the fused Mosaic prefix kernel for a query
    `[B, R, Hq, D]` (before key splits)."""
    b, r, hq = q_shape[:3]
    total = fused_rows(r, hq // kv_heads)
    _, rows_per_cta, _ = warpgroup_layout(total, None, itemsize)
    return b * kv_heads * (total // rows_per_cta)


def mosaic_rows(rows: int) -> int:
    """Rows per KV head on the Mosaic prefix: `padded_rows`, at least one 64-row warpgroup tile
    (fewer real rows, e.g. K = 4 draft lanes x G = 4, are padded up to it)."""
    return max(ROWS_PER_WG, padded_rows(rows))


def uses_mosaic_prefix(config: CascadeConfig, kind: str, q, k_pool, v_pool) -> bool:
    """Whether the cascade's prefix half runs the Mosaic GPU kernel (`kind` from resolve_backend).

    "auto" takes it only compiled on a GPU (the CPU interpreter path stays on the Triton kernel)
    and only where `mgpu_input_errors` finds nothing; fewer than 64 rows per KV head are padded to
    one 64-row tile, as under an explicit "mosaic_gpu", which raises the errors instead (the padded
    Mosaic cascade beat the Triton one on 7 of 8 small-row shapes; results: auto-pads-small-rows).
    """
    if config.prefix_kernel == "triton" or kind == "reference":
        return False
    b, r, hq, d = q.shape
    hkv = k_pool.shape[1]
    real = r * (hq // hkv)
    rows = jax.ShapeDtypeStruct((b, hkv, mosaic_rows(real), d), q.dtype)
    if config.prefix_kernel == "mosaic_gpu":
        check_mgpu_inputs(rows, k_pool, v_pool, config.page_size)
        return True
    return kind == "compiled" and not mgpu_input_errors(rows, k_pool, v_pool, config.page_size)


@functools.partial(jax.jit, static_argnames=("window", "page_size", "scale", "num_splits", "fp8_score_dot",
                                             "interpret", "mosaic", "prefix_covers_tail", "partial_dtype",
                                             "fuse_window", "persistent", "window_merges", "unfused_heads",
                                             "mgpu_config", "merge_config"))
def _cascade_rows(q, k_pool, v_pool, page_table, prefix_lengths, mask, *, window, page_size, scale,
                  num_splits, fp8_score_dot, interpret, mosaic=False, prefix_covers_tail=False,
                  partial_dtype="float32", fuse_window=False, persistent=None, window_merges=False,
                  unfused_heads=False, mgpu_config=None, merge_config=None):
    b, r, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    if fuse_window:
        # One kernel: every row reads [0, P + window), the window under its own mask bits. Without
        # key splits it writes the final output in q's dtype (bf16; float32 otherwise), and where
        # the group allows it reads q and writes the output in head layout (no transposes).
        heads_io = not heads_io_errors(r, group)
        total = fused_rows(r, group)
        words, union = fused_window_words(mask, group, total, heads_io=heads_io)
        out_dtype = q.dtype if q.dtype == jnp.bfloat16 else jnp.float32
        out, _ = prefix_decode_mgpu_row_layout(
            q if heads_io else heads_to_rows(q, hkv, total), k_pool, v_pool, page_table, prefix_lengths, words,
            union, query_rows=1, group=total, page_size=page_size, scale=scale, num_splits=num_splits,
            interpret=interpret, partial_dtype=out_dtype, window=window, heads_io=heads_io, persistent=persistent,
            kept_rows=0 if heads_io else kept_row_count(r * group, total), config=mgpu_config,
            merge_config=merge_config)
        return (out if heads_io else rows_to_heads(out, r, hq)).astype(q.dtype)
    if unfused_heads:  # unfused_heads_io, resolved by the caller (the flags are read outside the jit)
        # Head layout throughout: q, the prefix partial and the output are never transposed.
        prefix_out, prefix_lse2 = prefix_decode_mgpu_row_layout(
            q, k_pool, v_pool, page_table, prefix_lengths, query_rows=1, group=r * group, page_size=page_size,
            scale=scale, num_splits=num_splits, interpret=interpret, partial_dtype=partial_dtype,
            persistent=persistent, merge=False, heads_io=True, config=mgpu_config)
        return tree_window_row_layout(
            q, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out, prefix_lse2, query_rows=r, group=group,
            window=window, page_size=page_size, scale=scale, causal_prefix=False, value_dim=d, interpret=interpret,
            prefix_whole_pages=True, heads_in=True)
    qr = heads_to_rows(q, hkv, mosaic_rows(r * group) if mosaic else padded_rows(r * group))
    # The prefix kernels bound row r * G + g by P - R + 1 + r; read as one query row of R * G heads,
    # every row's bound is P (`prefix_covers_tail`), and the window kernel then takes no causal tail.
    prefix_rows = dict(query_rows=1, group=r * group) if prefix_covers_tail else dict(query_rows=r, group=group)
    # Key-split partials are merged before the window kernel (`split_merge.merge_splits`), or with
    # `window_merges` by the window kernel itself (CascadeConfig.window_merges_splits).
    if mosaic:
        prefix_out, prefix_lse2 = prefix_decode_mgpu_row_layout(
            qr, k_pool, v_pool, page_table, prefix_lengths, **prefix_rows, page_size=page_size,
            scale=scale, num_splits=num_splits, interpret=interpret, partial_dtype=partial_dtype,
            persistent=persistent, merge=not window_merges, config=mgpu_config, merge_config=merge_config)
    else:
        prefix_out, prefix_lse2 = prefix_decode_row_layout(
            qr, k_pool, v_pool, page_table, prefix_lengths, **prefix_rows, page_size=page_size,
            scale=scale, num_splits=num_splits, interpret=interpret, fp8_score_dot=fp8_score_dot,
            partial_dtype=partial_dtype, merge=not window_merges, merge_config=merge_config)
    # The window kernel writes [B, R, Hq, D] itself where its row tiles allow (no output transpose).
    return tree_window_row_layout(
        qr, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out, prefix_lse2,
        query_rows=r, group=group, window=window, page_size=page_size, scale=scale,
        causal_prefix=not prefix_covers_tail,
        value_dim=d, interpret=interpret, prefix_whole_pages=mosaic, heads_out=True)


def unfused_heads_io(q_shape, kv_heads: int, covers_tail_resolved: bool, window_merges: bool) -> bool:
    """Whether an unfused Mosaic cascade can run in head layout (CascadeConfig.unfused_heads_io asks
    for it): both kernels can (`heads_io_errors`, `heads_in_errors` at the window kernel's row
    tiles), every row's prefix runs to P and key splits go to the window kernel unmerged.
    `q_shape` `[B, R, Hq, D]`."""
    b, r, hq, d = q_shape
    group = hq // kv_heads
    # heads_in_errors holds the prefix kernel's heads_io_errors (both are head_io_rows_errors).
    return (covers_tail_resolved and window_merges
            and not heads_in_errors(r, group, window_block_rows(r * group, d, b * kv_heads)))


def verify_attention(q, k_pool, v_pool, page_table, prefix_lengths, mask, *, config: CascadeConfig):
    """Verify: the N tree nodes are both the query rows and the window (R = W = N).

    `q [B, N, Hq, D]`, `mask [B, N, 2] uint32` (ancestor-or-self rows), `prefix_lengths` = committed
    tokens before the window -> `[B, N, Hq, D]`.
    """
    n = q.shape[1]
    if not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"verify_attention: N={n} nodes must be in [1, {MAX_TREE_NODES}]")
    return cascade_attention(q, k_pool, v_pool, page_table, prefix_lengths, mask, window=n, config=config)


def lane_window(k: int, steps: int, what: str) -> int:
    """The draft lanes' window W = (steps - 1) * K keys, refused (naming `what`) where there are no
    lanes yet (steps < 2) or it exceeds MAX_TREE_NODES."""
    if steps < 2:
        raise ValueError(f"{what}: lanes exist from draft step 1, so steps must be >= 2, got {steps}")
    window = (steps - 1) * k
    if window > MAX_TREE_NODES:
        raise ValueError(f"{what}: lane window (steps-1)*K = {window} exceeds {MAX_TREE_NODES}")
    return window


def lane_attention(q, k_pool, v_pool, page_table, frontier, lane_mask, *, steps: int, config: CascadeConfig):
    """Draft lanes: R = K lane rows over the lane window of W = (steps - 1) * K keys at the frontier.

    `q [B, K, Hq, D]`, `frontier [B]` (accepted tokens; the window starts there), `lane_mask [B, K, 2]`
    (bit s*K + r for the lane written at step s as lane r, plus its parent lane's bits)
    -> `[B, K, Hq, D]`.
    """
    window = lane_window(q.shape[1], steps, "lane_attention")
    return cascade_attention(q, k_pool, v_pool, page_table, frontier, lane_mask, window=window, config=config)


def sliding_lane_attention(q, k_pool, v_pool, row_page_table, row_lengths, page_table, frontier, lane_mask,
                           *, window: int, config: CascadeConfig, sliding_window: int | None = None):
    """Draft lanes with per-row page tables (sliding-window draft layers).

    Each lane row decodes its own prefix alone (q_len 1 at its table's last key, optionally only the
    last `sliding_window` keys), then the window kernel attends the tree window only
    (`causal_prefix=False`) at positions frontier + j of `page_table`.
    `q [B, K, Hq, D]`, `row_page_table [B, K, maxp_row]`, `row_lengths [B, K]`, `page_table [B, maxp]`,
    `frontier [B]`, `lane_mask [B, K, 2]` -> `[B, K, Hq, D]`. The prefix half is the Triton decode
    ("auto" takes it; an explicit "mosaic_gpu" is refused: that kernel has no sliding window).
    """
    b, k, hq, d = q.shape
    if config.prefix_kernel == "mosaic_gpu":
        raise ValueError("sliding_lane_attention: prefix_kernel='mosaic_gpu' has no sliding-window or per-row-table "
                         "prefix kernel; use 'auto' or 'triton'")
    if row_page_table.ndim != 3 or row_page_table.shape[:2] != (b, k):
        raise ValueError(f"sliding_lane_attention: row_page_table must be [B={b}, K={k}, maxp], "
                         f"got {row_page_table.shape}")
    if row_lengths.shape != (b, k):
        raise ValueError(f"sliding_lane_attention: row_lengths must be [B={b}, K={k}], got {row_lengths.shape}")
    scale = _scale(config, q)
    prefix_out, prefix_lse2 = prefix_decode(
        q.reshape(b * k, 1, hq, d), k_pool, v_pool, row_page_table.reshape(b * k, -1),
        row_lengths.reshape(b * k), page_size=config.page_size, scale=scale, num_splits=config.num_splits,
        sliding_window=sliding_window, fp8_score_dot=config.fp8_score_dot, backend=config.backend)
    prefix_out = prefix_out.reshape(b, k, hq, d)
    prefix_lse2 = prefix_lse2.reshape(b, k, hq)
    out = tree_window_attention(
        q, k_pool, v_pool, page_table, frontier, lane_mask, prefix_out, prefix_lse2, window=window,
        page_size=config.page_size, scale=scale, causal_prefix=False, backend=config.backend)
    return out.astype(q.dtype)


__all__ = ["CascadeConfig", "cascade_attention", "verify_attention", "lane_attention",
           "sliding_lane_attention"]
