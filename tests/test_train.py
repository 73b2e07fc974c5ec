"""EAGLE-3 training recipe on a tiny random target (CPU, fp32).

- the dense training target equals the engine's prefill forward, and packing sequences in a row
  changes nothing;
- the unrolled head equals the serving drafter: step 0 = prefill + step0, steps 1..2 = the
  lanes path with K = 1, at several anchors and accept lengths;
- a few optimiser steps lower the loss on a fixed batch;
- a run stopped and resumed from its checkpoint ends with the parameters of an uninterrupted run;
- the exported head is the published layout, loads back through `models.hf.load_eagle3` and
  builds an `Eagle3Drafter`;
- the data generator writes shards through the Engine (dense attention, fp32), a second run
  skips them, a deleted shard comes back identical;
- the draft vocabulary, the packing cursor and the config's refusals.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespec_jax.drafter.base import AcceptedRows
from treespec_jax.drafter.eagle3 import DRAFT_K, DRAFT_V, Eagle3Drafter, init_eagle3_params
from treespec_jax.models.attention import PagedAttention, prefill_batch
from treespec_jax.models.config import Eagle3Config, LlamaConfig
from treespec_jax.models.llama import LlamaModel, init_params
from treespec_jax.train import data as data_mod
from treespec_jax.train import eagle3 as trainer_mod
from treespec_jax.train.config import TrainConfig, TrainConfigError, from_dict, load_config
from treespec_jax.train.forward import head_unrolled, target_forward

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
WORDS = ["system", "user", "assistant", "you", "are", "a", "tiny", "model", "hello", "what", "is", "the", "sky",
         "blue", "write", "code", "list", "three", "fruits", "explain", "rain", "why", "how", "do", "i", "cook",
         "rice", "?", ".", ",", "and", "it", "of", "to", "in", "on", "at", "be", "this", "that"]
CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "<|im_start|>system\nyou are a tiny model .<|im_end|>\n{% endif %}"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = len(SPECIALS) + len(WORDS)

TARGET = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     max_position_embeddings=256, eos_token_ids=(2,))
HEAD = Eagle3Config(hidden_size=32, intermediate_size=40, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=VOCAB,
                    draft_vocab_size=24, target_hidden_size=32, rope_theta=1e4, rms_norm_eps=1e-5)
PAGE = 4


def tiny_tokenizer():
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    from treespec_jax.tokenizer import Tokenizer

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    backend = Backend(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[:3]])
    return Tokenizer(backend, eos_token="<|im_end|>", chat_template=CHATML, source="tiny")


@pytest.fixture(scope="module")
def target_params():
    return init_params(TARGET, jax.random.key(0))


def _pools(n_pages):
    return {f"{kv}{i}": jnp.zeros(((n_pages + 1) * PAGE, TARGET.num_kv_heads, TARGET.head_dim))
            for i in range(TARGET.num_layers) for kv in "kv"}


def _row(tokens):
    t = len(tokens)
    return (jnp.asarray(tokens, jnp.int32)[None], jnp.arange(t, dtype=jnp.int32)[None], jnp.zeros((1, t), jnp.int32))


def test_target_forward_matches_engine_prefill(target_params):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, 14)
    model = LlamaModel(TARGET, PagedAttention(PAGE, kind="dense"), TARGET.eagle3_feature_layers)
    table = jnp.arange(1, 5, dtype=jnp.int32)[None]
    batch = prefill_batch(table, jnp.array([0]), jnp.array([14]), 14, PAGE)
    ref_logits, ref_feats, _ = jax.jit(model.forward)(target_params, _pools(4), jnp.asarray(toks, jnp.int32)[None],
                                                      batch, jnp.arange(14, dtype=jnp.int32)[None])
    forward = jax.jit(target_forward, static_argnums=(1, 5))
    logits, feats = forward(target_params, TARGET, *_row(toks), TARGET.eagle3_feature_layers)
    np.testing.assert_allclose(feats, ref_feats, atol=2e-5)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4)
    # Packed behind another sequence (positions restarting at 0), the same sequence computes the same.
    other = rng.integers(0, VOCAB, 5)
    packed = jnp.asarray(np.concatenate([other, toks]), jnp.int32)[None]
    pos = jnp.asarray(np.concatenate([np.arange(5), np.arange(14)]), jnp.int32)[None]
    seg = jnp.asarray([0] * 5 + [1] * 14, jnp.int32)[None]
    logits_p, feats_p = forward(target_params, TARGET, packed, pos, seg, TARGET.eagle3_feature_layers)
    np.testing.assert_allclose(feats_p[:, 5:], feats, atol=2e-5)
    np.testing.assert_allclose(logits_p[:, 5:], logits, atol=2e-4)


@pytest.mark.parametrize("served", [False, True])
def test_unrolled_head_matches_serving_step0_and_lanes(target_params, served):
    """Step 0 at anchor p = the drafter's prefill of [0, s) + step0 over accepted rows s..p; step i
    = the lanes call of draft step i with one lane fed the data's token (K = 1). `served`: the
    drafter runs the layout the engine serves (`serving_params`: fused projections) while training
    reads the separate weights, so a wrong fused column order fails here."""
    T, S = 14, 3
    rng = np.random.default_rng(1)
    seq = rng.integers(0, VOCAB, T)
    head = init_eagle3_params(HEAD, jax.random.key(2))
    forward = jax.jit(target_forward, static_argnums=(1, 5))
    _, feats = forward(target_params, TARGET, *_row(seq), TARGET.eagle3_feature_layers)
    # The unrolled draft on the sequence packed second in its row.
    lead = rng.integers(0, VOCAB, 3)
    packed = jnp.asarray(np.concatenate([lead, seq]), jnp.int32)[None]
    pos = jnp.asarray(np.concatenate([np.arange(3), np.arange(T)]), jnp.int32)[None]
    seg = jnp.asarray([0] * 3 + [1] * T, jnp.int32)[None]
    _, lead_feats = forward(target_params, TARGET, *_row(lead), TARGET.eagle3_feature_layers)
    unrolled = jax.jit(head_unrolled, static_argnums=(2, 7))
    outs = unrolled(head, target_params["embed"], HEAD, packed, pos, seg, jnp.concatenate([lead_feats, feats], 1), S)
    outs = [(lg[:, 3:], t[:, 3:]) for lg, t in outs]

    drafter = Eagle3Drafter(HEAD, TARGET, PagedAttention(PAGE, kind="dense"))
    prefill = jax.jit(drafter.prefill)
    step0 = jax.jit(drafter.step0)
    lanes = jax.jit(drafter.lanes, static_argnums=(6, 7))
    dparams = {**head, "embed": target_params["embed"]}
    if served:
        dparams = drafter.serving_params(dparams)
        assert "wqkv" in dparams["layer"] and "w_gate_up" in dparams["layer"]
    table = jnp.arange(1, 9, dtype=jnp.int32)[None]
    toks = jnp.asarray(seq, jnp.int32)[None]
    nxt = jnp.concatenate([toks[:, 1:], jnp.zeros((1, 1), jnp.int32)], 1)
    n = 5
    for p, accepted in ((2, 1), (6, 3), (9, 4)):  # p + S < T: every step has its token
        start = p - accepted + 1
        pools = {name: jnp.zeros((9 * PAGE, HEAD.num_kv_heads, HEAD.head_dim)) for name in (DRAFT_K, DRAFT_V)}
        # One chunk of T rows, the first `start` real: positions [0, start) of the draft cache.
        pools = prefill(dparams, pools, toks, nxt, feats, table, jnp.array([0]), jnp.array([start]))
        rows = AcceptedRows(
            path_tokens=jnp.zeros((1, n), jnp.int32).at[0, :accepted].set(toks[0, start:p + 1]),
            predicts=jnp.zeros((1, n), jnp.int32).at[0, :accepted].set(toks[0, start + 1:p + 2]),
            features=jnp.zeros((1, n, feats.shape[-1])).at[0, :accepted].set(feats[0, start:p + 1]),
            start=jnp.array([start]), accept_len=jnp.array([accepted]), page_table=table)
        pools, root_logits, root_feature, frontier = step0(dparams, pools, rows)
        np.testing.assert_allclose(root_logits[0], outs[0][0][0, p], atol=1e-5, err_msg=f"step 0, anchor {p}")
        np.testing.assert_allclose(root_feature[0], outs[0][1][0, p], atol=1e-5)
        feature = root_feature[:, None]
        for step in range(1, S):
            token = toks[:, p + 1 + step][:, None]
            # Lane 0 sees its own lane-window slot of every step so far (draft_tree's K = 1 masks).
            mask = jnp.zeros((1, 1, 2), jnp.uint32).at[0, 0, 0].set((1 << step) - 1)
            pools, logits, feature = lanes(dparams, pools, token, feature, mask, frontier, step, S, table)
            np.testing.assert_allclose(logits[0, 0], outs[step][0][0, p], atol=1e-5,
                                       err_msg=f"step {step}, anchor {p}")


# ---------------------------------------------------------------------------------------------
# Training on synthetic sequences
# ---------------------------------------------------------------------------------------------


def tiny_config(**train) -> TrainConfig:
    base = {"seq_len": 32, "batch_rows": 2, "steps": 12, "lr": 1e-2, "warmup_steps": 1, "ttt_steps": 3,
            "compute_dtype": "fp32", "target_dtype": "fp32", "remat": True, "log_every": 1, "checkpoint_every": 3,
            "eval_batches": 2}
    base.update(train)
    return from_dict({"target": "unused", "vocab": {"draft_vocab_size": 24},
                      "head": {"intermediate_size": 40}, "train": base})


def synthetic_shards(path, count=24, seed=0, first_word=4):
    """Shards of sequences a tiny model can learn: prompt, then a reply cycling through the 12
    words from id `first_word` on."""
    rng = np.random.default_rng(seed)
    seqs, plens = [], []
    for i in range(count):
        prompt = [1] + list(rng.integers(4, VOCAB, 4))
        start = int(rng.integers(0, 8))
        reply = [first_word + (start + k) % 12 for k in range(int(rng.integers(6, 14)))] + [2]
        seqs.append(np.asarray(prompt + reply))
        plens.append(len(prompt))
    path.mkdir(parents=True, exist_ok=True)
    for k, lo in enumerate(range(0, count, 8)):
        part = seqs[lo:lo + 8]
        lens = np.asarray([len(s) for s in part])
        data_mod.write_shard(data_mod.shard_path(path, k), {
            "tokens": np.concatenate(part).astype(np.uint16), "offsets": np.concatenate([[0], np.cumsum(lens)]),
            "prompt_lens": np.asarray(plens[lo:lo + 8], np.int32), "request": np.arange(lo, lo + len(part)),
            "prompt_index": np.arange(lo, lo + len(part), dtype=np.int32),
            "temperature": np.zeros(len(part), np.float32),
            "heldout": np.asarray([(lo + j) % 6 == 5 for j in range(len(part))]),
            "finish": np.full(len(part), data_mod.FINISH.index("eos"), np.int8)})
    return path


def test_steps_reduce_loss_on_a_fixed_batch(tmp_path, target_params):
    cfg = tiny_config()  # the resume test's config: the compiled step is shared
    seqs = data_mod.read_shards(synthetic_shards(tmp_path / "data"))
    train_seqs, _ = seqs.split()
    vocab = data_mod.build_vocab(train_seqs.reply_tokens(), VOCAB, 24)
    hc = trainer_mod.head_config(TARGET, cfg, 24)
    tr = trainer_mod.Trainer(cfg, TARGET, hc, vocab)
    params = trainer_mod.init_head(target_params, TARGET, hc, vocab["draft_ids"], jax.random.key(0))
    opt = tr.optimizer.init(params)
    batch = data_mod.PackedBatches(train_seqs, 32, 2).next()
    losses = []
    for _ in range(12):
        params, opt, m = tr.step(params, opt, target_params, batch)
        losses.append(float(m["total"]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses


def _flat(params):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_resume_matches_uninterrupted_run_and_export_loads(tmp_path, target_params):
    from treespec_jax.models.hf import load_eagle3

    data = synthetic_shards(tmp_path / "data")
    cfg = tiny_config()
    quiet = lambda m: None
    target = (TARGET, target_params)
    whole = trainer_mod.train(cfg, data, tmp_path / "whole", stop_after=6, target=target, log=quiet)
    first = trainer_mod.train(cfg, data, tmp_path / "split", stop_after=4, target=target, log=quiet)
    assert (first.step, first.stopped) == (4, "stop_after")
    second = trainer_mod.train(cfg, data, tmp_path / "split", stop_after=2, export=True, target=target, log=quiet)
    assert whole.step == second.step == 6

    def final_params(run):
        like = trainer_mod.init_head(target_params, TARGET, trainer_mod.head_config(TARGET, cfg, 24),
                                     np.arange(24), jax.random.key(0))
        opt = trainer_mod.make_optimizer(cfg).init(like)
        params, opt, meta = trainer_mod.load_checkpoint(trainer_mod.checkpoints(run)[-1], like, opt)
        return _flat(params), _flat(opt), meta

    pw, ow, mw = final_params(tmp_path / "whole")
    ps, os_, ms = final_params(tmp_path / "split")
    assert mw["step"] == ms["step"] == 6 and mw["cursor"] == ms["cursor"]
    for k in pw:
        np.testing.assert_allclose(ps[k], pw[k], rtol=0, atol=1e-6, err_msg=k)
    for k in ow:
        np.testing.assert_allclose(os_[k], ow[k], rtol=0, atol=1e-6, err_msg=k)
    rows = trainer_mod.read_loss_csv(tmp_path / "split" / "loss.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]

    # --export wrote the head: published layout, bf16, loads back and drafts.
    exp = second.export
    head_dir = tmp_path / "split" / "head"
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 24
    assert config["torch_dtype"] == "bfloat16" and exp["head_bytes"] <= trainer_mod.MAX_HEAD_BYTES
    assert np.isfinite(exp["heldout_loss"]) and len(exp["acc"]) == 3
    hc, loaded = load_eagle3(head_dir, "fp32", target=TARGET)
    assert hc == trainer_mod.head_config(TARGET, cfg, 24)
    vocab = dict(np.load(tmp_path / "split" / "vocab.npz"))
    np.testing.assert_array_equal(np.arange(24) + np.asarray(loaded["d2t"]), vocab["draft_ids"])
    bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(loaded["layer"]["wq"]), bf16(ps["['layer']['wq']"]))
    np.testing.assert_array_equal(np.asarray(loaded["lm_head"]), bf16(ps["['lm_head']"]))
    Eagle3Drafter(hc, TARGET, PagedAttention(PAGE, kind="dense"))
    assert (tmp_path / "split" / "metrics.json").exists()


def test_run_starts_from_an_exported_head(tmp_path, target_params):
    """head.init_from: a new run starts from an exported head's (bf16) weights and keeps its draft
    vocabulary, so its first loss is the trained head's, not a fresh one's; a head that does not
    fit the config is refused naming each misfit, a missing one at config time."""
    data = synthetic_shards(tmp_path / "data", seed=3)
    quiet = lambda m: None
    target = (TARGET, target_params)
    cfg = tiny_config()
    trained = trainer_mod.train(cfg, data, tmp_path / "a", stop_after=6, export=True, target=target, log=quiet)
    head_dir = tmp_path / "a" / "head"
    warm_cfg = cfg.replace(head={"init_from": str(head_dir)})
    trainer_mod.train(warm_cfg, data, tmp_path / "b", stop_after=1, target=target, log=quiet)
    trainer_mod.train(cfg, data, tmp_path / "c", stop_after=1, target=target, log=quiet)
    first_loss = lambda run: float(trainer_mod.read_loss_csv(tmp_path / run / "loss.csv")[0]["loss"])
    trained_loss = float(trainer_mod.read_loss_csv(tmp_path / "a" / "loss.csv")[-1]["loss"])
    assert first_loss("b") < 0.8 * first_loss("c"), (first_loss("b"), first_loss("c"), trained_loss)
    np.testing.assert_array_equal(np.load(tmp_path / "b" / "vocab.npz")["draft_ids"],
                                  np.load(tmp_path / "a" / "vocab.npz")["draft_ids"])
    # Zero steps: the checkpoint holds the exported weights exactly.
    trainer_mod.train(warm_cfg, data, tmp_path / "d", stop_after=0, target=target, log=quiet)
    like = trainer_mod.init_head(target_params, TARGET, trainer_mod.head_config(TARGET, cfg, 24), np.arange(24),
                                 jax.random.key(1))
    params, _, meta = trainer_mod.load_checkpoint(trainer_mod.checkpoints(tmp_path / "d")[-1], like,
                                                  trainer_mod.make_optimizer(cfg).init(like))
    from treespec_jax.models.hf import load_eagle3
    _, loaded = load_eagle3(head_dir, "fp32", target=TARGET)
    assert meta["step"] == 0 and trained.step == 6
    for k, v in _flat(trainer_mod.head_params_of(loaded)).items():
        np.testing.assert_array_equal(_flat(params)[k], v, err_msg=k)

    misfit = warm_cfg.replace(head={"intermediate_size": 44}, vocab={"draft_vocab_size": 20})
    with pytest.raises(ValueError, match=r"intermediate_size 40 \(this config: 44\).*draft_vocab_size 24"):
        trainer_mod.train(misfit, data, tmp_path / "e", stop_after=1, target=target, log=quiet)
    with pytest.raises(TrainConfigError, match="head.init_from = 'no/such/head': no config.json"):
        load_config(overrides={"head.init_from": "no/such/head"})


def test_run_from_a_head_can_draw_its_vocabulary_from_the_data(tmp_path, target_params):
    """head.init_vocab = "data": the run's draft vocabulary comes from its own replies (any size);
    a token the start head also drafts keeps that head's lm_head column, a new one gets its column
    from `carry_lm_head` (tested below), and every other weight is the start head's."""
    from treespec_jax.models.hf import load_eagle3

    quiet = lambda m: None
    target = (TARGET, target_params)
    cfg = tiny_config()
    trainer_mod.train(cfg, synthetic_shards(tmp_path / "a_data", seed=3), tmp_path / "a", stop_after=4, export=True,
                      target=target, log=quiet)
    _, loaded = load_eagle3(tmp_path / "a" / "head", "fp32", target=TARGET)
    old_ids = np.load(tmp_path / "a" / "vocab.npz")["draft_ids"]
    # Replies in other words: the new vocabulary shares some tokens with the old one, not all.
    data = synthetic_shards(tmp_path / "b_data", seed=4, first_word=24)
    warm = cfg.replace(head={"init_from": str(tmp_path / "a" / "head"), "init_vocab": "data"},
                       vocab={"draft_vocab_size": 20})
    trainer_mod.train(warm, data, tmp_path / "b", stop_after=0, target=target, log=quiet)
    ids = np.load(tmp_path / "b" / "vocab.npz")["draft_ids"]
    train_seqs, _ = data_mod.read_shards(data).split()
    np.testing.assert_array_equal(ids, data_mod.build_vocab(train_seqs.reply_tokens(), VOCAB, 20)["draft_ids"])
    shared = np.isin(ids, old_ids)
    assert 0 < shared.sum() < len(ids), ids
    like = trainer_mod.init_head(target_params, TARGET, trainer_mod.head_config(TARGET, warm, 20), ids,
                                 jax.random.key(1))
    params, _, _ = trainer_mod.load_checkpoint(trainer_mod.checkpoints(tmp_path / "b")[-1], like,
                                               trainer_mod.make_optimizer(warm).init(like))
    lm_head, old_head = np.asarray(params["lm_head"]), np.asarray(loaded["lm_head"])
    embed = np.asarray(target_params["embed"], np.float32)
    for col in np.flatnonzero(shared):
        np.testing.assert_array_equal(lm_head[:, col], old_head[:, np.searchsorted(old_ids, ids[col])])
    new = lm_head[:, ~shared]
    assert np.all(np.isfinite(new)) and not np.allclose(new, embed[ids[~shared]].T, atol=1e-3)
    start = _flat(trainer_mod.head_params_of(loaded))
    for k, v in _flat(params).items():
        if k != "['lm_head']":
            np.testing.assert_array_equal(v, start[k], err_msg=k)
    with pytest.raises(TrainConfigError, match="head.init_vocab = 'fresh' must be one of"):
        load_config(overrides={"head.init_vocab": "fresh"})


