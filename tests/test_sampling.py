"""Keyed Gumbel-max sampling: determinism by (seed, position), masks, and the sampled distribution."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import P_MIN, chi_square_p

from treespec_jax.sampling import keyed
from treespec_jax.sampling.keyed import SamplingParams, sample_at


def np_filtered_probs(logits, temperature, top_k, top_p):
    """Independent numpy statement of the mask rules: softmax of logits/T over the survivors."""
    v = logits.shape[-1]
    scaled = logits.astype(np.float64) / temperature
    order = sorted(range(v), key=lambda i: (-scaled[i], i))
    k = v if top_k <= 0 or top_k >= v else top_k
    survivors = order[:k]
    p = np.exp(scaled[survivors] - scaled[survivors].max())
    p /= p.sum()
    kept, mass = [], 0.0
    for tok, pt in zip(survivors, p):
        if kept and mass >= top_p:
            break
        kept.append(tok)
        mass += pt
    out = np.zeros(v)
    w = np.exp(scaled[kept] - scaled[kept].max())
    out[kept] = w / w.sum()
    return out


def draw_many(logits_row, seed, n_draws, temperature, top_k=0, top_p=1.0):
    """`n_draws` keyed draws of one row at positions 0..n_draws-1, vectorised."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n_draws, logits_row.shape[-1]))
    params = SamplingParams.create(np.full(n_draws, temperature), np.full(n_draws, top_k), np.full(n_draws, top_p))
    return np.asarray(jax.jit(sample_at)(logits, jnp.full((n_draws,), seed), jnp.arange(n_draws), params))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.7)])
def test_distribution_matches_masked_softmax(temperature, top_k, top_p):
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    logits = rng.normal(0, 1.5, 8).astype(np.float32)
    draws = draw_many(logits, seed=1234, n_draws=100_000, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = np_filtered_probs(logits, temperature, top_k, top_p)
    p = chi_square_p(np.bincount(draws, minlength=8), probs)
    assert p > P_MIN, (p, probs)


def test_filter_logits_matches_numpy_rules_with_ties():
    # Integer-valued logits make exact ties at the top-k boundary; the lower id must survive.
    rng = np.random.default_rng(0)
    for trial in range(20):
        v = 12
        logits = rng.integers(-3, 3, v).astype(np.float32)
        top_k = int(rng.integers(0, v + 2))
        top_p = float(rng.choice([1.0, 0.9, 0.5, 0.2]))
        got = np.isfinite(np.asarray(keyed.filter_logits(jnp.asarray(logits), top_k, top_p)))
        want = np_filtered_probs(logits, 1.0, top_k, top_p) > 0
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}: k={top_k} p={top_p} {logits}")
        if 0 < top_k < v:
            assert got.sum() <= top_k
    # top_p = 1 and top_k = 0 keep every token, even where a float32 cumsum reaches 1 early.
    steep = jnp.asarray(np.r_[[30.0, 30.0], np.full(62, -30.0)].astype(np.float32))
    assert np.isfinite(np.asarray(keyed.filter_logits(steep, 0, 1.0))).all()


