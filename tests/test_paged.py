"""Paged addressing: slot_of, and the page-table coverage check the kernels rely on."""

import jax.numpy as jnp
import numpy as np
import pytest

from treespec_jax.cache.paged import check_page_table, page_table_errors, slot_of


def test_slot_of_follows_the_table():
    table = jnp.asarray([[3, 1], [0, 2]], jnp.int32)
    pos = jnp.asarray([[0, 5, 9], [7, 8, 15]], jnp.int32)
    np.testing.assert_array_equal(slot_of(table, pos, 8), [[24, 29, 9], [7, 16, 23]])


def test_page_table_coverage():
    rng = np.random.default_rng(0)
    table = rng.permutation(40)[:24].reshape(4, 6).astype(np.int32)  # 6 pages of 16 each
    lengths = np.asarray([10, 0, 70, 33], np.int32)
    args = dict(extra=16, page_size=16, num_pages=40)
    assert not np.asarray(page_table_errors(jnp.asarray(table), jnp.asarray(lengths), **args)).any()
    check_page_table(table, lengths, **args)
    table[0, 1] = -1  # request 0 needs pages 0..1 for 10 + 16 positions
    table[2, 5] = 40  # request 2 needs pages 0..5: page id past the pool
    table[3, 4] = -7  # request 3 needs pages 0..3 only: column 4 is not read, no error
    lengths[1] = 90  # request 1 needs 7 pages, the table has 6
    got = np.asarray(page_table_errors(jnp.asarray(table), jnp.asarray(lengths), **args))
    np.testing.assert_array_equal(got, [True, True, True, False])
    with pytest.raises(ValueError) as err:
        check_page_table(table, lengths, **args)
    msg = str(err.value)
    assert "request 0" in msg and "(1, -1)" in msg
    assert "request 1: needs 7 pages" in msg
    assert "request 2" in msg and "(5, 40)" in msg
    assert "request 3" not in msg