def test_new_draft_tokens_take_the_map_the_head_learned():
    """A head whose columns are a linear map M of the target's (plus nothing) gives a new token the
    column M would: the map is recovered from the shared tokens, not assumed to be the identity."""
    rng = np.random.default_rng(5)
    h, v = 6, 40
    target_head = rng.standard_normal((h, v))
    m = rng.standard_normal((h, h))
    old_ids = np.sort(rng.choice(v, 16, replace=False))
    params = {"fc": np.ones(3), "lm_head": jnp.asarray(m @ target_head[:, old_ids], jnp.float32)}
    new_ids = np.sort(np.concatenate([old_ids[:10], rng.choice(np.setdiff1d(np.arange(v), old_ids), 7, replace=False)]))
    out = trainer_mod.carry_lm_head(params, old_ids, new_ids, jnp.asarray(target_head, jnp.float32))
    np.testing.assert_allclose(np.asarray(out["lm_head"]), m @ target_head[:, new_ids], rtol=1e-4, atol=1e-4)
    assert out["fc"] is params["fc"]


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_second_pass_gives_each_prompt_one_greedy_reply(fraction):
    """With `greedy_second_pass` every prompt has exactly one greedy request among its first two
    passes, the first pass is planned as without it, and later passes sample; without it the
    second pass samples too."""
    n = 40
    on = dataclasses.replace(TrainConfig().data, greedy_fraction=fraction, greedy_second_pass=True, seed=3)
    off = dataclasses.replace(on, greedy_second_pass=False)
    for p in range(n):
        plans = [data_mod.plan_request(p + r * n, n, on) for r in range(3)]
        assert all(prompt == p for prompt, _, _ in plans)
        assert [t == 0.0 for _, t, _ in plans[:2]].count(True) == 1
        assert plans[2][1] == on.temperature
        assert plans[0] == data_mod.plan_request(p, n, off)
        assert data_mod.plan_request(p + n, n, off)[1] == off.temperature
    first_pass_greedy = sum(data_mod.plan_request(p, n, on)[1] == 0.0 for p in range(n))
    assert 0 < first_pass_greedy < n


