"""The engine end to end on tiny random fp32 models: lossless speculation, batching, refusals.

Tree decoding (several K, S, N including N = 64), chain decoding and plain decoding must emit
identical tokens under greedy and keyed Gumbel sampling, over prompts of different lengths with
requests joining and finishing mid-batch, through the dense fp32 reference attention and through
the Pallas kernels in interpret mode. The drafter is the target itself with seeded logit noise
(the noisy oracle: trees branch and acceptance is partial) or without (the oracle: deep paths).
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from test_tokenizer import ckpt_dir  # noqa: F401  (the tiny byte-level tokenizer's directory)

from engine_fixtures import (ENGINE_PROGRAMS, PAGE, cached_engine, dense_forward, engine_programs_lowered,
                             mixed_requests, oracle_engine, serve_config, tiny_config, tiny_target, with_cuda_graphs)
from treespec_jax.config import ConfigError
from treespec_jax.engine import Engine, Request
from treespec_jax.engine import engine as engine_module
from treespec_jax.engine.loading import attention_for, attention_kind
from treespec_jax.engine.scheduler import pool_pages
from treespec_jax.models.llama import LlamaModel, fuse_projections, init_params, kv_buffer_names


def _tokens(engine, requests):
    outs = engine.decode(requests)
    assert all(o.finish_reason == "length" for o in outs), [(o.finish_reason, o.error) for o in outs]
    return [o.tokens for o in outs]


@pytest.fixture(scope="module")
def plain_greedy():
    return _tokens(cached_engine(serve_config()), mixed_requests())


GREEDY_SHAPES = [
    ("chain", 1, 4, None, 0.0),  # K = 1: the chain, N = S + 1
    ("tree", 2, 3, 6, 1.0),
    ("tree-oracle", 4, 5, 16, 0.0),
    ("tree-n64", 8, 9, 64, 1.0),
]


@pytest.mark.parametrize("name,k,s,n,noise", GREEDY_SHAPES, ids=[g[0] for g in GREEDY_SHAPES])
def test_speculation_is_lossless_greedy(plain_greedy, name, k, s, n, noise):
    engine = cached_engine(serve_config("EAGLE3", k, s, n, slots=2), noise=noise)
    assert _tokens(engine, mixed_requests()) == plain_greedy
    run = engine.last_run
    if noise == 0.0:
        # The oracle's best child is the target's argmax, so the accepted path is always the
        # tree's best path (every accepted node a rank-0 child); a chain accepts its whole depth
        # in every round but a request's first, which verifies the bootstrap chain of dummies.
        assert run.acceptance_by_rank[0] == 1.0
        if k == 1:
            assert run.histogram[s + 1] >= run.rounds - len(mixed_requests())
        assert run.mean_accept_length > 2.5
    else:
        assert 1.0 < run.mean_accept_length < s + 1  # partial acceptance: the trees really branch
    if k > 1 and noise > 0:
        assert sum(run.acceptance_by_rank[1:]) > 0  # some accepted nodes were not the best child


def test_speculation_is_lossless_gumbel():
    """Keyed Gumbel-max at temperature 0.8, top-p 0.9: same seed, same tokens."""
    cfg = dict(sampler="gumbel", temperature=0.8, top_p=0.9, slots=3)
    reqs = mixed_requests()
    plain = _tokens(cached_engine(serve_config(**cfg)), reqs)
    assert _tokens(cached_engine(serve_config("EAGLE3", 1, 3, None, **cfg), noise=0.5), reqs) == plain
    tree = cached_engine(serve_config("EAGLE3", 4, 4, 20, **cfg), noise=0.5)
    assert _tokens(tree, reqs) == plain
    assert tree.last_run.mean_accept_length > 1.2
    # A different seed gives a different sample (the test can fail).
    other = [dataclasses.replace(r, seed=r.seed + 7) for r in reqs]
    assert _tokens(cached_engine(serve_config(**cfg)), other) != plain


def with_chain_above(config, batch: int):
    return config.replace(speculative=dataclasses.replace(config.speculative, chain_above_batch=batch))


@pytest.mark.parametrize("sampler,temperature", [("greedy", 0.0), ("gumbel", 0.8)])
def test_rounds_switch_to_a_chain_under_load(sampler, temperature):
    """`speculative.chain_above_batch = 1`: while two or three requests run, a round verifies a
    chain of S + 1 nodes (the first nodes of the stored tree, a subtree); a request left alone
    verifies trees again (a drafted chain padded with dummies first). Switching either way keeps
    the tokens of plain decoding."""
    cfg = dict(sampler=sampler, temperature=temperature, slots=3)
    reqs = mixed_requests()
    plain = _tokens(cached_engine(serve_config(**cfg)), reqs)
    engine = oracle_engine(with_chain_above(serve_config("EAGLE3", 2, 3, 6, **cfg), 1), noise=0.5)
    assert _tokens(engine, reqs) == plain
    run = engine.last_run
    assert 0 < run.chain_steps < run.steps, (run.chain_steps, run.steps)  # both kinds of round ran
    assert 1.0 < run.mean_accept_length


def test_kernel_path_matches_reference(plain_greedy):
    """The cascade kernels (interpret mode) and the compaction kernel, tree and plain."""
    reqs = mixed_requests()[:3]
    kernel = dict(attention="cascade", kernel="interpret")
    plain = _tokens(cached_engine(serve_config(**kernel, slots=2)), reqs)
    assert plain == plain_greedy[:3]
    tree = cached_engine(serve_config("EAGLE3", 4, 3, 10, **kernel, slots=2), noise=1.0)
    assert _tokens(tree, reqs) == plain_greedy[:3]


def test_dense_attention_off_gpu_moves_rows_with_xla(plain_greedy):
    """Dense attention off a GPU compacts with XLA's row move, not the interpreted Pallas kernel
    (seconds a round on a CPU), and the rounds are unchanged: a tree (rows really move) emits the
    interpreted kernel's tokens with the same acceptance histogram."""
    from pallas_kernels.common import on_gpu

    reqs = mixed_requests()[:3]
    fast = cached_engine(serve_config("EAGLE3", 4, 3, 10, slots=2), noise=1.0)
    assert fast.round.move_backend == (None if on_gpu() else "reference")
    slow = cached_engine(serve_config("EAGLE3", 4, 3, 10, kernel="interpret", slots=2), noise=1.0)
    assert slow.round.move_backend == "interpret"
    fast_tokens = _tokens(fast, reqs)
    fast_hist = list(fast.last_run.histogram)
    assert _tokens(slow, reqs) == fast_tokens == plain_greedy[:3]
    assert list(slow.last_run.histogram) == fast_hist
    assert fast.last_run.mean_accept_length > 1.0  # paths past the root: compaction moved rows


