"""The MLA latent prefix decode on Mosaic GPU (wgmma + TMA): the default on GPUs.

It runs compiled on Hopper (compiled conformance: `benchmarks/tools/mgpu_prefix_check.py --mla`).
At DeepSeek-V3 widths its cascade is faster than the Triton latent decode's and than XLA's dense
einsum over gathered rows (results: mla-mosaic, mla), so `MlaCascadeConfig(prefix_kernel="auto")`
takes it wherever `mla_mgpu_input_errors` is empty. On the CPU its logic runs in Pallas' GPU
interpreter against the fp32 reference (`tests/test_mla_decode_mgpu.py`); interpreted runs add P V
with a plain dot where the compiled kernel uses wgmma (the interpreter has no rule for the
accumulator `run_state` idiom). The compiled path also lowers on the CPU (layout inference and the
shared-memory check, which refuse e.g. a step below wgmma's K of 64 or an over-budget output tile).

FP8 E4M3 caches (the cascade's "auto" takes this kernel for them too; results: mla-mosaic): q
arrives quantised to FP8 (the cascade's `quantize_absorbed_query`) and the scores are an FP8 x FP8
wgmma (the latent rows are its K-major operand). The value channels are the MN-major operand of P V, which 8-bit wgmma cannot take, so
each warpgroup widens its half of them to an fp16 tile of its own (exact; 64 channels at a time,
`MLA_WIDEN_COLS`), releases the FP8 ring
buffer, and runs P V in fp16.

Why: the Pallas Triton latent decode runs far below the tensor cores' bf16 rate, and its cascade is
slower than XLA's dense einsum over gathered rows (results: mla): a 64-row fp32 accumulator over all
512 latent value channels does not fit one warpgroup's registers, which caps the Triton tiles.

Contract (as `mla_decode.mla_decode`, whole pages only, like `prefix_decode_mgpu`):
    q [B, R, Hq, L + Dr] (16-bit; flat row r * Hq + h), latent_pool [S, L + Dr] (same dtype),
    page_table [B, maxp] int32, prefix_len [B] int32 (P)
    -> out [B, R, Hq, L] f32, lse2 [B, R, Hq] f32 (base 2)
Row r sees keys [0, min(P - R + 1 + r, (P // page_size) * page_size)); the tree window kernel
(`prefix_whole_pages=True`) covers the rest of the prefix. The value is each key row's first L
channels. With `window` W > 0 and `window_mask [B, R, 2] uint32` (schedules "split" and "seesaw";
under an FP8 cache the window keys are scored as the prefix's are, FP8 query x FP8 rows)
the tree window is fused instead: row r sees [0, P) and window key P + j where bit j of its mask is
set, and the output is the final attention (the page table must map every position below P + W).

One CTA per (64-row tile, key split, request): the memory warpgroup TMA-copies the query tile once
and `block_k` latent rows per step (a page slice found through the page table) into a ring of
`stages` buffers. Each compute warpgroup accumulates half of the L value channels, so an
accumulator is [64, L / 2] fp32. How they share the scores is the `schedule`:
- "seesaw" (the default): the warpgroups score alternate steps whole; the scorer
  hands its P and the row maxima after the step to the other through shared memory (one P buffer,
  one barrier per direction), and each adds P V of every step for its value channels. Warpgroup 1
  scores step i0 + 1 while warpgroup 0 runs the softmax of i0, and runs its own softmax while its
  P V of i0 is in flight, so one warpgroup's softmax overlaps the other's matmuls. Faster than
  "split" at DeepSeek-V3 widths, bf16 and FP8 (results: mla-schedule).
- "split": each scores half of the step's keys against the whole row (latent + rope),
  they swap row maxima through shared memory, each writes its half of P there, and each adds P V
  (P loaded whole into registers) for its value channels, issued together with its scores of the
  next step. Only the useful tensor work, at the price of two exchanges per step.
- "turns" and "together": both score every key and run the same online softmax,
  no exchange, 1.5x the useful tensor work at L = 512, Dr = 64; under "turns" they take turns on
  the tensor cores (as the GQA prefix kernel's `pingpong`).
The schedules land within 5-10% of each other at DeepSeek-V3 widths (`DEFAULT_SCHEDULE_16BIT` and
`_FP8` name the fastest; results: mla-schedule): neither a third less tensor work nor L2-resident
pages buy much (`benchmarks/mla_variants.py`), so the step is bound by its serial chain (score
wgmma, softmax, exchanges, P V) rather than by tensor or memory throughput.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.prefix_decode import default_num_splits
from pallas_kernels.attention.prefix_decode_mgpu import (_smem_transforms, cta_key_blocks,
                                                         fused_key_blocks, fused_window_words, grid_in_order,
                                                         log2_of, online_softmax_update, register_budget_errors,
                                                         whole_page_bound, window_visible)
from pallas_kernels.attention.split_merge import merge_splits, out_dtype_errors
from pallas_kernels.common import LOG2E, MAX_SMEM_BYTES, require_bool_fields
from pallas_kernels.tree_masks import MAX_TREE_NODES

F8 = jnp.dtype(jnp.float8_e4m3fn)
ROWS = 64  # query rows per CTA (one wgmma M tile)
OUT_CHUNK = 16  # value columns per output copy (the staging tile is [ROWS, OUT_CHUNK])
# Output dtypes the kernel writes (`out_dtype`, split_merge.OUT_DTYPES): float32, or the 16-bit
# model dtype where its output is final (the fused window without key splits), so no separate XLA
# cast pass runs over [B, R, Hq, L] (results: mla-out-dtype).
CLEAN_COLS = 64  # value columns per register pass when the fused window zeroes unseen V rows
# Within MAX_SMEM_BYTES Mosaic GPU starts every buffer on a 1024-byte boundary; the barriers and its
# own bookkeeping take a little more.
SMEM_ALIGN = 1024
SMEM_OVERHEAD = 1024
# How the two compute warpgroups share a step (`schedule`):
#   "split": each scores half of the step's keys; the row maxima and P meet in shared memory, and
#            each adds P V for its half of the value channels (no duplicated score matmul); a
#            step's P V goes out together with the next step's scores;
#   "turns": both score every key (duplicated) and take turns on the tensor cores, one's softmax
#            (and FP8 widening) running while the other's matmuls do;
#   "together": both score every key, no turns;
#   "seesaw": the warpgroups score alternate steps whole (64 keys, one wgmma N of 64 instead of two
#            of 32) and hand each step's P and row maxima to the other in turn, each adding P V of
#            every step for its value channels; one warpgroup's softmax runs while the other's
#            matmuls do, as FlashMLA's schedule on Hopper.
# The schedules' times and the forms built and removed ("lookahead") are in results: mla-schedule.
SCHEDULES = ("split", "seesaw", "turns", "together")
# Schedules whose warpgroups hand P and the row maxima to each other through shared memory (the
# exchange buffers, and the output staged in the ring's memory once the key loop is done).
EXCHANGES = ("split", "seesaw")
# "seesaw" is the fastest schedule for 16-bit and FP8 caches alike: both warpgroups' score matmuls
# in flight at once keep the tensor cores busiest (results: mla-schedule).
DEFAULT_SCHEDULE_16BIT = "seesaw"
DEFAULT_SCHEDULE_FP8 = "seesaw"


# The (compute, memory) warpgroups' `setmaxnreg` budgets `registers=None` stands for. The seesaw
# compute warpgroups spill under the GQA kernel's (232, 40), and the memory warpgroup only issues
# copies, so it gives 16 registers to each; (240, 24) is faster for every form (results:
# mla-registers).
MLA_REGISTERS = (240, 24)
# Value channels an FP8 step's warpgroup widens to fp16 per piece (`widen_cols`; where this does
# not divide kv_lora_rank / 2 in swizzle-aligned pieces, the whole half is one piece). A piece is
# loaded in the WGMMA layout, widened and stored before the next is loaded, so its registers (a
# [64, 64] piece: 8 of FP8 and 16 of fp16 per thread) are all that sits beside the 128-register
# accumulator and P. Pieces of 64 are the fastest, the same output bits (results: mla-widen-cols).
MLA_WIDEN_COLS = 64
# Row tiles of one (request, split) per cluster (`cluster_tiles`): the cluster's CTAs read the same
# latent steps, so each copies 1 / cluster_tiles of a step and TMA multicasts it to all of them,
# cutting the L2-to-SM traffic by that factor (at B=32, P=8192, N=16, 128 heads the 32 tiles of a
# request read each page from L2 32 times). Off (1): 2 and 4 tiles per cluster are slower, the same
# bits: a cluster's tiles move in lockstep (a slot is refilled once every CTA of it has released
# it), and L2 is not what bounds the step (results: cluster-tiles).
MLA_CLUSTER_TILES = 1


@dataclasses.dataclass(frozen=True)
class MlaMgpuConfig:
    """The default rules of `mla_decode_mgpu`: which optional forms `p_in_ring=None` and
    `loop_descriptors=None` take (an explicit knob on the entry point wins). `default_config()`
    gives the library's rules; the entry point takes `config=` (None: `default_config()`)."""
    # "seesaw" hands P over in the rope columns of the step's own ring slot (`p_in_ring`), where
    # that applies (`p_in_ring_errors` empty). Once a step's scores are in, nothing reads its rope
    # channels again, and at Dr = block_k = 64 they are one [64, 64] tile with the 128-byte swizzle
    # a wgmma operand needs, so the scorer writes P there and both warpgroups take it from shared
    # memory as P V's A operand: no P in registers while P V is in flight, no P buffer (8 KiB), no
    # load of the other's P. 16-bit caches only (FP8 rope columns hold half of a 16-bit P). The same
    # output bits. results: p-in-ring.
    p_in_ring: bool = True
    # "seesaw" builds its pair's wgmma descriptors (the query tile's and the ring slots') inside the
    # key loop (`loop_descriptors`). They depend on shared-memory addresses only, so LLVM would hoist
    # all of them out of the loop, one 64-bit value per 16-channel slice of each operand (the
    # query's 36 at L + Dr = 576 alone), and ptxas would spill them and reload them every pair.
    # Indexed at a zero the compilers cannot prove constant, the descriptors are built next to their
    # wgmmas. The same output bits. results: loop-descriptors.
    loop_descriptors: bool = True

    def __post_init__(self):
        require_bool_fields(self)