def test_data_generator_writes_and_resumes_shards_through_the_engine(tmp_path, target_params):
    tok = tiny_tokenizer()
    prompts = [{"messages": [{"role": "user", "content": c}]} for c in
               ("what is the sky ?", "write code .", "list three fruits .", "how do i cook rice ?", "why rain ?")]
    cfg = dataclasses.replace(TrainConfig().data, max_requests=7, shard_size=4, max_new_tokens=6,
                              max_prompt_tokens=40, batch=4, dtype="fp32", attention_backend="dense", page_size=16,
                              heldout_every=5, greedy_fraction=0.5)
    engine = data_mod.make_engine(TARGET, target_params, tok, cfg)
    out = tmp_path / "data"
    summary = data_mod.generate(engine, tok, prompts, cfg, out, log=lambda m: None)
    assert summary["shards_written"] == 2 and summary["complete"]
    seqs = data_mod.read_shards(out)
    assert len(seqs) == 7
    for j in range(7):
        p, temp, _ = data_mod.plan_request(j, len(prompts), cfg)
        ids = tok.encode_chat(prompts[p]["messages"])
        assert list(seqs.seqs[j][:seqs.prompt_lens[j]]) == ids
        assert 1 <= len(seqs.seqs[j]) - seqs.prompt_lens[j] <= 6
        assert seqs.temperature[j] == temp and seqs.heldout[j] == (p == 4)
    assert seqs.temperature[5] == cfg.temperature and seqs.temperature[6] == cfg.temperature  # second pass samples
    # A greedy reply is what the engine decodes greedily for that prompt on its own.
    j = int(np.flatnonzero(seqs.temperature == 0)[0])
    from treespec_jax.engine import Request

    alone = engine.decode([Request(prompt=list(seqs.seqs[j][:seqs.prompt_lens[j]]), max_new_tokens=6,
                                   temperature=0.0)])[0]
    assert list(seqs.seqs[j][seqs.prompt_lens[j]:]) == alone.tokens
    # Resumption: nothing to do, then a deleted shard is rebuilt identically (keyed sampling).
    assert data_mod.generate(engine, tok, prompts, cfg, out, log=lambda m: None)["shards_written"] == 0
    before = dict(np.load(data_mod.shard_path(out, 1)))
    data_mod.shard_path(out, 1).unlink()
    assert data_mod.generate(engine, tok, prompts, cfg, out, log=lambda m: None)["shards_written"] == 1
    after = dict(np.load(data_mod.shard_path(out, 1)))
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    # At a deadline no further shard is fed, and what was fed is written whole: a run out of time
    # from the start still makes its first shard, the same as the full run's.
    short = tmp_path / "short"
    summary = data_mod.generate(engine, tok, prompts, cfg, short, max_minutes=0.0, log=lambda m: None)
    assert summary["shards_written"] == 1 and summary["stopped_at_deadline"] and not summary["complete"]
    np.testing.assert_array_equal(np.load(data_mod.shard_path(short, 0))["tokens"],
                                  np.load(data_mod.shard_path(out, 0))["tokens"])
    # first_shard: a later run makes only the shards from it on, each the same as a full run's.
    later = tmp_path / "later"
    summary = data_mod.generate(engine, tok, prompts, dataclasses.replace(cfg, first_shard=1), later,
                                log=lambda m: None)
    assert summary["shards_written"] == 1 and summary["shards_total"] == 1 and summary["complete"]
    assert not data_mod.shard_path(later, 0).exists()
    np.testing.assert_array_equal(np.load(data_mod.shard_path(later, 1))["request"], before["request"])
    problems = dataclasses.replace(cfg, first_shard=2).problems()
    assert problems == ["data.first_shard = 2 must lie in [0, ceil(max_requests / shard_size)) = [0, 2)"]


