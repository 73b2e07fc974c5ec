"""Tensor parallelism on CPU host devices (conftest sets 8): the engine over a "tp" mesh.

- TP = 2 and 4 emit the tokens of TP = 1 for tree, chain and plain decoding under greedy and
  keyed Gumbel sampling (temperature 0.8, top-p 0.9), through the dense attention backend, and
  once through the cascade kernels in interpret mode under shard_map;
- one agreed path: with the devices' copies of the logits differing by one ulp, a per-device walk
  disagrees across devices while the engine's walk (`ShardedRound.walk_stage`) and `agree` give
  every device the same path;
- the compiled forward really runs sharded: two all-reduces per layer, no weight or pool gathered,
  each device holding its slice of the parameters and pools;
- refusals name the values, among the engine's other blockers.

Speculation is lossless, so TP = 1 plain decoding is the reference for every mode.
"""

import dataclasses
import re

import jax
import jax.experimental.pallas.fuser  # noqa: F401  registers its config option before any trace (see below)
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from engine_fixtures import engine_programs_lowered
from treespec_jax import parallel
from treespec_jax.config import (BackendsConfig, ConfigError, KVCacheConfig, ModelConfig, ParallelConfig,
                                 SamplingConfig, SchedulerConfig, ServeConfig, SpeculativeConfig)
from treespec_jax.drafter.eagle3 import Eagle3Drafter, MtpDrafter, init_eagle3_params
from treespec_jax.drafter.oracle import ModelDrafter
from treespec_jax.engine import Engine, Request
from treespec_jax.engine.loading import attention_for
from treespec_jax.models.config import Eagle3Config, LlamaConfig
from treespec_jax.models.llama import LlamaModel, init_params
from treespec_jax.tree.masks import chain_parents
from treespec_jax.tree.spec import TreeSpec
from treespec_jax.tree.verify import greedy_walk

# Importing the Pallas fuser above matters for time only: it registers a config option that
# otherwise appears during the first step's trace, changing the trace context, so the step
# compiled again on its second call.

PAGE = 16
VOCAB = 64
GUMBEL = dict(sampler="gumbel", temperature=0.8, top_p=0.9)
MODES = {"plain": ("NONE", 1, 3, None), "chain": ("EAGLE3", 1, 3, None), "tree": ("EAGLE3", 2, 3, 6)}


def tiny_cfg(layers=1, heads=8, kv_heads=4) -> LlamaConfig:
    """GQA (8 query heads over 4 KV heads) so TP = 4 leaves one KV head and two query heads per device."""
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=16, rope_theta=1e4, max_position_embeddings=256)


CFG = tiny_cfg()
PARAMS = init_params(CFG, jax.random.key(0), scale=2.0)  # sharp: greedy paths repeat, trees accept


def serve_config(mode="plain", tp=1, *, sampler="greedy", temperature=0.0, top_p=1.0, attention="dense",
                 kernel="reference") -> ServeConfig:
    """`kernel="reference"`: the dense cases compact with jnp row moves (cheap to compile here);
    the cascade case runs every kernel interpreted."""
    alg, k, s, n = MODES[mode]
    spec = SpeculativeConfig() if alg == "NONE" else SpeculativeConfig(algorithm=alg, topk=k, num_steps=s,
                                                                       num_draft_tokens=n)
    return ServeConfig(
        model=ModelConfig(dtype="fp32"), speculative=spec,
        kv_cache=KVCacheConfig(page_size=PAGE, max_total_tokens=512),
        scheduler=SchedulerConfig(max_running_requests=2, chunked_prefill_size=16),
        sampling=SamplingConfig(backend=sampler, temperature=temperature, top_p=top_p),
        backends=BackendsConfig(attention_backend=attention, kernel_backend=kernel),
        parallel=ParallelConfig(tp_size=tp))


def engine(config: ServeConfig, cfg=CFG, params=PARAMS) -> Engine:
    drafter = None
    if config.speculative.enabled:
        # The noisy oracle: the target's own weights plus seeded logit noise, so trees branch.
        drafter = ModelDrafter(LlamaModel(cfg, attention_for(config)), noise=1.0, noise_seed=1)
    return Engine(config, cfg, params, drafter, params if drafter else None)


def requests():
    """Two prompts, one longer than a prefill chunk, sharing the two slots."""
    rng = np.random.default_rng(0)
    return [Request(prompt=rng.integers(0, VOCAB, size=n).tolist(), max_new_tokens=m, seed=100 + i)
            for i, (n, m) in enumerate([(5, 7), (20, 5)])]


