"""Prefill attention (`models.attention.prefill_attention`, blocks of pages with an online
softmax) against one dense fp32 masked attention over every page of the table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import poisoned_paged_pools

from treespec_jax.models.attention import (prefill_attention, prefill_attention_reference, prefill_batch,
                                           prefill_key_blocks)


@pytest.mark.parametrize("page,key_block,group", [(4, 8, 3), (8, 8, 1), (4, 3, 2)])
def test_prefill_attention_matches_dense_attention(page, key_block, group):
    """Requests mid-prompt (a committed prefix in the pool), a short last chunk, and a padding
    request (valid = 0 at start 0, which sees no key and must come out zero, not NaN). Every slot
    past a request's last chunk position holds NaN / inf, as does every page nobody owns."""
    rng = np.random.default_rng(page * 10 + key_block + group)
    chunk, hkv, d = 8, 2, 16
    start = np.array([13, 0, 40, 0], np.int32)
    valid = np.array([8, 5, 3, 0], np.int32)
    max_len = 64
    last = start + np.maximum(valid, 1) - 1
    k, v, table = poisoned_paged_pools(rng, len(start), max_len, hkv, d, page, jnp.float32,
                                       lambda b, pos: pos <= last[b] and valid[b] > 0)
    batch = prefill_batch(table, jnp.asarray(start), jnp.asarray(valid), chunk, page)
    q = jnp.asarray(rng.standard_normal((len(start), chunk, hkv * group, d)), jnp.float32)
    out = jax.jit(prefill_attention, static_argnums=(4, 5, 6))(q, k, v, batch, page, d ** -0.5, key_block)
    ref = prefill_attention_reference(q, k, v, batch, page, d ** -0.5)
    live = valid > 0
    assert rel_err(out[live], ref[live]) < 1e-5
    # The padding request: rows that see nothing attend to nothing.
    np.testing.assert_array_equal(np.asarray(out[~live]), 0.0)


def test_prefill_reads_through_the_block_of_its_last_position_only():
    """The loop's trip count covers the largest position and stops there: a short prompt in a wide
    table reads one block, however long the context."""
    page, key_block = 4, 8
    for last in (0, 7, 8, 15, 16, 100):
        positions = jnp.asarray([[0, last], [3, 1]], jnp.int32)
        assert int(prefill_key_blocks(positions, page, key_block)) == last // 8 + 1, last
    # A block holds whole pages, at least one.
    assert int(prefill_key_blocks(jnp.asarray([[9]]), 4, 3)) == 9 // 4 + 1
    assert int(prefill_key_blocks(jnp.asarray([[-1]]), 4, 8)) == 1


def test_rows_that_write_nowhere_leave_every_slot_alone():
    """Prefill padding rows and empty batch slots (an all-scratch table row) are dropped by the
    K/V scatter, not piled onto the scratch page: the request's real rows land in its own slots,
    and every other slot, the scratch page's included, keeps what it held."""
    from treespec_jax.models.attention import NO_SLOT, SCRATCH_PAGE, window_batch, write_kv

    rng = np.random.default_rng(7)
    page, chunk, hkv, d, pages = 4, 8, 2, 16, 6
    table = jnp.asarray(np.array([[3, 5, 0, 0], [0, 0, 0, 0]], np.int32))  # row 1: an empty slot
    start, valid = jnp.array([2, 0], jnp.int32), jnp.array([5, 0], jnp.int32)
    before = jnp.asarray(rng.standard_normal((pages * page, hkv, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, chunk, hkv, d)), jnp.float32) for _ in range(2))
    batch = prefill_batch(table, start, valid, chunk, page)
    k_pool, _ = write_kv(before, before, k, v, batch.write_slots)
    want = np.asarray(before).copy()
    for t in range(5):  # request 0 at positions 2..6: pages 3 and 5
        pos = 2 + t
        want[[3, 5][pos // page] * page + pos % page] = np.asarray(k[0, t])
    np.testing.assert_array_equal(np.asarray(k_pool), want)
    assert (np.asarray(batch.write_slots)[0, 5:] == NO_SLOT).all() and (np.asarray(batch.write_slots)[1] == NO_SLOT).all()
    # A window forward of the empty slot writes nowhere either.
    window = window_batch(table, jnp.array([0, 3], jnp.int32), jnp.array([[0], [3]], jnp.int32),
                          jnp.ones((2, 1, 2), jnp.uint32), page)
    assert int(window.write_slots[1, 0]) == NO_SLOT and int(window.write_slots[0, 0]) != SCRATCH_PAGE * page