def test_fp8_kv_tree_equals_chain():
    reqs = mixed_requests()[:3]
    chain = _tokens(cached_engine(serve_config("EAGLE3", 1, 3, None, kv="fp8_e4m3")), reqs)
    tree = _tokens(cached_engine(serve_config("EAGLE3", 4, 3, 10, kv="fp8_e4m3"), noise=1.0), reqs)
    assert tree == chain


@pytest.mark.parametrize("choice,kernel,gpu,kind", [
    ("auto", "pallas", False, "dense"), ("auto", "pallas", True, "cascade"),
    ("auto", "interpret", False, "cascade"), ("auto", "reference", False, "cascade"),
    ("cascade", "pallas", False, "cascade"), ("dense", "pallas", True, "dense")])
def test_auto_attention_takes_the_kernels_where_they_compile(monkeypatch, choice, kernel, gpu, kind):
    """"auto" runs the cascade kernels on a GPU and XLA's dense attention elsewhere (where the
    kernels would run interpreted), unless an interpret / reference kernel path is asked for."""
    import pallas_kernels.common

    monkeypatch.setattr(pallas_kernels.common, "on_gpu", lambda: gpu)
    config = serve_config(attention=choice, kernel=kernel)
    assert attention_kind(config) == kind
    assert attention_for(config).kind == kind


# The kernel path is the same code for every family, so one family covers it.
# Fused: the model reads `fuse_projections` of the params (as the engine serves them), the
# reference the separate weights, so a wrong column grouping (q heads against the wrong KV head, a
# gate column against another's up) or a lost bias cannot pass.
@pytest.mark.parametrize("family,kind,fused", [("llama", "dense", False), ("qwen2", "dense", False),
                                               ("qwen3", "dense", False), ("llama", "dense", True),
                                               ("qwen2", "dense", True), ("qwen3", "dense", True),
                                               ("llama", "cascade", True)])
def test_prefill_then_decode_equals_full_forward(family, kind, fused):
    """Chunked prefill (chunk 8 over 21 tokens) then 3 decode steps give the logits of one causal
    forward over the same tokens; the pools start poisoned with NaN."""
    cfg, reference_params = tiny_target(family)
    params = fuse_projections(reference_params, cfg) if fused else reference_params
    att = attention_for(serve_config(attention=kind, kernel="interpret"))
    model = LlamaModel(cfg, att)
    slots = 8 * PAGE
    pools = {n: jnp.full((slots, cfg.num_kv_heads, cfg.head_dim), jnp.nan) for kv in kv_buffer_names(cfg.num_layers)
             for n in kv}
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, 24)
    table = jnp.array([[5, 2, 7, 0]], jnp.int32)
    got = []
    for start in range(0, 21, 8):
        piece = tokens[start:min(start + 8, 21)]
        chunk = np.zeros((1, 8), np.int32)
        chunk[0, :len(piece)] = piece
        logits, _, pools = model.prefill(params, pools, jnp.asarray(chunk), table, jnp.array([start]),
                                         jnp.array([len(piece)]))
    got.append(logits[0, 0])
    for pos in range(21, 24):
        logits, _, pools = model.decode(params, pools, jnp.asarray(tokens[pos:pos + 1]), table, jnp.array([pos]))
        got.append(logits[0, 0])
    want = dense_forward(cfg, reference_params, tokens)[20:24]
    assert rel_err(np.stack(got), want) < 1e-5