def tokens(eng: Engine):
    outs = eng.decode(requests())
    assert all(o.finish_reason == "length" for o in outs), [(o.finish_reason, o.error) for o in outs]
    return [o.tokens for o in outs]


_REFERENCE = {}


def reference(sampler: str):
    """TP = 1 plain decoding's tokens under `sampler`."""
    if sampler not in _REFERENCE:
        kw = GUMBEL if sampler == "gumbel" else {}
        _REFERENCE[sampler] = tokens(engine(serve_config("plain", 1, **kw)))
    return _REFERENCE[sampler]


# ---- layout -----------------------------------------------------------------------------------

def test_param_specs_are_megatron_layout():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=8,
                      num_kv_heads=4, head_dim=16, rope_theta=1e4, max_position_embeddings=256,
                      attention_bias=True, qk_norm=True)
    params = init_params(cfg, jax.random.key(1))
    specs = parallel.param_specs(params, 4)
    layer = specs["layers_0"]
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):
        assert layer[name] == P(None, "tp"), name
    for name in ("wo", "w_down"):
        assert layer[name] == P("tp", None), name
    for name in ("bq", "bk", "bv"):
        assert layer[name] == P("tp"), name
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        assert layer[name] == P(), name
    assert specs["embed"] == P("tp", None) and specs["lm_head"] == P(None, "tp") and specs["norm"] == P()
    # A width T does not divide stays replicated, the MLP's three matrices together.
    odd = parallel.param_specs({"layers_0": {"w_gate": np.zeros((32, 6)), "w_up": np.zeros((32, 6)),
                                             "w_down": np.zeros((6, 32))}, "embed": np.zeros((66, 32))}, 4)
    assert odd == {"layers_0": {"w_gate": P(), "w_up": P(), "w_down": P()}, "embed": P()}
    # Head alignment: device t's columns of wq / wk are exactly query heads [2t, 2t+2) and KV head t.
    mesh = parallel.make_mesh(4)
    placed = jax.device_put(params, parallel.param_shardings(cfg, params, mesh))
    for shard in placed["layers_0"]["wk"].addressable_shards:
        t = list(mesh.devices.flat).index(shard.device)
        np.testing.assert_array_equal(shard.data, params["layers_0"]["wk"][:, t * 16:(t + 1) * 16])
        assert placed["layers_0"]["wq"].addressable_shards[0].data.shape == (32, 2 * 16)


def test_eagle3_and_mtp_heads_are_placed_and_rebound():
    """The heads' params by the same names (EAGLE-3's `fc` and d2t replicated, its draft LM head by
    vocabulary) and `with_attention` reaching every flax module a drafter holds."""
    target = tiny_cfg(layers=4)
    head_cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_heads=8, num_kv_heads=4, head_dim=16,
                            vocab_size=VOCAB, draft_vocab_size=32, target_hidden_size=32)
    specs = parallel.param_specs(init_eagle3_params(head_cfg, jax.random.key(0)), 2)
    assert specs["layer"]["wq"] == P(None, "tp") and specs["layer"]["wo"] == P("tp", None)
    assert specs["fc"] == P() and specs["d2t"] == P() and specs["lm_head"] == P(None, "tp")
    mesh = parallel.make_mesh(2)
    base = attention_for(serve_config())
    sharded = dataclasses.replace(base, mesh=mesh)
    for drafter in (Eagle3Drafter(head_cfg, target, base), MtpDrafter(target, base),
                    ModelDrafter(LlamaModel(target, base))):
        placed = parallel.with_attention(drafter, sharded)
        modules = [v for v in vars(placed).values() if hasattr(v, "attention")]
        assert modules and all(m.attention == sharded for m in modules), type(drafter).__name__
        assert all(m.attention == base for m in vars(drafter).values() if hasattr(m, "attention"))
    assert not parallel.tp_problems(4, target, Eagle3Drafter(head_cfg, target, base))
    assert "drafter's num_kv_heads=4" in " ".join(parallel.tp_problems(8, target, MtpDrafter(target, base)))


def test_refusals_name_the_values_with_the_other_blockers():
    bad_cfg = tiny_cfg(heads=6, kv_heads=3)
    params = init_params(bad_cfg, jax.random.key(0))
    drafter_cfg = tiny_cfg(heads=4, kv_heads=2)
    drafter = ModelDrafter(LlamaModel(drafter_cfg, attention_for(serve_config("tree", 4))))
    config = serve_config("tree", 4, temperature=0.7)  # also: the greedy backend with temperature 0.7
    with pytest.raises(ConfigError) as err:
        Engine(config, bad_cfg, params, drafter, init_params(drafter_cfg, jax.random.key(0)))
    text = str(err.value)
    assert "tp_size=4 does not divide the target's num_kv_heads=3" in text
    assert "tp_size=4 does not divide the target's num_heads=6" in text
    assert "tp_size=4 does not divide the drafter's num_kv_heads=2" in text
    assert "temperature" in text  # every blocker in one error
    with pytest.raises(ConfigError, match=r"tp_size=16 exceeds the 8 devices"):
        engine(serve_config("plain", 16))
    with pytest.raises(ConfigError, match=r"tp_size=2 exceeds the 1 devices"):
        Engine(serve_config("plain", 2), CFG, PARAMS, devices=jax.devices()[:1])