def default_config() -> MlaMgpuConfig:
    """The default rules for every shape and cache dtype (each rule reads the schedule, shapes and
    dtype where it is applied): every field at its documented default."""
    return MlaMgpuConfig()


def default_schedule(dtype) -> str:
    """The `schedule` None stands for under this cache dtype (read per call)."""
    return DEFAULT_SCHEDULE_FP8 if jnp.dtype(dtype) == F8 else DEFAULT_SCHEDULE_16BIT


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN


# Latent ring buffers `stages=None` stands for: a third fits beside FP8 rows at L + Dr = 576 only,
# and there it made the split decode 3-5% slower (results: mla-schedule).
DEFAULT_STAGES = 2


def schedule_fits(schedule: str, width: int, itemsize: int, kv_lora_rank: int, block_k: int = 64) -> bool:
    """Whether `schedule` (at DEFAULT_STAGES) fits shared memory at this row width and dtype."""
    return smem_bytes(width, itemsize, block_k, DEFAULT_STAGES, schedule, kv_lora_rank) <= MAX_SMEM_BYTES


def smem_bytes(width: int, itemsize: int, block_k: int, stages: int, schedule: str, kv_lora_rank: int,
               p_in_ring: bool = False) -> int:
    """Shared memory the kernel allocates: query tile, latent ring, with 1-byte (FP8) rows the fp16
    value rows both warpgroups widen, output staging; under "split" and "seesaw" also the P and row-statistic
    exchange (no P buffer under `p_in_ring`), with the output staged in the ring's memory (a union:
    disjoint lifetimes)."""
    half = kv_lora_rank // 2
    ring = _aligned(stages * block_k * width * itemsize)
    if itemsize == 1:
        ring += 2 * _aligned(block_k * half * 2)
    lse = _aligned(ROWS * 4)
    if schedule in EXCHANGES:
        staged = max(ring, _aligned(2 * ROWS * half * 4) + lse)
        p_buffer = 0 if p_in_ring else _aligned(ROWS * block_k * 2)
        exchange = p_buffer + _aligned((4 if schedule == "seesaw" else 2) * ROWS * 4)
        return _aligned(ROWS * width * itemsize) + staged + exchange + SMEM_OVERHEAD
    return _aligned(ROWS * width * itemsize) + ring + _aligned(ROWS * OUT_CHUNK * 4) + lse + SMEM_OVERHEAD


def mla_mgpu_input_errors(q, latent_pool, kv_lora_rank: int, page_size: int, block_k: int) -> list[str]:
    """Every reason this kernel cannot take these inputs (empty: it can). Arrays or ShapeDtypeStructs."""
    c = q.shape[-1]
    errors = []
    if latent_pool.ndim != 2 or latent_pool.shape[1] != c:
        errors.append(f"mla_decode_mgpu: latent_pool must be [S, {c}], got {latent_pool.shape}")
    if c % 64 or kv_lora_rank % 128 or not 0 < kv_lora_rank < c:
        errors.append(f"mla_decode_mgpu: row width {c} must be a multiple of 64 and kv_lora_rank "
                      f"{kv_lora_rank} a multiple of 128 below it")
    if block_k % 64 or page_size % block_k:
        # The P V product's contraction runs over the step's keys: a wgmma K of 64 at least.
        errors.append(f"mla_decode_mgpu: block_k must be a multiple of 64 dividing page_size {page_size}, "
                      f"got {block_k}")
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(latent_pool.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), F8):
        errors.append(f"mla_decode_mgpu: q and the latent pool must share one dtype of bfloat16, float16 or "
                      f"float8_e4m3fn (an FP8 cache takes the query quantised to FP8), got "
                      f"{q.dtype}, {latent_pool.dtype}")
    return errors


