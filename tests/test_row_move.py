"""Row-move kernel (Pallas, interpret mode on CPU) against the reference and a numpy walk.

Buffers are filled with random bytes (NaN and inf bit patterns included), so comparisons are on
raw bytes: a kernel that touches a slot it should not, or moves a row twice, changes some byte.
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.row_move import MAX_PAIRS_PER_GROUP, RowMoveConfig, move_rows, move_rows_reference, pack_path_rows


def random_bytes_buffer(rng, shape, dtype) -> jax.Array:
    """Random bit patterns of `dtype` (for floats: NaN/inf included), never zeros."""
    item = jnp.dtype(dtype).itemsize
    raw = rng.integers(1, 256, size=tuple(shape) + (item,), dtype=np.uint8)
    arr = jnp.asarray(raw)
    if item == 1:
        return jax.lax.bitcast_convert_type(arr[..., 0], dtype)
    return jax.lax.bitcast_convert_type(arr, dtype)


def as_bytes(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def random_path(rng, n: int, kind: str) -> np.ndarray:
    """Accepted path over n window rows: path[0] = 0, strictly increasing, -1 padded."""
    if kind == "noop":  # root only
        return np.array([0] + [-1] * (n - 1), np.int32)
    if kind == "identity":  # a chain tree accepts rows in place
        return np.arange(n, dtype=np.int32)
    length = int(rng.integers(2, n + 1))
    picks = np.sort(rng.choice(np.arange(1, n), size=length - 1, replace=False))
    if kind == "chain":  # path = [0, 2, 3, ...]: row 1 <- row 2 while row 2 <- row 3
        picks = np.arange(2, 2 + length - 1) if length + 1 <= n else picks
    return np.concatenate([[0], picks, -np.ones(n - length, np.int64)]).astype(np.int32)


def numpy_moves(buf: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Independent model: gather every live source from the original, then scatter."""
    out = buf.copy()
    for s, d in zip(src.reshape(-1), dst.reshape(-1)):
        if s >= 0 and s != d:
            out[d] = buf[s]
    return out