def test_engine_serves_the_fused_layout():
    """The engine's target params are the fused layout: no separate q/k/v or gate/up weight is left
    to read, and the fused ones hold exactly the given weights' columns."""
    cfg, params = tiny_target("qwen2")
    engine = Engine(serve_config(), cfg, params)
    rep, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        got, given = engine.params["target"][f"layers_{i}"], params[f"layers_{i}"]
        assert not {"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"} & set(got)
        qkv = np.asarray(got["wqkv"]).reshape(cfg.hidden_size, cfg.num_kv_heads, rep + 2, d)
        np.testing.assert_array_equal(qkv[:, :, :rep].reshape(cfg.hidden_size, -1), np.asarray(given["wq"]))
        np.testing.assert_array_equal(qkv[:, :, rep].reshape(cfg.hidden_size, -1), np.asarray(given["wk"]))
        np.testing.assert_array_equal(qkv[:, :, rep + 1].reshape(cfg.hidden_size, -1), np.asarray(given["wv"]))
        np.testing.assert_array_equal(np.asarray(got["bqkv"]).reshape(cfg.num_kv_heads, rep + 2, d)[:, rep],
                                      np.asarray(given["bk"]).reshape(cfg.num_kv_heads, d))
        np.testing.assert_array_equal(np.asarray(got["w_gate_up"])[:, 1::2], np.asarray(given["w_up"]))
        assert got["w_down"] is given["w_down"]


def test_requests_never_touch_other_pages():
    """Every free page starts as NaN: outputs equal a clean run's, and pages no request owned keep
    their poison (page 0, the scratch page, takes the writes of padding and empty slots)."""
    reqs = mixed_requests()
    clean = _tokens(cached_engine(serve_config("EAGLE3", 4, 3, 10, slots=2)), reqs)
    engine = oracle_engine(serve_config("EAGLE3", 4, 3, 10, slots=2, total_tokens=64 * PAGE))
    engine.state = engine.state.replace(
        target_pools={k: jnp.full_like(v, jnp.nan) for k, v in engine.state.target_pools.items()},
        draft_pools={k: jnp.full_like(v, jnp.nan) for k, v in engine.state.draft_pools.items()})
    assert _tokens(engine, reqs) == clean
    # The allocator hands out low pages first; with two slots at most two requests' pages were
    # ever live, so the top pages were never owned.
    untouched = slice((engine.num_pages - 16) * PAGE, engine.num_pages * PAGE)
    for pools in (engine.state.target_pools, engine.state.draft_pools):
        for name, pool in pools.items():
            assert bool(jnp.isnan(pool[untouched].astype(jnp.float32)).all()), name
    assert engine.allocator.free_pages == engine.num_pages - 1