# ---- one agreed path --------------------------------------------------------------------------

def _diverging_replicas(x: np.ndarray, other: np.ndarray, mesh) -> jax.Array:
    """A "replicated" array whose device 1 holds `other`: what a last-bit difference between the
    devices' copies (reduction order, a nondeterministic collective) leaves behind."""
    devs = list(mesh.devices.flat)
    bufs = [jax.device_put(other if i == 1 else x, d) for i, d in enumerate(devs)]
    return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, P()), bufs)


def _per_device(a: jax.Array) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]


def _tie_logits(b=2, n=4):
    """Chain trees whose drafted tokens follow token 3; at node 1, tokens 3 and 5 tie exactly
    (argmax takes 3: the path goes deeper); the perturbed copy adds one ulp to token 5."""
    logits = np.zeros((b, n, VOCAB), np.float32)
    logits[:, :, 3] = 1.0
    logits[:, 1, 5] = 1.0
    bumped = logits.copy()
    bumped[:, 1, 5] = np.nextafter(np.float32(1.0), np.float32(2.0))
    tree_tokens = np.full((b, n), 3, np.int32)
    return logits, bumped, tree_tokens


def test_walk_agrees_when_one_device_logits_differ_by_one_ulp():
    mesh = parallel.make_mesh(2)
    logits, bumped, tree_tokens = _tie_logits()
    parents = np.asarray(chain_parents(2, 4))

    # Under shard_map: device 1 sees the bumped logits. Its own walk stops a node earlier; the
    # owner broadcast hands every device device 0's path.
    def body(lg, tok, par):
        mine = jnp.where(jax.lax.axis_index("tp") == 1, jnp.asarray(bumped), lg)
        naive = greedy_walk(tok, par, jnp.argmax(mine, -1).astype(jnp.int32))
        agreed = jax.tree.map(parallel._owner_broadcast, naive)
        return jax.tree.map(lambda x: x[None], (naive, agreed))

    naive, agreed = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("tp"), check_vma=False))(
        logits, tree_tokens, parents)
    assert not np.array_equal(naive.accept_len[0], naive.accept_len[1])  # the naive walk diverges
    np.testing.assert_array_equal(naive.accept_len[0], [4, 4])
    np.testing.assert_array_equal(naive.accept_len[1], [2, 2])
    for leaf in jax.tree.leaves(agreed):
        np.testing.assert_array_equal(leaf[0], leaf[1])
    np.testing.assert_array_equal(agreed.path[1], naive.path[0])

    # The engine's walk stage, greedy and gumbel, on a replicated array whose copies differ.
    cfg_state = engine(serve_config("plain", 2)).state
    diverged = _diverging_replicas(logits, bumped, mesh)
    spec = TreeSpec.from_parents(jnp.asarray(parents))
    state = cfg_state.replace(tree_tokens=jnp.asarray(tree_tokens), tree_parents=jnp.asarray(parents),
                              lengths=jnp.array([7, 9], jnp.int32), seeds=jnp.array([1, 2], jnp.int32),
                              active=jnp.ones((2,), bool))
    naive_greedy = jax.jit(lambda lg: greedy_walk(state.tree_tokens, spec.parents,
                                                  jnp.argmax(lg, -1).astype(jnp.int32)))(diverged)
    copies = _per_device(naive_greedy.accept_len)
    assert not np.array_equal(copies[0], copies[1])  # each device walked its own copy
    for backend in ("greedy", "gumbel"):
        sharded = engine(serve_config("plain", 2, **(GUMBEL if backend == "gumbel" else {}))).round
        if backend == "gumbel":
            # Large disagreement: device 1's copy is other logits entirely.
            other = np.asarray(jax.random.normal(jax.random.key(3), logits.shape), np.float32) * 4
            diverged = _diverging_replicas(logits * 4, other, mesh)
            state = state.replace(sampling=state.sampling.replace(temperature=jnp.full((2,), 0.8),
                                                                  top_p=jnp.full((2,), 0.9)))
        path = jax.jit(lambda lg, st: sharded.walk_stage(spec, lg, st))(diverged, state)
        for leaf in jax.tree.leaves(path):
            first, second = _per_device(leaf)
            np.testing.assert_array_equal(first, second, err_msg=backend)


