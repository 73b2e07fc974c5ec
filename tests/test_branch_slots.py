"""branch_slot_plan: every slot read finds its parent's state, spills only when slots run out."""

import numpy as np
import pytest

from pallas_kernels.linear.branch_slots import branch_points, branch_slot_plan, check_num_slots
from tests.trees import random_parents


def simulate(parents, save, load, spill):
    """Walk one request's nodes like a kernel: slots hold node ids; check every read."""
    t = len(parents)
    slots = {}
    branch = {int(p) for c, p in enumerate(parents) if p >= 0 and p != c - 1}
    for node in range(t):
        p = int(parents[node])
        if p >= 0 and p != node - 1:
            if load[node] >= 0:
                assert slots.get(int(load[node])) == p, (node, p, load[node], slots)
            else:
                assert spill[p], f"node {node} reads parent {p} that is neither in a slot nor spilled"
        else:
            assert load[node] == -1
        if save[node] >= 0:
            assert node in branch
            slots[int(save[node])] = node
        assert bool(spill[node]) == (node in branch and save[node] < 0)


def max_alive(parents):
    """Most branch points alive at once (alive from s through its last non-next child)."""
    t = len(parents)
    last = {}
    for c, p in enumerate(parents):
        if p >= 0 and p != c - 1:
            last[int(p)] = max(last.get(int(p), -1), c)
    best = 0
    for node in range(t):
        # alive during node's save: started at or before node, last reader after node
        best = max(best, sum(1 for s, e in last.items() if s <= node < e))
    return best


@pytest.mark.parametrize("num_slots", [0, 1, 2, 4])
@pytest.mark.parametrize("n,forest", [(1, False), (6, False), (16, True), (64, False)])
def test_plan_reads_match_a_simulated_walk(num_slots, n, forest):
    rng = np.random.default_rng(100 * n + num_slots)
    parents = random_parents(rng, 5, n, forest=forest)
    parents[0, :] = np.arange(-1, n - 1)  # a chain: no branch points, nothing saved or loaded
    if n >= 16:
        # A DFS-numbered binary tree: branch points nest like a stack.
        parents[1, :] = -1
        stack, nxt = [(0, 0)], 1
        while nxt < n and stack:
            node, depth = stack.pop()
            for _ in range(2):
                if nxt < n:
                    parents[1, nxt] = node
                    stack.append((nxt, depth + 1))
                    nxt += 1
    plan = branch_slot_plan(parents, num_slots)
    save, load, spill = (np.asarray(x) for x in plan)
    assert save.shape == load.shape == spill.shape == parents.shape
    np.testing.assert_array_equal(spill | (save >= 0), np.asarray(branch_points(parents)))
    for b in range(parents.shape[0]):
        simulate(parents[b], save[b], load[b], spill[b])
        if max_alive(parents[b]) <= num_slots:
            assert not spill[b].any(), f"request {b} spilled with {num_slots} slots"
        if num_slots == 0:
            assert (save[b] == -1).all()
    assert not (save[0] >= 0).any() and not spill[0].any()


def test_bad_slot_count_is_refused():
    for bad in (-1, 5, 1.5):
        with pytest.raises(ValueError, match="branch slots"):
            check_num_slots(bad)