def test_draft_vocabulary_and_packing_cursor(tmp_path):
    tokens = np.asarray([5, 5, 5, 9, 9, 3, 7, 7, 7, 7, 1])
    v = data_mod.build_vocab(tokens, 12, 3)
    np.testing.assert_array_equal(v["draft_ids"], [5, 7, 9])  # the three most frequent, in id order
    np.testing.assert_array_equal(np.arange(3) + v["d2t"], [5, 7, 9])
    assert v["t2d"].sum() == 3 and v["t2d"][[5, 7, 9]].all()
    assert v["coverage"] == pytest.approx(9 / 11)
    assert len(data_mod.build_vocab(tokens, 12, 0)["draft_ids"]) == 12

    seqs = data_mod.read_shards(synthetic_shards(tmp_path / "d"))
    a = data_mod.PackedBatches(seqs, 32, 2, seed=3)
    for _ in range(5):
        a.next()
    b = data_mod.PackedBatches(seqs, 32, 2, seed=3, cursor=a.cursor)
    for _ in range(3):
        x, y = a.next(), b.next()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    batch = x
    for r in range(2):  # segments are contiguous runs, positions restart at 0 in each
        seg = batch["segments"][r]
        for s in set(seg[seg >= 0].tolist()):
            idx = np.flatnonzero(seg == s)
            assert (np.diff(idx) == 1).all() and (batch["positions"][r, idx] == np.arange(len(idx))).all()


def test_config_refuses_bad_values_naming_each():
    cfg = load_config()
    assert cfg.train.ttt_steps == 7 and cfg.train.ttt_decay == 0.8 and cfg.vocab.draft_vocab_size == 16384
    with pytest.raises(TrainConfigError) as err:
        load_config(overrides={"train.lr": -1.0, "data.dtype": "fp8", "train.ttt_steps": "x", "train.bogus": 1})
    text = str(err.value)
    for needle in ("train.lr = -1.0", "data.dtype = 'fp8'", "train.ttt_steps = 'x'", "train.bogus"):
        assert needle in text, needle
