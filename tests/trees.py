"""Random draft-tree shapes shared by the tests."""

import numpy as np


def random_parents(rng, batch, n, forest=False):
    """`[batch, n] int32` trees: parents[0] = -1, parents[j] uniform in [0, j) (many branch points).

    With `forest`, parents[j] may also be -1, giving extra roots.
    """
    par = np.full((batch, n), -1, np.int32)
    for b in range(batch):
        for j in range(1, n):
            par[b, j] = rng.integers(-1 if forest else 0, j)
    return par