def check_mla_mgpu_inputs(q, latent_pool, kv_lora_rank: int, page_size: int, block_k: int):
    """Shapes this kernel takes; raises naming every unsupported value."""
    errors = mla_mgpu_input_errors(q, latent_pool, kv_lora_rank, page_size, block_k)
    if errors:
        raise ValueError("; ".join(errors))


def mla_decode_mgpu(q, latent_pool, page_table, prefix_len, window_mask=None, *, kv_lora_rank: int, page_size: int,
                    scale: float, block_k: int = 64, stages: int | None = None, num_splits: int | None = None,
                    schedule: str | None = None, window: int = 0, tiles_adjacent: bool = True,
                    registers: tuple[int, int] | None = None, p_in_ring: bool | None = None,
                    widen_cols: int | None = None, cluster_tiles: int | None = None,
                    loop_descriptors: bool | None = None, out_dtype=jnp.float32, interpret: bool = False,
                    config: MlaMgpuConfig | None = None):
    """See `_mla_decode_mgpu`; `schedule` one of SCHEDULES, None: `default_schedule(q.dtype)`;
    `stages` None: DEFAULT_STAGES; `registers` the (compute, memory) warpgroups' `setmaxnreg`
    budgets, None: MLA_REGISTERS. `p_in_ring` ("seesaw", 16-bit caches, rope channels >= block_k):
    P handed over in the step's rope columns and read from there by P V; None:
    `config.p_in_ring` where it applies. `widen_cols` (FP8 caches): value channels a warpgroup
    widens per piece, None: `default_widen_cols`. `cluster_tiles`: row tiles of one (request,
    split) launched as one cluster whose latent steps are TMA-multicast (each tile's CTA copies
    1 / cluster_tiles of a step into all of them), None: `default_cluster_tiles`.
    `loop_descriptors` ("seesaw"): the pair's wgmma descriptors built inside the key loop rather
    than hoisted out of it (and spilled); None: `config.loop_descriptors` under "seesaw". `out_dtype`
    (split_merge.OUT_DTYPES): the returned output's dtype; the kernel writes it itself without key
    splits (their partials stay float32 until the merge writes it).
    `window` > 0 with `window_mask [B, R, 2] uint32` (packed ancestor rows) fuses the tree window.
    `config`: the default rules the knobs left None follow (`MlaMgpuConfig`; None: `default_config()`)."""
    config = default_config() if config is None else config
    if schedule is None:
        schedule = default_schedule(q.dtype)
    if schedule not in SCHEDULES:
        raise ValueError(f"mla_decode_mgpu: schedule must be one of {SCHEDULES} or None, got {schedule!r}")
    if stages is None:
        stages = DEFAULT_STAGES
    registers = tuple(registers or MLA_REGISTERS)
    if loop_descriptors is None:
        loop_descriptors = config.loop_descriptors and schedule == "seesaw"
    ring_errors = p_in_ring_errors(q, kv_lora_rank, block_k, schedule)
    if p_in_ring is None:
        p_in_ring = config.p_in_ring and not ring_errors
    errors = fused_window_errors(q, window_mask, window, schedule)
    if p_in_ring is not False and p_in_ring is not True:
        errors.append(f"mla_decode_mgpu: p_in_ring must be None, True or False, got {p_in_ring!r}")
    elif p_in_ring:
        errors += ring_errors
    if loop_descriptors is not False and loop_descriptors is not True:
        errors.append(f"mla_decode_mgpu: loop_descriptors must be None, True or False, got {loop_descriptors!r}")
    elif loop_descriptors and schedule != "seesaw":
        errors.append(f"mla_decode_mgpu: loop_descriptors builds the wgmma descriptors in the key loop under "
                      f"schedule 'seesaw' only, got {schedule!r}")
    errors += out_dtype_errors(out_dtype, "mla_decode_mgpu")
    errors += [f"mla_decode_mgpu: {e}" for e in register_budget_errors(registers, 2)]
    fp8_rows = jnp.dtype(q.dtype) == F8
    if widen_cols is None:
        widen_cols = default_widen_cols(q.shape[-1], kv_lora_rank) if fp8_rows else kv_lora_rank // 2
    elif fp8_rows:
        errors += widen_cols_errors(widen_cols, q.shape[-1], kv_lora_rank)
    else:
        errors.append(f"mla_decode_mgpu: widen_cols applies to FP8 caches only (16-bit rows are not widened), "
                      f"got {widen_cols!r} with {q.dtype} rows")
    tiles = -(-q.shape[1] * q.shape[2] // ROWS)
    if cluster_tiles is None:
        cluster_tiles = default_cluster_tiles(tiles, tiles_adjacent)
    else:
        errors += cluster_tiles_errors(cluster_tiles, tiles, tiles_adjacent)
    if errors:
        raise ValueError("; ".join(errors))
    return _mla_decode_mgpu(q, latent_pool, page_table, prefix_len, window_mask, kv_lora_rank=kv_lora_rank,
                            page_size=page_size, scale=scale, block_k=block_k, stages=stages, num_splits=num_splits,
                            schedule=schedule, window=int(window), tiles_adjacent=tiles_adjacent,
                            registers=registers, p_in_ring=p_in_ring, widen_cols=int(widen_cols),
                            cluster_tiles=int(cluster_tiles), loop_descriptors=loop_descriptors,
                            out_dtype=jnp.dtype(out_dtype).name, interpret=interpret)


def cluster_tiles_errors(cluster_tiles, tiles: int, tiles_adjacent: bool) -> list[str]:
    """Every reason `cluster_tiles` cannot group this launch's `tiles` row tiles of a (request,
    split) into multicast clusters."""
    if isinstance(cluster_tiles, bool) or not isinstance(cluster_tiles, int) or cluster_tiles not in (1, 2, 4):
        return [f"mla_decode_mgpu: cluster_tiles must be 1, 2 or 4, got {cluster_tiles!r}"]
    errors = []
    if tiles % cluster_tiles:
        errors.append(f"mla_decode_mgpu: cluster_tiles={cluster_tiles} must divide the {tiles} row tiles of 64 "
                      f"(R * Hq rows) of a request")
    if cluster_tiles > 1 and not tiles_adjacent:
        # The cluster spans the launch's fastest axis, which holds the tiles only when adjacent.
        errors.append(f"mla_decode_mgpu: cluster_tiles={cluster_tiles} needs tiles_adjacent=True")
    return errors


def default_cluster_tiles(tiles: int, tiles_adjacent: bool) -> int:
    """`cluster_tiles=None`: MLA_CLUSTER_TILES where it groups these tiles, else 1."""
    ok = not cluster_tiles_errors(MLA_CLUSTER_TILES, tiles, tiles_adjacent)
    return MLA_CLUSTER_TILES if ok else 1


def widen_unit(width: int) -> int:
    """Channels of one swizzle tile of FP8 rows `width` wide (the ring's swizzle, as `_smem_transforms`
    picks it; one byte per channel): a widened piece starts and ends on one."""
    return plgpu.find_swizzle(width * 8)


def widen_cols_errors(widen_cols, width: int, kv_lora_rank: int) -> list[str]:
    """Every reason `widen_cols` cannot split a warpgroup's kv_lora_rank / 2 FP8 value channels
    (rows `width` channels wide) into swizzle-aligned pieces."""
    half, unit = kv_lora_rank // 2, widen_unit(width)
    if isinstance(widen_cols, bool) or not isinstance(widen_cols, int) or widen_cols <= 0 \
            or widen_cols % unit or half % widen_cols:
        return [f"mla_decode_mgpu: widen_cols must be a multiple of {unit} (the FP8 rows' swizzle at width {width}) "
                f"dividing kv_lora_rank / 2 = {half}, got {widen_cols!r}"]
    return []


def default_widen_cols(width: int, kv_lora_rank: int) -> int:
    """`widen_cols=None` under FP8 rows `width` wide: MLA_WIDEN_COLS where it splits the half, else the half."""
    ok = not widen_cols_errors(MLA_WIDEN_COLS, width, kv_lora_rank)
    return MLA_WIDEN_COLS if ok else kv_lora_rank // 2


def p_in_ring_errors(q, kv_lora_rank: int, block_k: int, schedule: str) -> list[str]:
    """Every reason P cannot be handed over in the ring slot's rope columns (empty: it can)."""
    errors = []
    if schedule != "seesaw":
        errors.append(f"mla_decode_mgpu: p_in_ring hands P over under schedule 'seesaw' only, got {schedule!r}")
    if jnp.dtype(q.dtype).itemsize != 2:
        errors.append(f"mla_decode_mgpu: p_in_ring needs a 16-bit cache (FP8 rope columns hold half of a 16-bit P), "
                      f"got {q.dtype}")
    if q.shape[-1] - kv_lora_rank < block_k:
        errors.append(f"mla_decode_mgpu: p_in_ring needs rope channels ({q.shape[-1] - kv_lora_rank}) >= block_k "
                      f"({block_k}): P's [64, block_k] tile lives there")
    return errors


def fused_window_errors(q, window_mask, window: int, schedule: str) -> list[str]:
    """Every reason the fused tree window cannot run on these inputs (empty: it can, or no window)."""
    if not window and window_mask is None:
        return []
    b, r = q.shape[:2]
    errors = []
    if not 1 <= window <= MAX_TREE_NODES:
        errors.append(f"mla_decode_mgpu: window must be in [1, {MAX_TREE_NODES}] with a window_mask, got {window}")
    if window_mask is None or tuple(window_mask.shape) != (b, r, 2) or window_mask.dtype != jnp.uint32:
        errors.append(f"mla_decode_mgpu: window={window} needs window_mask [B={b}, R={r}, 2] uint32, got "
                      f"{None if window_mask is None else (tuple(window_mask.shape), str(window_mask.dtype))}")
    if schedule not in EXCHANGES:
        errors.append(f"mla_decode_mgpu: the fused window runs under schedules {EXCHANGES} only, got {schedule!r}")
    return errors


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "page_size", "scale", "block_k", "stages",
                                             "num_splits", "schedule", "window", "tiles_adjacent", "registers",
                                             "p_in_ring", "widen_cols", "cluster_tiles", "loop_descriptors",
                                             "out_dtype", "interpret"))