def window_pairs(rng, batch, n, slots, kinds):
    """Per-request windows in disjoint slot ranges; pairs (src, dst) `[B, N]` from random paths."""
    bases = rng.permutation(slots // n)[:batch] * n
    src = np.full((batch, n), -1, np.int32)
    dst = np.zeros((batch, n), np.int32)
    for b in range(batch):
        path = random_path(rng, n, kinds[b % len(kinds)])
        dst[b] = bases[b] + np.arange(n)
        src[b] = np.where(path >= 0, bases[b] + path, -1)
    return src, dst


@pytest.mark.parametrize("dtype,row_shape", [
    (jnp.bfloat16, (2, 8)),        # 32-byte rows -> uint32 words
    (jnp.float8_e4m3fn, (36,)),    # 36-byte rows -> uint32 words from 4 FP8 each
    (jnp.float32, (5,)),           # odd word count: masked tail
    (jnp.int32, (3, 4)),
    (jnp.bfloat16, (3,)),          # 6-byte rows -> uint16 words
    (jnp.int8, (7,)),              # 7-byte rows -> uint8 words
])
def test_move_rows_matches_reference_and_numpy(dtype, row_shape, backend):
    # A seed fixed across processes (Python's str hash is salted per process, which made the
    # paths, and whether any row moves, change from run to run).
    rng = np.random.default_rng(zlib.crc32(f"{jnp.dtype(dtype).name}{row_shape}".encode()))
    n, batch, slots = 8, 5, 96
    buf = random_bytes_buffer(rng, (slots,) + row_shape, dtype)
    src, dst = window_pairs(rng, batch, n, slots, ["random", "chain", "noop", "identity"])
    out = jax.jit(lambda b, s, d: move_rows(b, s, d, backend=backend))(buf, src, dst)
    ref = move_rows_reference(buf, jnp.asarray(src), jnp.asarray(dst))
    expect = numpy_moves(as_bytes(buf), src, dst)
    assert out.dtype == buf.dtype and out.shape == buf.shape
    np.testing.assert_array_equal(as_bytes(ref), expect)
    np.testing.assert_array_equal(as_bytes(out), expect)
    # The test can fail: the random paths move some row.
    assert not np.array_equal(expect, as_bytes(buf))


def test_move_rows_multi_tile_rows_and_flat_pairs(backend):
    """Rows longer than one column tile (several programs per group, masked tail); [M] pairs."""
    rng = np.random.default_rng(7)
    buf = random_bytes_buffer(rng, (40, 37), jnp.float32)  # 37 words, tiles of 16 -> 3 tiles
    path = np.array([0, 2, 3, 4, 7, -1, -1, -1], np.int32)
    dst = 16 + np.arange(8, dtype=np.int32)
    src = np.where(path >= 0, 16 + path, -1).astype(np.int32)
    cfg = RowMoveConfig(max_block_words=16)
    out = move_rows(buf, jnp.asarray(src), jnp.asarray(dst), backend=backend, config=cfg)
    np.testing.assert_array_equal(as_bytes(out), numpy_moves(as_bytes(buf), src, dst))


def test_move_rows_is_donated_in_place():
    """Under jit with the buffer donated, the pool aliases the output (no second pool)."""
    buf = jnp.ones((64, 8), jnp.bfloat16)
    pairs = jnp.zeros((2, 4), jnp.int32)
    fn = jax.jit(lambda b, s, d: move_rows(b, s, d, backend="interpret"), donate_argnums=0)
    hlo = fn.lower(buf, pairs, pairs).compile().as_text()
    assert re.search(r"input_output_alias=\{ \{\}: \(0, \{\}", hlo), hlo[:400]


def test_move_rows_lowers_to_triton_for_sm90(monkeypatch):
    """The compiled path lowers Pallas -> Triton IR (no GPU needed; PTX compile is the GPU suite's)."""
    import jax._src.pallas.triton.pallas_call_registration as reg
    import pallas_kernels.common as common

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    for dtype, row in ((jnp.bfloat16, (8, 128)), (jnp.float8_e4m3fn, (576,))):
        buf = jax.ShapeDtypeStruct((4096,) + row, dtype)
        pairs = jax.ShapeDtypeStruct((32, 16), jnp.int32)
        text = jax.jit(lambda b, s, d: move_rows(b, s, d), donate_argnums=0).trace(buf, pairs, pairs).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "tf.aliasing_output = 0" in text


def test_move_rows_rejects_bad_input():
    buf = jnp.ones((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="one shape"):
        move_rows(buf, jnp.zeros((3,), jnp.int32), jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        move_rows(buf, jnp.zeros((3,), jnp.float32), jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="bool"):
        move_rows(jnp.ones((8, 4), bool), jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        RowMoveConfig(max_block_words=48)


def test_move_rows_refuses_more_pairs_per_group_than_a_window():
    """The kernel unrolls a group's pairs; a flat [B*T] list (once minutes of GPU compile at B=32,
    T=64) is refused by name, while the same moves as [B, T] groups run."""
    buf = jnp.zeros((4096, 4), jnp.float32)
    flat = jnp.zeros((MAX_PAIRS_PER_GROUP + 1,), jnp.int32)
    with pytest.raises(ValueError, match=f"at most {MAX_PAIRS_PER_GROUP} pairs per group, got {MAX_PAIRS_PER_GROUP + 1}"):
        move_rows(buf, flat, flat)
    with pytest.raises(ValueError, match="pairs per group, got 65"):
        move_rows(buf, jnp.zeros((3, 65), jnp.int32), jnp.zeros((3, 65), jnp.int32))


def test_pack_path_rows_groups_requests_at_a_full_window(backend):
    """B=5 requests of T=64 rows (B*T = 320 pairs in all, 64 per request): accepted rows land at the
    front of their own request, the rest of every request is bitwise unchanged."""
    rng = np.random.default_rng(11)
    b, t = 5, 64
    buf = random_bytes_buffer(rng, (b * t, 6), jnp.bfloat16).reshape(b, t, 6)
    path = np.full((b, t), -1, np.int32)
    accept = rng.integers(0, t + 1, size=b).astype(np.int32)
    for i in range(b):
        path[i, : accept[i]] = np.sort(rng.choice(t, size=accept[i], replace=False))
    out = np.asarray(as_bytes(pack_path_rows(buf, jnp.asarray(path), jnp.asarray(accept), backend=backend)
                              .reshape(b * t, 6))).reshape(b, t, -1)
    before = np.asarray(as_bytes(buf.reshape(b * t, 6))).reshape(b, t, -1)
    for i in range(b):
        np.testing.assert_array_equal(out[i, : accept[i]], before[i, path[i, : accept[i]]])
        np.testing.assert_array_equal(out[i, accept[i]:], before[i, accept[i]:])
    with pytest.raises(ValueError, match="path must be"):
        pack_path_rows(buf, jnp.asarray(path[:, :10]), jnp.asarray(accept))


def test_default_config_rule():
    """`default_config()`: 1024-word tiles at 4 warps for every buffer; move_rows(config=None) runs it."""
    from pallas_kernels.row_move import default_config
    assert default_config() == RowMoveConfig(max_block_words=1024, num_warps=4)
