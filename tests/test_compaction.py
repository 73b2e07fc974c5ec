"""compact_window_rows over several cache groups (CPU, Pallas interpret mode).

Two groups with different page sizes and page tables: a GQA group whose layers alias buffers
(layer 2 reuses layer 1's K/V, as cross-layer KV sharing does) and an MLA group of latent buffers
(value = a view of the key row). Every pool starts as random bytes (NaN/inf patterns included) and
the result is compared byte for byte with an independent numpy walk of each request's window, so a
slot moved that should not be, a buffer moved twice (path [0, 2, 3] moved twice gives row 1 <- row 3),
or a group addressed through the wrong page table all change some byte.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespec_jax.cache.pools import (BufferSpec, CacheGroupSpec, LayerKV, allocate_pools, check_pools,
                                      disjoint_page_table)
from treespec_jax.cache.routing import CompactionRouter, compact_window_rows

B, N = 3, 8
LORA, ROPE = 16, 8


def random_bytes_buffer(rng, shape, dtype) -> jax.Array:
    """Random bit patterns of a 1- or 2-byte dtype (NaN/inf included), never zeros."""
    item = jnp.dtype(dtype).itemsize
    raw = jnp.asarray(rng.integers(1, 256, size=tuple(shape) + (item,), dtype=np.uint8))
    return jax.lax.bitcast_convert_type(raw[..., 0] if item == 1 else raw, dtype)


def as_bytes(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def random_path(rng, n: int, kind: str) -> np.ndarray:
    """Accepted path: path[0] = 0, strictly increasing, -1 padded; "chain" starts 0, 2, 3, ..."""
    length = int(rng.integers(3, n))
    if kind == "chain":
        picks = np.arange(2, length + 1)
    else:
        picks = np.sort(rng.choice(np.arange(1, n), size=length - 1, replace=False))
    return np.concatenate([[0], picks, -np.ones(n - length, np.int64)]).astype(np.int32)


def make_groups(dtype: str) -> tuple[CacheGroupSpec, CacheGroupSpec]:
    gqa = CacheGroupSpec(
        name="target", page_size=16, num_pages=12,
        buffers=(BufferSpec("k0", (2, 8), dtype), BufferSpec("v0", (2, 8), dtype),
                 BufferSpec("k1", (2, 8), dtype), BufferSpec("v1", (2, 8), dtype)),
        layers=(LayerKV(0, "k0", "v0"), LayerKV(1, "k1", "v1"), LayerKV(2, "k1", "v1")))
    mla = CacheGroupSpec(
        name="latent", page_size=32, num_pages=6,
        buffers=(BufferSpec("c0", (LORA + ROPE,), dtype), BufferSpec("c1", (LORA + ROPE,), dtype)),
        layers=(LayerKV(0, "c0", None, kv_lora_rank=LORA), LayerKV(1, "c1", None, kv_lora_rank=LORA)))
    return gqa, mla


def numpy_compaction(pool: np.ndarray, table: np.ndarray, start: np.ndarray, path: np.ndarray, page: int):
    """Per request: row d of the window <- row path[d] of the original window (gather, then scatter)."""
    out = pool.copy()
    for b in range(path.shape[0]):
        def slot(pos):
            return table[b, pos // page] * page + pos % page
        for d in range(path.shape[1]):
            if path[b, d] >= 0 and path[b, d] != d:
                out[slot(start[b] + d)] = pool[slot(start[b] + path[b, d])]
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_compact_window_rows_moves_every_buffer(dtype, backend):
    rng = np.random.default_rng(11 if dtype == "bfloat16" else 12)
    groups = make_groups(dtype)
    router = CompactionRouter(groups)
    assert router.buffer_table("target") == ("k0", "v0", "k1", "v1")  # layer 2's aliases listed once
    assert router.buffer_table("latent") == ("c0", "c1")  # the value view is not a second buffer
    pools = {name: random_bytes_buffer(rng, arr.shape, arr.dtype) for name, arr in allocate_pools(groups).items()}
    tables = {"target": disjoint_page_table(1, B, 4, 12), "latent": disjoint_page_table(2, B, 2, 6)}
    # The window straddles a page boundary in both groups; each group has its own window start.
    starts = {"target": np.array([12, 3, 40], np.int32), "latent": np.array([28, 5, 50], np.int32)}
    path = np.stack([random_path(rng, N, "chain"), random_path(rng, N, "random"),
                     random_path(rng, N, "random")])
    before = {k: as_bytes(v) for k, v in pools.items()}

    fn = jax.jit(lambda p, t, s, pa: compact_window_rows(router, p, t, s, pa, backend=backend),
                 donate_argnums=0)
    out = fn(pools, {k: jnp.asarray(v) for k, v in tables.items()},
             {k: jnp.asarray(v) for k, v in starts.items()}, jnp.asarray(path))
    check_pools(groups, out)
    for g in groups:
        for name in (b.name for b in g.buffers):
            expect = numpy_compaction(before[name], tables[g.name], starts[g.name], path, g.page_size)
            np.testing.assert_array_equal(as_bytes(out[name]), expect, err_msg=f"buffer {name}")
            assert not np.array_equal(expect, before[name]), name  # something moved: the test can fail

    # The MLA value view (leading kv_lora_rank channels) of window row d is row path[d]'s value.
    lat_before = before["c0"]
    lat_after = as_bytes(out["c0"])
    page = groups[1].page_size
    item = jnp.dtype(dtype).itemsize
    for b in range(B):
        for d in range(N):
            if path[b, d] > d:
                pos_d, pos_p = starts["latent"][b] + d, starts["latent"][b] + path[b, d]
                dst = tables["latent"][b, pos_d // page] * page + pos_d % page
                src = tables["latent"][b, pos_p // page] * page + pos_p % page
                np.testing.assert_array_equal(lat_after[dst, :LORA * item], lat_before[src, :LORA * item])


def test_compaction_shared_window_start_and_donation(backend):
    """One window start for every group; the jitted step aliases every pool (updated in place)."""
    rng = np.random.default_rng(5)
    groups = make_groups("bfloat16")
    router = CompactionRouter(groups)
    pools = {name: random_bytes_buffer(rng, arr.shape, arr.dtype) for name, arr in allocate_pools(groups).items()}
    tables = {"target": jnp.asarray(disjoint_page_table(3, B, 4, 12)),
              "latent": jnp.asarray(disjoint_page_table(4, B, 2, 6))}
    start = np.array([0, 17, 30], np.int32)
    path = np.stack([random_path(rng, N, "random") for _ in range(B)])
    before = {k: as_bytes(v) for k, v in pools.items()}
    fn = jax.jit(lambda p, t, s, pa: compact_window_rows(router, p, t, s, pa, backend=backend),
                 donate_argnums=0)
    hlo = fn.lower(pools, tables, jnp.asarray(start), jnp.asarray(path)).compile().as_text()
    aliased = re.search(r"input_output_alias=\{([^}]*\}[^}]*)*\}", hlo).group(0)
    assert aliased.count("may-alias") + aliased.count("must-alias") == len(pools), aliased
    out = fn(pools, tables, jnp.asarray(start), jnp.asarray(path))
    for g in groups:
        for name in (b.name for b in g.buffers):
            expect = numpy_compaction(before[name], np.asarray(tables[g.name]), start, path, g.page_size)
            np.testing.assert_array_equal(as_bytes(out[name]), expect, err_msg=name)


def test_cache_group_config_errors():
    with pytest.raises(ValueError, match="page_size 24"):
        CacheGroupSpec("g", 24, 4, (BufferSpec("k", (1, 8)),), (LayerKV(0, "k", "k"),))
    with pytest.raises(ValueError, match="unknown buffer 'v'"):
        CacheGroupSpec("g", 16, 4, (BufferSpec("k", (1, 8)),), (LayerKV(0, "k", "v"),))
    with pytest.raises(ValueError, match="float8_e5m2"):
        BufferSpec("k", (8,), "float8_e5m2")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        LayerKV(0, "c", None)
    shared = BufferSpec("k", (1, 8))
    a = CacheGroupSpec("a", 16, 4, (shared,), (LayerKV(0, "k", "k"),))
    b = CacheGroupSpec("b", 32, 4, (shared,), (LayerKV(1, "k", "k"),))
    with pytest.raises(ValueError, match="buffer 'k' belongs to groups 'a' and 'b'"):
        CompactionRouter([a, b])
    router = CompactionRouter([a])
    pools = allocate_pools([a], fill=1.0)
    with pytest.raises(ValueError, match="no page table for cache group 'a'"):
        router.compact(pools, {}, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="pool 'k' is float32"):
        router.compact({"k": jnp.ones((64, 1, 8), jnp.float32)}, {"a": jnp.zeros((2, 4), jnp.int32)},
                       jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4), jnp.int32))