def _mla_decode_mgpu(q, latent_pool, page_table, prefix_len, window_mask, *, kv_lora_rank: int, page_size: int,
                     scale: float, block_k: int, stages: int, num_splits: int | None, schedule: str, window: int,
                     tiles_adjacent: bool, registers: tuple[int, int], p_in_ring: bool, widen_cols: int,
                     cluster_tiles: int, loop_descriptors: bool, out_dtype: str, interpret: bool):
    """See the module docstring. `block_k` keys per step (a multiple of 64: the P V contraction).
    At L + Dr = 576 the query tile and two 64-key latent buffers take 216 KiB of the 227 KiB of
    shared memory. Without split scores the output leaves in [64, 16] fp32 pieces; under "split"
    the P and row-maximum exchange (9 KiB) take that room, and each warpgroup stages its whole half
    of the output in the latent ring's memory once the ring is done (a RefUnion); that fits only
    without Mosaic GPU's 2 KiB cross-warp reduction scratch, which WGMMA-layout row reductions do
    not use (`reduction_scratch_bytes=0`).
    `tiles_adjacent`: launch the row tiles of one (request, split), which read the same latent
    pages, next to each other (Mosaic GPU runs the grid's last axis fastest; the grid in the order
    (tiles, splits, batch) puts them B CTAs apart, so each latent page is read from HBM once per
    tile). Side by side is faster for both cache dtypes, so it is the default (results: grid-order)."""
    check_mla_mgpu_inputs(q, latent_pool, kv_lora_rank, page_size, block_k)
    split_scores, pingpong, seesaw = schedule == "split", schedule == "turns", schedule == "seesaw"
    exchanges = schedule in EXCHANGES
    if stages < 2:
        raise ValueError(f"mla_decode_mgpu: stages must be >= 2, got {stages}")
    # Under an FP8 cache the scores are an FP8 x FP8 wgmma (the latent rows are its K-major
    # operand); the value channels are the MN-major operand of P V, which 8-bit wgmma cannot take,
    # so each warpgroup widens its half of the step's value channels to fp16 in shared memory.
    fp8 = jnp.dtype(q.dtype) == F8
    b, r, hq, c = q.shape
    need = smem_bytes(c, q.dtype.itemsize, block_k, stages, schedule, kv_lora_rank, p_in_ring)
    if need > MAX_SMEM_BYTES:
        raise ValueError(f"mla_decode_mgpu: block_k={block_k}, stages={stages}, schedule={schedule!r} at "
                         f"row width {c} need {need} bytes of shared memory, more than {MAX_SMEM_BYTES}")
    dtype = q.dtype
    pv_dtype = jnp.float16 if fp8 else dtype  # P V operands: FP8 rows widen exactly to fp16
    half = kv_lora_rank // 2
    rows = r * hq
    rows_pad = -(-rows // ROWS) * ROWS
    tiles = rows_pad // ROWS
    max_blocks = page_table.shape[1] * (page_size // block_k)
    splits = num_splits or default_num_splits(b, 1, tiles, max_blocks)
    # The dtype the kernel writes: the asked one where its output is final, else float32 partials.
    write_dtype = jnp.dtype(out_dtype) if splits == 1 else jnp.dtype(jnp.float32)
    scale2 = float(scale) * LOG2E
    qf = jnp.pad(q.reshape(b, rows, c), ((0, 0), (0, rows_pad - rows), (0, 0)))
    fused = window > 0
    # Interpreted, a cluster's tiles step through the same keys as compiled, each copying the whole
    # step itself (Pallas' GPU interpreter has no cluster barriers or multicast copies).
    clustered = cluster_tiles > 1 and not interpret
    if fused:
        # Row r * Hq + h gets request row r's mask words; `union`: the window slots some row sees.
        words, union = fused_window_words(window_mask, hq, rows_pad)
    else:
        words, union = jnp.zeros((b, 2, 1), jnp.int32), jnp.zeros((b, 2), jnp.int32)  # unread

    def body(q_gmem, lat_gmem, pt_gmem, len_gmem, words_gmem, union_gmem, out_gmem, lse_gmem, scoped):
        (q_buffer, kv_smem, wide_smem, *out_bufs), (q_ready, kv_ready, kv_free, *syncs) = scoped
        q_smem = q_buffer.at[0]
        if exchanges:
            (p_smem, stat_smem), (o_smem, lse_smem) = out_bufs
            stats_ready, p_ready = syncs  # seesaw: p_ready [2], one per direction
        else:
            o_smem, lse_smem = out_bufs
            o_free, turn = syncs
        # Under a cluster the grid's "tiles" axis counts clusters of `cluster_tiles` adjacent tiles.
        tile = lax.axis_index("tiles")
        if clustered:
            tile = tile * cluster_tiles + lax.axis_index("ctile")
        split = lax.axis_index("splits")
        bi = lax.axis_index("batch")
        wg = lax.axis_index("wg")
        length = len_gmem[bi]
        row0 = tile * ROWS
        if fused:
            # Every row reads [0, P + window): the committed keys and the window under its mask
            # bits. The page table maps every position below P + window, so each step's page does.
            lo, hi = fused_key_blocks(length, window, block_k, split, splits)
        else:
            # A cluster's CTAs step through the same keys (one multicast copy feeds them all): the
            # steps of its last tile's rows; an earlier tile masks the keys past its rows' bounds.
            cluster_row0 = (tile - lax.rem(tile, jnp.int32(cluster_tiles))) * ROWS
            whole, lo, hi = cta_key_blocks(length, page_size, r, hq, cluster_row0, ROWS * cluster_tiles, block_k,
                                           split, splits)

        def compute(w: int):
            plgpu.set_max_registers(registers[0], action="increase")
            plgpu.barrier_wait(q_ready)
            # Under split_scores this warpgroup scores keys [w * score_k, (w + 1) * score_k) of each step.
            score_k = block_k // 2 if split_scores else block_k
            key_off = w * score_k if split_scores else 0
            shape = (ROWS, score_k)

            # The masks' index arrays are built inside each masked step, not once before the key
            # loops: held across them, a [64, 64] int32 array costs 32 registers per thread for the
            # whole loop, beside a 128-register accumulator. With the column and row-bound arrays
            # built up front, ptxas spilled 1.45-1.6 KB per thread; what this form spills is
            # measured by `benchmarks/tools/ptxas_report.py`.
            def key_index(i):
                return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (key_off + i * block_k)

            if fused:
                # [64] per word, broadcast over the keys only inside a masked step.
                row_words = [plgpu.load(words_gmem.at[bi, k, pl.ds(row0, ROWS)], layout=plgpu.Layout.WGMMA.reduce(1),
                                        optimized=False)
                             for k in range(2)]
                seen_slots = (union_gmem[bi, 0], union_gmem[bi, 1])  # the OR of the request's masks
                open_end = jnp.clip(lax.div(length, jnp.int32(block_k)), lo, hi)  # steps wholly below P

                def visible(i):
                    step_words = [lax.broadcast_in_dim(v, shape, [0]) for v in row_words]
                    return window_visible(key_index(i), length, window, step_words)
            else:
                first_hi = jnp.maximum(whole_page_bound(length, r, hq, row0, whole), 0)
                open_end = jnp.clip(lax.div(first_hi, jnp.int32(block_k)), lo, hi)

                def visible(i):
                    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
                    return key_index(i) < whole_page_bound(length, r, hq, row, whole)
            cols = pl.ds(w * half, half)  # this warpgroup's value channels (static)

            def value_tile(slot, clean_step=None):
                """This warpgroup's value channels of the step: the latent rows themselves, or
                under FP8 their fp16 copy (widened here; the FP8 buffer may be released after).
                FP8 rows widen `widen_cols` channels at a time, so only one piece's registers are
                live beside the accumulator and P; with `clean_step` i (the fused window's masked
                step) each piece's unseen rows are zeroed on the way (`clean_values`' rule)."""
                if not fp8:
                    return kv_smem.at[slot].at[:, cols]
                wide = wide_smem[w]
                for j in range(half // widen_cols):
                    piece_cols = pl.ds(j * widen_cols, widen_cols)
                    v = plgpu.load(kv_smem.at[slot].at[:, pl.ds(w * half + j * widen_cols, widen_cols)],
                                   layout=plgpu.Layout.WGMMA).astype(pv_dtype)
                    wide.at[:, piece_cols][...] = v if clean_step is None else zero_unseen(v, clean_step)
                plgpu.commit_smem()
                return wide

            def zero_unseen(v, i):
                """`v` (WGMMA-layout value rows of masked step i) with the rows no row of the request
                may see set to zero (`clean_values`' rule)."""
                key = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA) + i * block_k
                return jnp.where(window_visible(key, length, window, seen_slots), v, jnp.zeros_like(v))

            def clean_values(v_tile, i):
                """Fused window, masked step i: zero this warpgroup's value channels of the rows no
                row of the request may see (past P + window, or window slots outside every row's
                mask; they may hold NaN / inf, which a zero softmax weight would still spread). Only
                this warpgroup reads these channels; the other's scores may read the rows, but
                those scores are masked whatever they hold."""
                for j in range(half // CLEAN_COLS):
                    chunk = v_tile.at[:, pl.ds(j * CLEAN_COLS, CLEAN_COLS)]
                    chunk[...] = zero_unseen(plgpu.load(chunk, layout=plgpu.Layout.WGMMA), i)
                plgpu.commit_smem()
                return v_tile

            def step_values(slot, i, masked: bool):
                """This warpgroup's value channels of step i, ready for P V (FP8: widened, the ring
                slot then released by this warpgroup; fused and masked: unseen rows zeroed, under
                FP8 while widening)."""
                clean = fused and masked
                if fp8:
                    v_tile = value_tile(slot, i if clean else None)
                else:
                    v_tile = clean_values(value_tile(slot), i) if clean else value_tile(slot)
                release(slot, False)
                return v_tile

            def add_values(acc, p, v_tile):
                """acc + P V[:, this warpgroup's half]; P in registers (the matmul dtype)."""
                if interpret:
                    # No interpreter rule for run_state: same acc + P V through a plain dot.
                    return acc + jnp.dot(p, v_tile[...], preferred_element_type=jnp.float32)

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_tile)

                return pl.run_state(values)(plgpu.ACC.init(acc))

            def own_keys(slot):
                """This warpgroup's keys of a split step, as the scores' K-major operand."""
                return kv_smem.at[slot].at[pl.ds(key_off, score_k)].transpose((1, 0))

            def half_scores(slot):
                """This warpgroup's scores of a split step, waited."""
                def run(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, own_keys(slot))
                    return acc_ref[...]

                return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

            def release(slot, after_values: bool):
                # FP8: both matmul operands are copied out once the values are widened.
                if after_values != fp8:
                    plgpu.barrier_arrive(kv_free.at[slot])

            def take_turn():
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

            def step(i, carry, masked: bool):
                """Both warpgroups score the whole step (the duplicated score matmul); under
                "turns" they take turns on the tensor cores, one's softmax (and FP8 widening)
                running while the other's matmuls do."""
                acc, m, l = carry
                slot = lax.rem(i - lo, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])

                def run(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot].transpose((1, 0)))
                    if pingpong:
                        take_turn()  # the other warpgroup's matmuls go next
                    return acc_ref[...]

                s = pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))
                p, alpha, m_new, l, acc = online_softmax_update(s, m, l, acc, scale2, visible(i) if masked else None)
                p16 = p.astype(pv_dtype)
                if pingpong:
                    plgpu.barrier_arrive(turn)  # softmax done
                v_tile = value_tile(slot)
                release(slot, False)
                if pingpong:
                    plgpu.barrier_wait(turn)  # the tensor cores are ours again
                acc = add_values(acc, p16, v_tile)
                release(slot, True)
                return acc, m_new, l

            def exchange(mine, base: int = 0):
                """Write this warpgroup's row statistic, wait for the other's, return it. One buffer
                is enough: a warpgroup writes again only after both have passed the P exchange
                (or, at the end, the last step), which follows the other's read. Under "seesaw"
                the final row sums take rows `base` = 2, 3: the last step's maximum in rows 0, 1
                may still be unread."""
                stat_smem.at[base + w][...] = mine
                plgpu.commit_smem()
                plgpu.barrier_arrive(stats_ready)
                plgpu.barrier_wait(stats_ready)
                return plgpu.load(stat_smem.at[base + 1 - w], layout=plgpu.Layout.WGMMA.reduce(1))

            def split_softmax(i, s, m, l, masked: bool):
                """A split step's softmax: from this warpgroup's scores `s` of step i, swap row
                maxima, write this warpgroup's columns of P to shared memory and announce them
                (`whole_p` waits for the other's); returns the rescale factor, the new maximum and
                this warpgroup's row sums. `m` is the same in both warpgroups, `l` sums this
                warpgroup's keys only."""
                if masked:
                    s = jnp.where(visible(i), s, -jnp.inf)
                m_mine = jnp.maximum(m, s.max(axis=1) * scale2)
                m_new = jnp.maximum(m_mine, exchange(m_mine))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m - m_use)
                p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_use, shape, [0]))
                l = l * alpha + p.sum(axis=1)
                # The other warpgroup finished reading its copy of P (into registers) before it
                # sent this step's maximum.
                p_smem.at[:, pl.ds(key_off, score_k)][...] = p.astype(pv_dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
                return alpha, m_new, l

            def whole_p():
                plgpu.barrier_wait(p_ready)
                # P leaves shared memory for registers: a shared-memory A operand would need V's
                # 128-byte swizzle, which a warpgroup's half of the columns cannot be stored into.
                return plgpu.load(p_smem, layout=plgpu.Layout.WGMMA)

            def split_step(i, carry, masked: bool):
                """Split step i < hi - 1: each warpgroup has scored half the step's keys (`s`, carried
                in); the row maxima and the two halves of P meet in shared memory, and each
                warpgroup's P V for its value channels goes out together with its scores of step
                i + 1 (waited together, so the tensor cores get both back to back)."""
                acc, m, l, s = carry
                slot = lax.rem(i - lo, jnp.int32(stages))
                nxt = lax.rem(i + 1 - lo, jnp.int32(stages))
                alpha, m_new, l = split_softmax(i, s, m, l, masked)
                v_tile = step_values(slot, i, masked)
                p_full = whole_p()
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if interpret:
                    acc = add_values(acc, p_full, v_tile)
                    plgpu.barrier_wait(kv_ready.at[nxt])
                    s = half_scores(nxt)
                else:
                    def in_flight(o_ref, s_ref):
                        o_ref[...] = acc
                        plgpu.wgmma(o_ref, p_full, v_tile)
                        plgpu.barrier_wait(kv_ready.at[nxt])
                        plgpu.wgmma(s_ref, q_smem, own_keys(nxt))
                        o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                        s_next = plgpu.wgmma_accumulator_load(s_ref, wait_n=0)
                        # P V read P from registers until the wait: keep them from reuse before it.
                        o, _ = lax.optimization_barrier((o, p_full))
                        return o, s_next

                    acc, s = pl.run_scoped(in_flight, plgpu.ACC((ROWS, half), jnp.float32),
                                           plgpu.ACC(shape, jnp.float32))
                release(slot, True)
                return acc, m_new, l, s

            def split_steps(acc, m, l):
                def run(acc, m, l):
                    plgpu.barrier_wait(kv_ready.at[0])  # step lo's slot
                    carry = (acc, m, l, half_scores(0))
                    last = hi - 1
                    mid = jnp.minimum(open_end, last)
                    carry = lax.fori_loop(lo, mid, functools.partial(split_step, masked=False), carry)
                    acc, m, l, s = lax.fori_loop(mid, last, functools.partial(split_step, masked=True), carry)
                    slot = lax.rem(last - lo, jnp.int32(stages))
                    alpha, m, l = split_softmax(last, s, m, l, True)
                    v_tile = step_values(slot, last, True)
                    acc = add_values(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), whole_p(), v_tile)
                    release(slot, True)
                    return acc, m, l

                # No step at all (both warpgroups agree): the running state stays as it is.
                return lax.cond(hi > lo, run, lambda *c: c, acc, m, l)

            def whole_scores(slot, zero=0):
                """Scores of a whole step (under "seesaw" this warpgroup's own), waited. `zero`: the
                query tile's index (a loop-variant 0 under `loop_descriptors`)."""
                plgpu.barrier_wait(kv_ready.at[slot])

                def run(acc_ref):
                    plgpu.wgmma(acc_ref, q_buffer.at[zero], kv_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

            def ring_p(slot):
                """`p_in_ring`: P of the step in `slot`, in that slot's rope columns ([64, block_k])."""
                return kv_smem.at[slot].at[:, pl.ds(kv_lora_rank, block_k)]

            def p_operand(p, slot):
                """P V's A operand for the step in `slot`: `p` in registers, or under `p_in_ring`
                the slot's rope columns it was handed over in."""
                return ring_p(slot) if p_in_ring else p

            def hand_over(p16, m_new, slot):
                """Seesaw: this warpgroup's step, P and the row maxima after it, to the other. One P
                buffer serves both directions: each warpgroup writes only after it has read the
                other's last (in registers), which the other wrote after reading the one before.
                Under `p_in_ring` P goes to the step's own rope columns (read by no one once the
                step's scores are in; the slot is refilled only after both P V of the step)."""
                (ring_p(slot) if p_in_ring else p_smem)[...] = p16
                stat_smem.at[w][...] = m_new
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[w])

            def take_over():
                """Seesaw: the other warpgroup's step, (P, row maxima after it); under `p_in_ring`
                P stays in the ring (None here; `p_operand` names it)."""
                plgpu.barrier_wait(p_ready.at[1 - w])
                return (None if p_in_ring else plgpu.load(p_smem, layout=plgpu.Layout.WGMMA),
                        plgpu.load(stat_smem.at[1 - w], layout=plgpu.Layout.WGMMA.reduce(1)))

            def rescale_factor(m, m_new):
                """exp2(m - m_new) as the scorer's softmax takes it (0, not NaN, while a row has seen
                no key)."""
                return jnp.exp2(m - jnp.where(m_new == -jnp.inf, 0.0, m_new))

            def scale_rows(x, alpha):
                return x * lax.broadcast_in_dim(alpha, x.shape, [0])

            def values_during(acc, p, v_tile, during):
                """(acc + P V[:, this warpgroup's half], during()): `during` runs while P V is in flight.
                `p` in registers, or under `p_in_ring` the shared-memory tile it was handed over in."""
                if interpret:
                    got = during()
                    p = p[...] if p_in_ring else p
                    return acc + jnp.dot(p, v_tile[...], preferred_element_type=jnp.float32), got

                def run(o_ref):
                    o_ref[...] = acc
                    plgpu.wgmma(o_ref, p, v_tile)
                    got = during()
                    o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                    if not p_in_ring:
                        # P V read P from registers until the wait: keep them from reuse before it.
                        o, _ = lax.optimization_barrier((o, p))
                    return o, got

                return pl.run_scoped(run, plgpu.ACC((ROWS, half), jnp.float32))

            def seesaw_pair(j, carry, masked: bool, second: bool):
                """Steps i0 = lo + 2j (scored by warpgroup 0) and i0 + 1 (by warpgroup 1; absent when
                not `second`, the range's odd last step). Warpgroup 0 scores i0 and hands P over,
                then adds P V of i0 while it waits for warpgroup 1's P of i0 + 1; warpgroup 1 has
                scored i0 + 1 meanwhile, adds P V of i0 as soon as P arrives, and runs its own
                softmax while that is in flight. Both then add P V of i0 + 1. `m` is the same in
                both warpgroups after every step; `l` sums this warpgroup's own steps only."""
                acc, m, l = carry
                i0 = lo + 2 * j
                # `loop_descriptors`: a 0 the compiler cannot prove constant (j >= 0 passed through an
                # opaque barrier, shifted out), so the wgmma descriptors of the pair's operands are
                # computed here, not hoisted out of the loop and held (spilled) across it.
                zero = lax.shift_right_arithmetic(lax.optimization_barrier(j), 31) if loop_descriptors else 0
                slot0 = lax.rem(2 * j, jnp.int32(stages)) + zero
                slot1 = lax.rem(2 * j + 1, jnp.int32(stages)) + zero
                if w == 0:
                    p, alpha, m0, l, _ = online_softmax_update(whole_scores(slot0, zero), m, l, None, scale2,
                                                               visible(i0) if masked else None)
                    p = p.astype(pv_dtype)
                    hand_over(p, m0, slot0)
                    acc, got = values_during(scale_rows(acc, alpha), p_operand(p, slot0),
                                             step_values(slot0, i0, masked), take_over if second else tuple)
                    release(slot0, True)
                    if not second:
                        return acc, m0, l
                    p1, m1 = got
                    alpha = rescale_factor(m0, m1)
                    acc, _ = values_during(scale_rows(acc, alpha), p_operand(p1, slot1),
                                           step_values(slot1, i0 + 1, masked), tuple)
                    release(slot1, True)
                    return acc, m1, l * alpha
                s = whole_scores(slot1, zero) if second else None
                p0, m0 = take_over()
                p0 = p_operand(p0, slot0)
                alpha = rescale_factor(m, m0)
                acc, l = scale_rows(acc, alpha), l * alpha
                v0 = step_values(slot0, i0, masked)
                if not second:
                    acc, _ = values_during(acc, p0, v0, tuple)
                    release(slot0, True)
                    return acc, m0, l

                def own_softmax():
                    p, alpha, m1, l1, _ = online_softmax_update(s, m0, l, None, scale2,
                                                                visible(i0 + 1) if masked else None)
                    p = p.astype(pv_dtype)
                    hand_over(p, m1, slot1)
                    return (None if p_in_ring else p), alpha, m1, l1

                acc, (p1, alpha, m1, l) = values_during(acc, p0, v0, own_softmax)
                release(slot0, True)
                acc, _ = values_during(scale_rows(acc, alpha), p_operand(p1, slot1),
                                       step_values(slot1, i0 + 1, masked), tuple)
                release(slot1, True)
                return acc, m1, l

            def seesaw_steps(acc, m, l):
                def run(acc, m, l):
                    n = hi - lo
                    pairs = lax.div(n, jnp.int32(2))
                    open_pairs = jnp.clip(lax.div(open_end - lo, jnp.int32(2)), 0, pairs)
                    carry = lax.fori_loop(0, open_pairs, functools.partial(seesaw_pair, masked=False, second=True),
                                          (acc, m, l))
                    carry = lax.fori_loop(open_pairs, pairs, functools.partial(seesaw_pair, masked=True, second=True),
                                          carry)
                    return lax.cond(lax.rem(n, jnp.int32(2)) == 1,
                                    lambda c: seesaw_pair(pairs, c, masked=True, second=False), lambda c: c, carry)

                # No step at all (both warpgroups agree): the running state stays as it is.
                return lax.cond(hi > lo, run, lambda *c: c, acc, m, l)

            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)
            if pingpong and w == 1:
                take_turn()  # start half a step behind warpgroup 0
            if split_scores:
                acc, m, l = split_steps(acc, m, l)
            elif seesaw:
                acc, m, l = seesaw_steps(acc, m, l)
            else:
                carry = lax.fori_loop(lo, open_end, functools.partial(step, masked=False), (acc, m, l))
                acc, m, l = lax.fori_loop(open_end, hi, functools.partial(step, masked=True), carry)
            if pingpong and w == 0:
                take_turn()
            if exchanges:
                # Also the point after which neither warpgroup reads the latent ring again, so the
                # output may be staged in its memory.
                l = l + exchange(l, 2 if seesaw else 0)
            seen = l > 0
            l_safe = jnp.where(seen, l, 1.0)
            out = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]),
                            acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), 0.0)
            lse = jnp.where(seen, m + log2_of(l_safe), -jnp.inf)
            if exchanges:
                # Each half leaves in one copy from its own staging tile (in the ring's memory).
                o_smem.at[w][...] = out.astype(write_dtype)
                if w == 0:
                    lse_smem[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[w], out_gmem.at[split, bi, pl.ds(row0, ROWS), cols])
                if w == 0:
                    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[split, bi, pl.ds(row0, ROWS)])
                plgpu.wait_smem_to_gmem(0)
                return
            # One small staging tile for both halves, piece by piece: warpgroup 1 starts after
            # warpgroup 0's last copy has left shared memory.
            if w == 1:
                plgpu.barrier_wait(o_free)
            if w == 0:
                lse_smem[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[split, bi, pl.ds(row0, ROWS)])
            for j in range(half // OUT_CHUNK):
                plgpu.wait_smem_to_gmem(0)  # the previous piece has been read out
                o_smem[...] = out[:, j * OUT_CHUNK:(j + 1) * OUT_CHUNK].astype(write_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, out_gmem.at[split, bi, pl.ds(row0, ROWS), pl.ds(w * half + j * OUT_CHUNK, OUT_CHUNK)])
            plgpu.wait_smem_to_gmem(0)
            if w == 0:
                plgpu.barrier_arrive(o_free)

        pl.when(wg == 0)(lambda: compute(0))
        pl.when(wg == 1)(lambda: compute(1))

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(registers[1], action="decrease")
            plgpu.copy_gmem_to_smem(q_gmem.at[bi, pl.ds(row0, ROWS)], q_buffer.at[0], q_ready)

            @pl.loop(lo, hi)
            def _fetch(i):
                slot = lax.rem(i - lo, jnp.int32(stages))
                key0 = i * block_k
                start = pt_gmem[bi, lax.div(key0, jnp.int32(page_size))] * page_size + lax.rem(key0, jnp.int32(page_size))

                @pl.when(i - lo >= stages)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                plgpu.copy_gmem_to_smem(lat_gmem.at[pl.ds(start, block_k)], kv_smem.at[slot], kv_ready.at[slot],
                                        collective_axes="ctile" if clustered else None)

            @pl.loop(jnp.maximum(hi - stages, lo), hi)
            def _drain(i):
                plgpu.barrier_wait(kv_free.at[lax.rem(i - lo, jnp.int32(stages))])

    def entry(q_gmem, lat_gmem, pt_gmem, len_gmem, words_gmem, union_gmem, out_gmem, lse_gmem):
        ring = plgpu.SMEM((stages, block_k, c), dtype, transforms=_smem_transforms(c, dtype))
        # Each warpgroup's fp16 copy of its value channels (FP8 caches only).
        # (Two buffers: a wgmma operand indexed by the static warpgroup number did not lower.)
        wide = tuple(plgpu.SMEM((block_k, half), pv_dtype, transforms=_smem_transforms(half, pv_dtype))
                     for _ in range(2)) if fp8 else None
        lse_stage = plgpu.SMEM((ROWS,), jnp.float32)
        # The query tile, under a leading axis of 1 (`loop_descriptors` indexes it at a zero the
        # compiler cannot see through).
        q_buffer = plgpu.SMEM((1, ROWS, c), dtype, transforms=_smem_transforms(c, dtype))
        if exchanges:
            # The ring (and widened values) and the output staging have disjoint lifetimes.
            out_stage = plgpu.SMEM((2, ROWS, half), write_dtype, transforms=_smem_transforms(half, write_dtype))
            ring_and_out = plgpu.RefUnion((ring, wide), (out_stage, lse_stage))
            # Each warpgroup's half of P's columns.
            # (8, 16) tiles: a warp's P store and load touch eight rows of 16 bytes, 32 bytes apart,
            # so no bank sees two of them.
            # Seesaw: rows 0, 1 carry each warpgroup's step maxima, rows 2, 3 the final row sums.
            exchange = (None if p_in_ring else plgpu.SMEM((ROWS, block_k), pv_dtype,
                                                          transforms=_smem_transforms(16, pv_dtype)),
                        plgpu.SMEM((4 if seesaw else 2, ROWS), jnp.float32))
            buffers = (q_buffer, ring_and_out, exchange)
            # Seesaw: one P hand-over barrier per direction, each arrived by one warpgroup.
            syncs = (plgpu.Barrier(num_arrivals=2),
                     plgpu.Barrier(num_arrivals=1, num_barriers=2) if seesaw else plgpu.Barrier(num_arrivals=2))
        else:
            buffers = (q_buffer, ring, wide,
                       plgpu.SMEM((ROWS, OUT_CHUNK), write_dtype, transforms=_smem_transforms(OUT_CHUNK, write_dtype)),
                       lse_stage)
            syncs = (plgpu.Barrier(), plgpu.Barrier(num_arrivals=2))

        def run(bufs, bars):
            if exchanges:
                q_buffer, ((kv_smem, wide_smem), stage), exch = bufs
                bufs = (q_buffer, kv_smem, wide_smem, exch, stage)
            body(q_gmem, lat_gmem, pt_gmem, len_gmem, words_gmem, union_gmem, out_gmem, lse_gmem, (bufs, bars))

        # Under a cluster a ring slot is refilled (in every CTA of it) once every CTA's two compute
        # warpgroups have released it; a release arrives in all of them.
        kv_free = (plgpu.ClusterBarrier(collective_axes=("ctile",), num_arrivals=2, num_barriers=stages) if clustered
                   else plgpu.Barrier(num_arrivals=2, num_barriers=stages))
        pl.run_scoped(
            lambda bufs, bars: run(bufs, bars), buffers,
            (plgpu.Barrier(), plgpu.Barrier(num_barriers=stages), kv_free) + syncs,
            collective_axes="wg",
        )

    grid, grid_names = grid_in_order(dict(batch=b, tiles=tiles // cluster_tiles if clustered else tiles,
                                          splits=splits), tiles_adjacent)
    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((splits, b, rows_pad, kv_lora_rank), write_dtype),
                  jax.ShapeDtypeStruct((splits, b, rows_pad), jnp.float32)),
        grid=grid,
        grid_names=grid_names,
        cluster=(cluster_tiles,) if clustered else (),
        cluster_names=("ctile",) if clustered else (),
        num_threads=3,
        thread_name="wg",
        # The row reductions of WGMMA-layout arrays stay inside a warp: no cross-warp scratch (its
        # default 2 KiB does not fit beside the split-score buffers at L + Dr = 576).
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(qf, latent_pool, page_table.astype(jnp.int32), prefix_len.astype(jnp.int32), words, union)
    if splits > 1:
        out, lse = merge_splits(out, lse, out_dtype=out_dtype, backend="interpret" if interpret else None)
    else:
        out, lse = out[0], lse[0]
    return (out[:, :rows].reshape(b, r, hq, kv_lora_rank), lse[:, :rows].reshape(b, r, hq))


__all__ = ["MlaMgpuConfig", "default_config", "mla_decode_mgpu", "check_mla_mgpu_inputs", "mla_mgpu_input_errors"]