def test_the_step_after_a_finish_stays_in_the_finished_request():
    """The engine launches a step before reading the last, so a request that has just finished
    runs once more in its slot. One running to the context's end (limit = 512, the deepest reach
    of that extra round) beside a longer-lived request, with a queued one taking its slot next:
    every free page starts as NaN, each request's tokens equal its tokens decoded alone, no event
    of a request follows its finished one, and pages no request owned keep their poison."""
    rng = np.random.default_rng(7)
    shapes = [(430, 82), (9, 60), (12, 20)]  # 430 + 82 = 512, the model's context
    reqs = [Request(prompt=rng.integers(0, 64, n).tolist(), max_new_tokens=m, seed=i) for i, (n, m) in enumerate(shapes)]
    config = serve_config("EAGLE3", 4, 3, 10, slots=2, total_tokens=80 * PAGE)
    alone = [_tokens(cached_engine(config), [r])[0] for r in reqs]
    engine = oracle_engine(config)
    engine.state = engine.state.replace(
        target_pools={k: jnp.full_like(v, jnp.nan) for k, v in engine.state.target_pools.items()},
        draft_pools={k: jnp.full_like(v, jnp.nan) for k, v in engine.state.draft_pools.items()})
    events = list(engine.stream(reqs))
    finished = {ev.index: n for n, ev in enumerate(events) if ev.finished is not None}
    assert all(n <= finished[ev.index] for n, ev in enumerate(events))
    outs = [events[finished[i]].finished for i in range(len(reqs))]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert [o.tokens for o in outs] == alone
    owned = max(len(r.prompt) + r.max_new_tokens for r in reqs) + 3 * engine.num_nodes
    untouched = slice((2 * -(-owned // PAGE) + 1) * PAGE, engine.num_pages * PAGE)
    for pools in (engine.state.target_pools, engine.state.draft_pools):
        for name, pool in pools.items():
            assert bool(jnp.isnan(pool[untouched].astype(jnp.float32)).all()), name
    assert engine.allocator.free_pages == engine.num_pages - 1


def test_refusals_name_every_reason_and_spare_the_others():
    engine = cached_engine(serve_config("EAGLE3", 2, 3, 6))
    good = mixed_requests()[:2]
    bad = [Request(prompt=[1, 2, 3], max_new_tokens=600),  # exceeds the context (512)
           Request(prompt=[1, 2, 3], max_new_tokens=4, temperature=0.7),  # greedy backend
           Request(prompt=[], max_new_tokens=4),
           Request(prompt=[70, 2], max_new_tokens=0),
           Request(prompt=[1, 2, 3], max_new_tokens=4, temperature=-1.0),  # invalid under any backend
           Request(prompt=[1, 2, 3], max_new_tokens=4, top_k=-5)]  # -1 and 0 mean off; -5 is no setting
    reqs = good[:1] + bad + good[1:]
    outs = engine.decode(reqs)
    assert [o.finish_reason for o in outs] == ["length"] + ["refused"] * 6 + ["length"]
    assert "exceeds the context length 512" in outs[1].error
    assert "greedy" in outs[2].error
    assert "empty" in outs[3].error
    assert "outside [0, 64)" in outs[4].error and "max_new_tokens=0" in outs[4].error
    assert outs[5].error == "temperature=-1.0 must be finite and >= 0"
    assert outs[6].error == "top_k=-5 must be -1 or 0 (off) or >= 1"
    assert engine.refusal(dataclasses.replace(bad[-1], top_k=-1)) is None
    # The public check answers as the serving loop does, without serving anything.
    assert [engine.refusal(r) for r in reqs] == [o.error for o in outs]
    alone = _tokens(cached_engine(serve_config("EAGLE3", 2, 3, 6)), good)
    assert [outs[0].tokens, outs[7].tokens] == alone


def test_startup_refusal_lists_every_blocker():
    cfg, params = tiny_target()
    bad_cfg = dataclasses.replace(cfg, head_dim=12, num_heads=4)
    config = serve_config("EAGLE3", 4, 5, 16, attention="cascade")
    config = config.replace(parallel=dataclasses.replace(config.parallel, tp_size=3),
                            sampling=dataclasses.replace(config.sampling, temperature=0.5))
    with pytest.raises(ConfigError) as err:
        Engine(config, bad_cfg, params, None, None)
    text = str(err.value)
    for needle in ("head_dim 12", "needs a drafter", "tp_size=3", "temperature 0"):
        assert needle in text, (needle, text)


def test_pool_pages_rule():
    """Explicit tokens win; otherwise every slot's full context, cut to what the memory fraction
    holds after the weights, and refused with the numbers below one full-context request."""
    rule = functools.partial(pool_pages, slots=4, table_width=10, page_size=16, page_bytes=1000,
                             mem_fraction=0.5, weight_bytes=2000)
    assert rule(max_total_tokens=100, device_bytes=10 ** 9) == (8, [])  # 7 pages of 16 + scratch
    assert rule(max_total_tokens=None, device_bytes=None) == (41, [])  # no memory reported: full
    assert rule(max_total_tokens=None, device_bytes=10 ** 9) == (41, [])  # room for all of it
    assert rule(max_total_tokens=None, device_bytes=2 * (2000 + 26 * 1000)) == (26, [])  # 25 pages + scratch
    pages, problems = rule(max_total_tokens=None, device_bytes=2 * (2000 + 10 * 1000))
    assert len(problems) == 1 and "9 pages of 16 tokens" in problems[0] and "needs 10" in problems[0]
    # A CPU: the host budget alone, the weights and the fraction aside; too small, refused by name.
    assert rule(max_total_tokens=None, device_bytes=None, host_kv_bytes=26 * 1000) == (26, [])
    assert rule(max_total_tokens=None, device_bytes=None, host_kv_bytes=10 ** 9) == (41, [])
    pages, problems = rule(max_total_tokens=None, device_bytes=None, host_kv_bytes=2 ** 30 // 10 ** 5)
    assert len(problems) == 1 and "host_kv_gib" in problems[0] and "needs 10" in problems[0], problems


def test_pools_sized_from_the_device_memory(monkeypatch):
    """Without max_total_tokens the engine sizes its pools from `mem_fraction_static` of what the
    device reports (the CPU reports nothing: a fake report stands in) and still serves; a device
    too small for one request refuses the run naming the fraction."""
    cfg, params = tiny_target()
    config = serve_config(total_tokens=None, slots=4)
    full = Engine(config, cfg, params)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    page_bytes = PAGE * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    room = full.table_width + 4  # pages the fake device holds after the weights, the scratch page included
    monkeypatch.setattr(engine_module, "_device_bytes", lambda devices: math.ceil((weights + room * page_bytes) / 0.85))
    cut = Engine(config, cfg, params)
    assert (full.num_pages, cut.num_pages) == (4 * full.table_width + 1, room)
    reqs = mixed_requests()[:3]
    assert _tokens(cut, reqs) == _tokens(full, reqs)
    monkeypatch.setattr(engine_module, "_device_bytes", lambda devices: weights)
    with pytest.raises(ConfigError, match="mem_fraction_static = 0.85"):
        Engine(config, cfg, params)


def test_cpu_pools_cut_to_the_host_budget():
    """On a CPU (no memory reported) without max_total_tokens, the pools are every slot's full
    context cut to `kv_cache.host_kv_gib`, and the cut engine serves what the full one does."""
    cfg, params = tiny_target()
    config = serve_config(total_tokens=None, slots=4)
    full = Engine(config, cfg, params)
    page_bytes = PAGE * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    room = full.table_width + 4  # pages the budget holds, the scratch page included
    cut = Engine(config.replace(kv_cache=dataclasses.replace(config.kv_cache, host_kv_gib=room * page_bytes / 2 ** 30)),
                 cfg, params)
    assert (full.num_pages, cut.num_pages) == (4 * full.table_width + 1, room)
    reqs = mixed_requests()[:3]
    assert _tokens(cut, reqs) == _tokens(full, reqs)


def test_waiting_for_pages():
    """A pool that holds one request at a time serves all of them in turn, in order."""
    reqs = mixed_requests()[:3]
    roomy = _tokens(cached_engine(serve_config("EAGLE3", 2, 3, 6)), reqs)
    tight = cached_engine(serve_config("EAGLE3", 2, 3, 6, total_tokens=5 * PAGE))
    assert _tokens(tight, reqs) == roomy


def test_stream_yields_what_decode_returns():
    engine = cached_engine(serve_config("EAGLE3", 2, 3, 6))
    reqs = mixed_requests()[:3]
    pieces = {i: [] for i in range(3)}
    finals = {}
    for ev in engine.stream(reqs):
        pieces[ev.index] += ev.tokens
        if ev.finished is not None:
            finals[ev.index] = ev.finished.tokens
    assert all(pieces[i] == finals[i] for i in range(3))
    assert [finals[i] for i in range(3)] == _tokens(cached_engine(serve_config()), reqs)


def test_stream_reads_requests_as_slots_free():
    """A generator of requests is read one request per free slot, never ahead: the third request
    of a two-slot engine is read only once one of the first two has finished, a refused one is
    answered when read, and a generator that stops early ends the stream with what it gave."""
    engine = cached_engine(serve_config("EAGLE3", 2, 3, 6))
    reqs = mixed_requests()[:4]
    log = []

    def arriving():
        for i, r in enumerate(reqs[:3]):
            log.append(("read", i))
            yield r
        log.append(("read", "refused"))
        yield Request(prompt=[], max_new_tokens=4)

    finals = {}
    for ev in engine.stream(arriving()):
        if ev.finished is not None:
            log.append(("done", ev.index))
            finals[ev.index] = ev.finished
    assert log.index(("read", 2)) > min(log.index(("done", 0)), log.index(("done", 1)))
    assert log.index(("done", 3)) == log.index(("read", "refused")) + 1
    assert finals[3].finish_reason == "refused" and "empty" in finals[3].error
    assert [finals[i].tokens for i in range(3)] == _tokens(cached_engine(serve_config()), reqs[:3])
    assert engine.allocator.free_pages == engine.num_pages - 1


def test_a_served_step_holds_no_device_branch():
    """The host knows what its requests' draws need, so the step it launches has no `lax.cond`
    (on the GPU each one makes the host wait for the device mid-step)."""
    engine = cached_engine(serve_config("EAGLE3", 2, 3, 6, sampler="gumbel"))
    runs = {name: engine._read_request(0, Request(prompt=[1, 2], max_new_tokens=4, **kw)) for name, kw in
            (("argmax", dict(temperature=0.0)), ("gumbel", dict(temperature=0.8)),
             ("filtered", dict(temperature=0.8, top_p=0.9)))}
    assert {name: run.draw for name, run in runs.items()} == {n: n for n in runs}
    assert engine._draw_of([runs["argmax"], runs["filtered"], runs["gumbel"]]) == "filtered"
    assert engine._draw_of([runs["argmax"], runs["gumbel"]]) == "gumbel"
    lowered = lambda draw: engine._step.lower(engine.params, engine.state, draw=draw).as_text()  # noqa: E731
    assert "stablehlo.case" in lowered("auto")
    for draw in ("argmax", "gumbel", "filtered"):
        assert "stablehlo.case" not in lowered(draw), draw


def test_cuda_graph_settings_reach_the_compiled_step(plain_greedy, monkeypatch):
    """`backends.cuda_graphs` resolves per program, and its XLA options are the step's own: each
    setting compiles (XLA refuses an option it does not know) and changes no token, and an option
    put in its place reaches the compiler."""
    from treespec_jax.engine import compile_options
    from treespec_jax.engine.compile_options import GRAPH_OPTIONS, step_compiler_options, step_graphs

    plain, tree = serve_config(), serve_config("EAGLE3", 2, 3, 6)
    assert (step_graphs(plain), step_graphs(tree)) == ("xla", "xla")
    assert step_compiler_options(with_cuda_graphs(tree, "all")) == {"xla_gpu_graph_min_graph_size": 1}
    assert step_graphs(with_cuda_graphs(plain, "all")) == "all"
    with pytest.raises(ConfigError, match="backends.cuda_graphs = 'sometimes'"):
        with_cuda_graphs(plain, "sometimes").validate()
    reqs = mixed_requests()[:2]
    off = with_cuda_graphs(plain, "off")
    assert _tokens(oracle_engine(off), reqs) == plain_greedy[:2]
    monkeypatch.setitem(compile_options.GRAPH_OPTIONS, "off", {"xla_no_such_option": 1})
    assert GRAPH_OPTIONS["off"] == {"xla_no_such_option": 1}
    with pytest.raises(Exception, match="xla_no_such_option"):
        oracle_engine(off).decode(reqs)


def test_stats_describe_the_rounds():
    engine = cached_engine(serve_config("EAGLE3", 4, 4, 12, slots=2), noise=1.0)
    outs = engine.decode(mixed_requests())
    run = engine.last_run
    committed = sum(len(o.tokens) for o in outs)
    assert run.generated_tokens == committed
    assert run.rounds == sum(o.stats.rounds for o in outs)
    assert run.histogram.sum() == run.rounds
    by_depth = run.acceptance_by_depth
    assert all(a >= b for a, b in zip(by_depth, by_depth[1:]))  # reaching d+1 implies reaching d
    assert abs(run.mean_accept_length - (1 + sum(by_depth))) < 1e-9
    assert abs(sum(run.acceptance_by_rank) - 1.0) < 1e-9
    # S = 4 draft steps: depths 1..4 exist, however many of the N = 12 nodes a level holds.
    assert len(by_depth) == len(run.per_position_rate) == 4
    assert run.histogram[4 + 2:].sum() == 0


def test_stats_refuse_a_depth_past_the_nodes():
    from treespec_jax.engine.stats import RequestStats

    with pytest.raises(ValueError, match="max_depth must lie in \\[0, num_nodes - 1 = 5\\], got 6"):
        RequestStats(6, 6)
    assert RequestStats(6).per_position_rate == [0.0] * 5  # a chain of 6 nodes: depths 1..5


def test_requests_admitted_together_prefill_together():
    """A prefill budget of four 256-token chunks (`chunked_prefill_size=1024`) prefills up to four
    requests per batch, over prompts longer and shorter than a chunk: a group of four, then those
    that join one by one, then a group of three beside a padding row. Every greedy token is the
    argmax of one causal forward over the prompt and the tokens before it; the pools start
    poisoned; one-at-a-time prefill and tree decoding emit the same tokens."""
    cfg, params = tiny_target()
    rng = np.random.default_rng(12)
    shapes = [(300, 8), (12, 10), (270, 6), (40, 9), (5, 7), (257, 5)]
    reqs = [Request(prompt=rng.integers(0, cfg.vocab_size, size=n).tolist(), max_new_tokens=m, seed=i)
            for i, (n, m) in enumerate(shapes)]
    together = oracle_engine(serve_config(slots=4, chunk=1024))
    assert (together.chunk, together.prefill_rows) == (256, 4)
    together.state = together.state.replace(
        target_pools={k: jnp.full_like(v, jnp.nan) for k, v in together.state.target_pools.items()})
    got = _tokens(together, reqs)
    for req, tokens in zip(reqs, got):
        logits = dense_forward(cfg, params, np.asarray(req.prompt + tokens[:-1]))
        assert logits[len(req.prompt) - 1:].argmax(-1).tolist() == tokens
    assert _tokens(together, reqs[:3]) == got[:3]
    alone = oracle_engine(serve_config(slots=4, chunk=256))
    assert alone.prefill_rows == 1
    assert _tokens(alone, reqs) == got
    tree = oracle_engine(serve_config("EAGLE3", 2, 3, 6, slots=4, chunk=1024))
    assert tree.prefill_rows == 4
    assert _tokens(tree, reqs) == got


def test_admissions_wait_for_a_group_while_others_decode():
    """With `min_prefill_group = 4`, requests that wait while others decode are admitted four at
    a time (the last group takes what is left); the tokens are those of one-at-a-time admission,
    whose groups do shrink under the same churn."""
    cfg, _ = tiny_target()
    rng = np.random.default_rng(3)
    reqs = [Request(prompt=rng.integers(0, cfg.vocab_size, size=int(rng.integers(4, 40))).tolist(),
                    max_new_tokens=int(rng.integers(2, 12)), seed=i) for i in range(14)]

    def groups_and_tokens(min_group):
        config = serve_config(slots=8, chunk=1024)
        config = config.replace(scheduler=dataclasses.replace(config.scheduler, min_prefill_group=min_group))
        engine = oracle_engine(config)
        sizes, start = [], engine._start
        engine._start = lambda group, stats: (sizes.append(len(group)), start(group, stats))[1]
        return sizes, _tokens(engine, reqs)

    grouped, tokens = groups_and_tokens(4)
    assert grouped[:-1] == [4] * (len(grouped) - 1) and sum(grouped) == len(reqs), grouped
    single, alone = groups_and_tokens(1)
    assert min(single) < 4 and tokens == alone, single


def test_a_warm_engine_compiles_nothing_more():
    """Once every prefill row count and the step have run, serving more requests compiles nothing:
    admissions mid-run (a lone request prefilled as one row, then pairs) reuse the warm-up's
    programs. Run in a fresh process, where the first jitted programs are traced before any Pallas
    kernel has lowered: a lazily imported module that changes JAX's trace context (the Pallas
    fuser's flag) would make them miss the cache and compile again here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import dataclasses, jax, numpy as np\n"
        "from engine_fixtures import oracle_engine, serve_config\n"
        "from treespec_jax.engine import Request\n"
        "kw = dict(slots=4, chunk=1024, attention='cascade')\n"
        "for config in (serve_config(**kw), serve_config('EAGLE3', 2, 2, 4, **kw)):\n"
        "    engine = oracle_engine(config)\n"
        "    rng = np.random.default_rng(0)\n"
        "    reqs = [Request(prompt=rng.integers(0, 64, int(n)).tolist(), max_new_tokens=int(m), seed=i)\n"
        "            for i, (n, m) in enumerate(zip(rng.integers(3, 40, 10), rng.integers(2, 12, 10)))]\n"
        "    for rows in engine.prefill_row_counts():\n"
        "        engine.decode([dataclasses.replace(r, max_new_tokens=2) for r in reqs[:rows]])\n"
        "    engine.decode(reqs[:4])\n"
        "    compiles = []\n"
        "    jax.monitoring.register_event_duration_secs_listener(\n"
        "        lambda name, secs, **kw: compiles.append(name) if name.endswith('backend_compile_duration') else None)\n"
        "    outs = engine.decode(reqs)\n"
        "    assert all(o.finish_reason == 'length' for o in outs), [o.finish_reason for o in outs]\n"
        "    assert engine.last_run.steps > 0\n"
        "    assert not compiles, f'{len(compiles)} programs compiled after the warm-up ({config.speculative.algorithm})'\n"
    )
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": f"{tests}:{tests.parent}"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tests.parent, env=env, timeout=600)


# The tree's case runs the chain's step too (`chain_above_batch`): one case covers both steps.
@pytest.mark.parametrize("speculative", ["plain", "tree+chain"])
def test_compile_leaves_the_run_nothing_to_compile(speculative):
    """`Engine.compile(requests)` lowers every program a run of them can launch with the inputs
    the run passes: serving them then lowers none of the engine's programs again (a missed row
    count, draw, input type or the chain's step under load would), and the tokens are those of an
    engine never compiled ahead."""
    kw = dict(attention="dense", slots=4, sampler="gumbel")
    config = serve_config("EAGLE3", 4, 3, 10, **kw) if speculative != "plain" else serve_config(**kw)
    if speculative == "tree+chain":
        config = with_chain_above(config, 2)
    requests = [dataclasses.replace(r, temperature=0.8 if i % 2 else 0.0) for i, r in enumerate(mixed_requests())]
    engine = oracle_engine(config)
    reported = []
    with engine_programs_lowered() as ahead:
        engine.compile(requests, progress=lambda program, total: reported.append((program, total)))
    with engine_programs_lowered() as again:
        outs = engine.decode(requests)
    expected = set(ENGINE_PROGRAMS) - ({"jit(_draft_prefill_chunk)"} if speculative == "plain" else set())
    assert set(ahead) == expected, ahead
    assert not again, f"lowered again while serving: {again}"
    # `last_compile` names each program once, with its seconds.
    names = [p.name for p in engine.last_compile]
    rows = engine.prefill_row_counts()
    assert len(names) == len(set(names)) and {f"prefill[rows={r}]" for r in rows} < set(names), names
    assert "step[argmax]" in names and all(p.lower_s > 0 and p.compile_s > 0 for p in engine.last_compile)
    # `progress` heard of each program as it was built, and knew how many there would be.
    assert sorted(p.name for p, _ in reported) == sorted(names)
    assert {t for _, t in reported} == {len(names)}, reported
    assert all(o.finish_reason == "length" for o in outs), [(o.finish_reason, o.error) for o in outs]
    assert [o.tokens for o in outs] == [o.tokens for o in oracle_engine(config).decode(requests)]
    if speculative == "tree+chain":
        assert 0 < engine.last_run.chain_steps < engine.last_run.steps


def test_compile_builds_only_the_draws_the_requests_ask_for():
    """A run whose requests all sample never runs the greedy step (a batch draws as the most
    demanding of its requests), so `compile` builds the sampled step alone, and serving still
    lowers nothing again; a greedy run builds only the greedy step."""
    engine = oracle_engine(serve_config(attention="dense", slots=2, sampler="gumbel"))
    sampled = [dataclasses.replace(r, temperature=0.8, max_new_tokens=6) for r in mixed_requests()[:3]]
    engine.compile(sampled)
    steps = {p.name for p in engine.last_compile if p.name.startswith(("step", "first_token"))}
    rows = engine.prefill_row_counts()
    assert steps == {"step[gumbel]"} | {f"first_token[rows={r},gumbel]" for r in rows}, steps
    with engine_programs_lowered() as again:
        engine.decode(sampled)
    assert not again, f"lowered again while serving: {again}"
    engine.compile([dataclasses.replace(r, temperature=0.0) for r in sampled])
    assert {p.name for p in engine.last_compile if p.name.startswith("step")} == {"step[argmax]"}


def test_streamed_text_and_stop_strings(ckpt_dir):
    """A random target over a tiny byte-level vocabulary (its byte tokens split UTF-8 characters):
    the streamed pieces add up to the completion's text, the tokens' decode. A stop string taken
    from that text ends the reply at the token that completes it, the same tokens under tree
    speculation (which commits several tokens a round), with the text cut before it and no piece
    showing any part of it. A finished reply is decoded whole once."""
    from treespec_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt_dir)
    sampling = dict(sampler="gumbel", temperature=1.0)
    plain = oracle_engine(serve_config(**sampling), vocab=tok.vocab_size, tokenizer=tok)
    tree = oracle_engine(serve_config("EAGLE3", 2, 3, 6, **sampling), vocab=tok.vocab_size, tokenizer=tok)
    rng = np.random.default_rng(5)
    reqs = [Request(prompt=rng.integers(3, tok.vocab_size, 6).tolist(), max_new_tokens=48, seed=i, ignore_eos=True)
            for i in range(2)]

    def run(engine, requests):
        pieces, done = {}, {}
        for ev in engine.stream(requests):
            pieces[ev.index] = pieces.get(ev.index, "") + ev.text
            if ev.finished is not None:
                done[ev.index] = ev.finished
        assert all(pieces.get(i, "") == done[i].text for i in done)
        return [done[i] for i in range(len(requests))], pieces

    whole_decodes = []
    decode_whole = plain._text
    plain._text = lambda tokens: whole_decodes.append(len(tokens)) or decode_whole(tokens)
    full, _ = run(plain, reqs)
    del plain._text
    assert len(whole_decodes) == len(reqs), "a finished reply is decoded whole once, not per use"
    for c in full:
        assert c.finish_reason == "length" and c.text == tok.decode(c.tokens)
    text = full[0].text
    mid = len(text) // 2
    stop = next(text[i:i + 2] for i in range(mid, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stopped = [dataclasses.replace(reqs[0], stop=[stop]), reqs[1]]
    got, pieces = run(plain, stopped)
    assert got[0].finish_reason == "stop" and got[0].text == text[:text.find(stop)]
    assert got[0].tokens == full[0].tokens[:len(got[0].tokens)]
    assert stop in tok.decode(got[0].tokens) and stop not in tok.decode(got[0].tokens[:-1])
    assert got[1].tokens == full[1].tokens
    spec, _ = run(tree, stopped)
    assert [c.tokens for c in spec] == [c.tokens for c in got] and spec[0].text == got[0].text
    assert tree.last_run.mean_accept_length > 1.0


def test_the_step_lowers_each_decoder_layer_once():
    """Every layer of a forward is one call of `models.llama.decoder_layer`: the step's program
    defines it once for the first layer (no residual delta yet) and once for the rest, so tracing
    and lowering cost about one layer however deep the model (the compile time a new engine pays)."""
    cfg, params = tiny_target(layers=4)
    engine = Engine(serve_config(), cfg, params)
    text = engine._step.lower(engine.params, engine.state, draw="auto").as_text()
    assert len(re.findall(r"call @decoder_layer\w*\(", text)) == 4
    assert len(re.findall(r"func\.func private @decoder_layer\w*\(", text)) == 2