def test_sharded_argmax_matches_argmax_with_ties():
    mesh = parallel.make_mesh(4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, size=(3, 5, VOCAB)).astype(np.float32)  # many ties, across shards too
    got = jax.jit(lambda a: parallel.sharded_argmax(a, mesh))(
        jax.device_put(x, NamedSharding(mesh, P(None, None, "tp"))))
    np.testing.assert_array_equal(got, np.argmax(x, -1))


# ---- the compiled program runs sharded ----------------------------------------------------------

def _collectives(hlo: str, op: str) -> list[tuple[str, int]]:
    """(result type, elements) of every `op` (sync or async start) in compiled HLO text."""
    out = []
    for line in hlo.splitlines():
        m = re.match(rf"\s*(?:ROOT )?%\S+ = (.+?) {op}(?:-start)?\(", line)
        if m:
            dims = [int(d) for shape in re.findall(r"\[([\d,]*)\]", m.group(1)) for d in shape.split(",") if d]
            out.append((m.group(1), int(np.prod(dims)) if dims else 1))
    return out


def test_forward_compiles_sharded():
    """The plain greedy step of a 2-layer target at TP = 2: each device holds its slice of weights
    and pools; the compiled step all-reduces once for the vocabulary-sharded embedding lookup and
    twice per layer (attention out, MLP out), and gathers only the per-shard argmax candidates
    and the agreed path, never a weight, a pool or the logits."""
    cfg = tiny_cfg(layers=2)
    eng = Engine(serve_config("plain", 2), cfg, init_params(cfg, jax.random.key(0)))
    layer = eng.params["target"]["layers_0"]  # served fused: whole KV-head groups / gate, up pairs a shard
    assert layer["w_gate_up"].addressable_shards[0].data.shape == (32, 64)
    assert layer["wqkv"].addressable_shards[0].data.shape == (32, (cfg.q_width + 2 * cfg.kv_width) // 2)
    assert eng.params["target"]["lm_head"].addressable_shards[0].data.shape == (32, VOCAB // 2)
    pool = eng.state.target_pools["k0"]
    assert pool.sharding.spec == P(None, "tp", None)
    assert pool.addressable_shards[0].data.shape == (pool.shape[0], 2, 16)
    hlo = eng._step.lower(eng.params, eng.state).compile().as_text()
    reduces = _collectives(hlo, "all-reduce")
    assert len(reduces) == 1 + 2 * cfg.num_layers, reduces
    assert all(n == 2 * cfg.hidden_size for _, n in reduces), reduces  # [B=2, 1, H] activations
    gathers = _collectives(hlo, "all-gather")
    assert gathers and all(n <= 2 * 2 for _, n in gathers), gathers  # [T=2, B=2, 1]: candidates, path
    assert not _collectives(hlo, "all-to-all") and not _collectives(hlo, "collective-permute")


# ---- the engine: TP = 2, 4 emit TP = 1's tokens -------------------------------------------------

CASES = [(tp, mode, sampler) for sampler in ("greedy", "gumbel") for tp in (2, 4) for mode in ("tree", "chain", "plain")]
# Every engine costs its step's compilation (seconds on CPU), so the default tier takes each TP,
# mode and sampler at least once (TP = 2 tree greedy through the cascade kernels, below); the
# sweep tier runs the whole cross product.
DEFAULT = {(4, "tree", "gumbel"), (4, "chain", "greedy"), (2, "plain", "gumbel")}


@pytest.mark.parametrize(
    "tp,mode,sampler",
    [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.sweep) for c in CASES],
    ids=[f"tp{t}-{m}-{s}" for t, m, s in CASES])
def test_tp_emits_tp1_tokens(tp, mode, sampler):
    """Compiled ahead (`Engine.compile`): serving then lowers nothing again, the sharded prefill's
    outputs included."""
    kw = GUMBEL if sampler == "gumbel" else {}
    eng = engine(serve_config(mode, tp, **kw))
    eng.compile(requests())
    with engine_programs_lowered() as again:
        out = tokens(eng)
    assert not again, f"lowered again while serving: {again}"
    assert out == reference(sampler)
    if mode == "tree":
        assert 1.0 < eng.last_run.mean_accept_length  # drafts are accepted: the trees are verified


def test_tp_cascade_kernels_under_shard_map():
    """The cascade kernels (interpret mode) on each device's local heads, tree decoding at TP = 2."""
    eng = engine(serve_config("tree", 2, attention="cascade", kernel="interpret"))
    assert tokens(eng) == reference("greedy")