class KeyedDrawTest(chex.TestCase):

    @chex.variants(with_jit=True)
    def test_draw_depends_only_on_seed_position_and_logits(self):
        # A [B, N, V] batch draw equals row-by-row single draws (plain decoding of one token).
        b, n, v = 2, 3, 16
        rng = np.random.default_rng(1)
        logits = rng.normal(0, 2, (b, n, v)).astype(np.float32)
        seeds = np.array([11, 22], np.int32)
        positions = rng.integers(0, 10_000, (b, n)).astype(np.int32)
        params = SamplingParams.create([0.8, 1.2], [0, 6], [0.9, 1.0])
        fn = self.variant(sample_at)
        batch = np.asarray(fn(jnp.asarray(logits), jnp.asarray(seeds), jnp.asarray(positions), params))
        for i in range(b):
            one = SamplingParams.create(params.temperature[i:i + 1], params.top_k[i:i + 1], params.top_p[i:i + 1])
            for j in range(n):
                single = fn(jnp.asarray(logits[i, j][None]), jnp.asarray(seeds[i:i + 1]),
                            jnp.asarray(positions[i, j][None]), one)
                assert int(single[0]) == batch[i, j]
        # A different position (or seed) is a different draw somewhere.
        moved = np.asarray(fn(jnp.asarray(logits), jnp.asarray(seeds), jnp.asarray(positions + 1), params))
        assert (moved != batch).any()

    @chex.variants(with_jit=True, without_jit=True)
    def test_greedy_is_argmax_ties_to_lowest_id(self):
        logits = np.array([[0.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [-5.0, -4.0, -9.0, -4.0]], np.float32)
        params = SamplingParams.greedy(3)
        got = self.variant(sample_at)(jnp.asarray(logits), jnp.arange(3), jnp.array([4, 5, 6]), params)
        np.testing.assert_array_equal(np.asarray(got), [1, 0, 1])


def test_gumbel_noise_is_the_keyed_uniform():
    # The noise for (seed, position) is -log(-log u) with u from fold_in(key(seed), position).
    g = np.asarray(keyed.gumbel_noise(jnp.int32(7), jnp.int32(42), 5))
    u = np.asarray(jax.random.uniform(jax.random.fold_in(jax.random.key(7), 42), (5,), jnp.float32,
                                      minval=np.finfo(np.float32).tiny, maxval=1.0))
    np.testing.assert_allclose(g, -np.log(-np.log(u)), rtol=1e-6)
    assert np.isfinite(g).all()


def test_params_validation_names_bad_values():
    with pytest.raises(ValueError, match=r"temperature.*-0\.5"):
        SamplingParams.create([1.0, -0.5])
    with pytest.raises(ValueError, match=r"top_k.*-3"):
        SamplingParams.create([1.0], [-3])
    with pytest.raises(ValueError, match=r"top_p.*1\.5"):
        SamplingParams.create([1.0], [0], [1.5])
    with pytest.raises(ValueError, match=r"top_p.*0\.0"):
        SamplingParams.create([1.0], [0], [0.0])
    with pytest.raises(ValueError, match="one shape"):
        SamplingParams.create([1.0, 1.0], [0], [1.0, 1.0])
    params = SamplingParams.create([1.0, 1.0])
    with pytest.raises(ValueError, match="positions"):
        sample_at(jnp.zeros((2, 3, 4)), jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), params)
    with pytest.raises(ValueError, match="seeds"):
        sample_at(jnp.zeros((2, 3, 4)), jnp.zeros((3,), jnp.int32), jnp.zeros((2, 3), jnp.int32), params)


def test_target_probs_is_the_distribution_sample_at_draws_from():
    """Rejection sampling verifies against `target_probs`; it must apply the same masks."""
    rng = np.random.default_rng(5)
    settings = [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (0.9, 7, 0.8), (0.0, 3, 0.5)]
    logits = rng.standard_normal((len(settings), 24)).astype(np.float32) * 2
    t, k, p = (np.array(c) for c in zip(*settings))
    got = np.asarray(keyed.target_probs(jnp.asarray(logits), SamplingParams.create(t, k, p)))
    for row, (temp, top_k, top_p) in enumerate(settings):
        if temp == 0:
            want = np.eye(24)[np.argmax(logits[row])]
        else:
            want = np_filtered_probs(logits[row], temp, top_k, top_p)
        np.testing.assert_allclose(got[row], want, atol=1e-5)


def test_host_known_draws_equal_the_device_branch():
    """`draw_for` names the least computation that is exact for the rows, and `sample_at` with it
    draws what the device-side branch ("auto") draws; a draw too weak for a row is visibly wrong."""
    rng = np.random.default_rng(7)
    rows, vocab = 12, 40
    logits = jnp.asarray(rng.normal(0, 2.0, (rows, vocab)), jnp.float32)
    seeds, positions = jnp.arange(rows, dtype=jnp.int32) + 5, jnp.arange(rows, dtype=jnp.int32) * 3
    greedy = np.zeros(rows)
    mixed = np.where(np.arange(rows) % 2, 0.9, 0.0)
    cases = {"argmax": (greedy, np.zeros(rows, int), np.ones(rows)),
             "gumbel": (mixed, np.zeros(rows, int), np.ones(rows)),
             "filtered": (mixed, np.where(np.arange(rows) % 4 == 1, 3, 0), np.where(np.arange(rows) % 4 == 3, 0.5, 1.0))}
    draw = jax.jit(sample_at, static_argnames=("draw",))
    for name, (t, k, p) in cases.items():
        assert keyed.draw_for(t, k, p, vocab) == name
        params = SamplingParams.create(t, k, p)
        auto = np.asarray(draw(logits, seeds, positions, params))
        np.testing.assert_array_equal(np.asarray(draw(logits, seeds, positions, params, draw=name)), auto, err_msg=name)
        assert (auto[t == 0] == np.argmax(np.asarray(logits), -1)[t == 0]).all()
    # Too weak a draw: "argmax" for sampled rows and "gumbel" for masked rows change tokens.
    t, k, p = cases["filtered"]
    params = SamplingParams.create(t, k, p)
    auto = np.asarray(draw(logits, seeds, positions, params))
    assert (np.asarray(draw(logits, seeds, positions, params, draw="argmax")) != auto).any()
    assert (np.asarray(draw(logits, seeds, positions, params, draw="gumbel")) != auto).any()
    with pytest.raises(ValueError, match="draw must be one of"):
        sample_at(logits, seeds, positions, params, draw="fast")
