"""Engines built from checkpoints written here: an HF Llama directory with an EAGLE-3 head, the
`treespec decode` command on them, the MTP drafter, and rejection sampling's distribution."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chi_square import P_MIN, chi_square_p
from engine_fixtures import dense_forward, engine_programs_lowered, mixed_requests, serve_config, tiny_target
from treespec_jax import cli
from treespec_jax.drafter.eagle3 import Eagle3Drafter, MtpDrafter, init_eagle3_params, init_mtp_params
from treespec_jax.engine import Engine, Request
from treespec_jax.engine.loading import attention_for
from treespec_jax.models.config import Eagle3Config
from treespec_jax.models.hf import save_eagle3, save_target


def _head_config(cfg, draft_vocab=48):
    return Eagle3Config(hidden_size=cfg.hidden_size, intermediate_size=80, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab,
                        target_hidden_size=cfg.hidden_size, rope_theta=cfg.rope_theta,
                        max_position_embeddings=cfg.max_position_embeddings)


@pytest.fixture(scope="module")
def checkpoint_pair(tmp_path_factory):
    """A 4-layer target (EAGLE-3 reads layers 2, 2, 1) and a head, in their HF layouts."""
    cfg, params = tiny_target(layers=4)
    root = tmp_path_factory.mktemp("ckpt")
    save_target(root / "target", cfg, params)
    head_cfg = _head_config(cfg)
    head = init_eagle3_params(head_cfg, jax.random.key(5))
    save_eagle3(root / "head", head_cfg, head, dtype=None)
    return root / "target", root / "head", cfg, params


def test_from_pretrained_eagle3_is_lossless(checkpoint_pair):
    target, head, cfg, params = checkpoint_pair
    reqs = mixed_requests()[:4]
    tree_cfg = serve_config("EAGLE3", 4, 3, 10)
    engine = Engine.from_pretrained(target, head, tree_cfg)
    assert isinstance(engine.drafter, Eagle3Drafter)
    engine.compile(reqs)  # the head's prefill reads the target's features: typed as the run's
    with engine_programs_lowered() as again:
        tree = [o.tokens for o in engine.decode(reqs)]
    assert not again, f"lowered again while serving: {again}"
    plain = [o.tokens for o in Engine.from_pretrained(target, None, serve_config()).decode(reqs)]
    assert tree == plain
    # Plain decoding from the checkpoint is the causal forward's argmax, token by token.
    first = reqs[0].prompt + plain[0]
    logits = dense_forward(cfg, params, np.array(first))
    assert plain[0] == np.argmax(logits[len(reqs[0].prompt) - 1:-1], -1).tolist()


def test_decode_command_on_checkpoints(checkpoint_pair, tmp_path, capsys):
    target, head, _, _ = checkpoint_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": r.prompt, "max_new_tokens": r.max_new_tokens, "kind": "label"})
                                 for r in mixed_requests()[:2]))
    flags = ["--dtype", "fp32", "--page-size", "16", "--max-total-tokens", "2048", "--max-running-requests", "2",
             "--attention-backend", "dense", "--json", "--prompts-file", str(prompts)]
    tree_flags = ["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "2",
                  "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "6", "--compare-plain",
                  "--speculative-chain-above-batch", "1"]
    assert cli.main(["decode", "--model", str(target), "--draft-model", str(head)] + flags + tree_flags) == 0
    doc = json.loads(capsys.readouterr().out)
    spec = [c["tokens"] for c in doc["speculative"]["completions"]]
    assert spec == [c["tokens"] for c in doc["plain"]["completions"]]
    assert [len(t) for t in spec] == [r.max_new_tokens for r in mixed_requests()[:2]]
    run = doc["speculative"]["run"]
    assert run["mean_accept_length"] >= 1.0
    # Chains while both requests run, trees for the one left.
    assert 0 < run["chain_steps"] < run["steps"], (run["chain_steps"], run["steps"])
    # A refused configuration exits 2 and names every problem.
    assert cli.main(["decode", "--model", str(target), "--speculative-eagle-topk", "4"] + flags) == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "refused" in err and "topk" in err
    # Requests none of which can be served are refused before anything compiles, each with its reasons.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [1, 2, 3], "max_new_tokens": 0}) + "\n"
                   + json.dumps({"prompt": [1, 2], "temperature": -1.0}) + "\n")
    base = [f for f in flags if f not in ("--json", "--prompts-file", str(prompts))]
    with engine_programs_lowered() as lowered:
        assert cli.main(["decode", "--model", str(target), "--prompts-file", str(bad)] + base) == cli.EXIT_REFUSED
    assert not lowered, f"compiled for requests it refused: {lowered}"
    err = capsys.readouterr().err
    assert "no request can be served" in err
    assert "max_new_tokens=0 must be >= 1" in err and "temperature=-1.0 must be finite" in err


def test_mtp_drafter_is_lossless():
    cfg, params = tiny_target(layers=2)
    config = serve_config("MTP", 2, 3, 6)
    head = init_mtp_params(cfg, jax.random.key(9))
    head.update(embed=params["embed"], lm_head_target=params["lm_head"])
    drafter = MtpDrafter(cfg, attention_for(config))
    reqs = mixed_requests()[:3]
    engine = Engine(config, cfg, params, drafter, head)
    engine.compile(reqs)
    with engine_programs_lowered() as again:
        tree = [o.tokens for o in engine.decode(reqs)]
    assert not again, f"lowered again while serving: {again}"
    plain = [o.tokens for o in Engine(serve_config(), cfg, params).decode(reqs)]
    assert tree == plain


def test_rejection_sampling_matches_plain_distribution():
    """Chi-square of the third generated token against its exact marginal under plain sampling
    (vocabulary 6); the trees drafted by the noisy oracle get verified by rejection sampling."""
    from treespec_jax.drafter.oracle import ModelDrafter
    from treespec_jax.models.llama import LlamaModel

    vocab, temperature = 6, 1.0
    cfg, params = tiny_target(vocab=vocab, scale=0.7)
    config = serve_config("EAGLE3", 2, 3, 6, sampler="rejection", temperature=temperature, slots=32)
    drafter = ModelDrafter(LlamaModel(cfg, attention_for(config)), noise=1.0, noise_seed=3)
    engine = Engine(config, cfg, params, drafter, params)
    prompt = [1, 4, 2]
    samples = 600
    outs = engine.decode([Request(prompt=prompt, max_new_tokens=3, seed=s) for s in range(samples)])
    third = np.bincount([o.tokens[2] for o in outs], minlength=vocab)
    assert engine.last_run.mean_accept_length > 1.05  # drafts do get accepted

    def probs(seq):
        return np.asarray(jax.nn.softmax(dense_forward(cfg, params, np.array(seq))[-1] / temperature), np.float64)

    exact = np.zeros(vocab)
    p1 = probs(prompt)
    for a in range(vocab):
        p2 = probs(prompt + [a])
        for b in range(vocab):
            exact += p1[a] * p2[b] * probs(prompt + [a, b])
    assert chi_square_p(third, exact) > P_MIN
    # The test can fail: the same counts against a wrong distribution are rejected.
    assert chi_square_p(third, np.roll(exact, 1)) < P_MIN


def test_run_experiment_writes_table_and_plot(checkpoint_pair, tmp_path):
    """`treespec run` over a plain and a tree setting: one JSON row per setting and a PNG."""
    target, head, _, _ = checkpoint_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": r.prompt, "max_new_tokens": 12, "kind": "label"})
                                 for r in mixed_requests()[:2]))
    toml = tmp_path / "sweep.toml"
    toml.write_text(f"""
[model]
dtype = "fp32"
[kv_cache]
page_size = 16
max_total_tokens = 2048
[scheduler]
max_running_requests = 2
[backends]
attention_backend = "dense"
[experiment]
name = "tiny-sweep"
model = "{target}"
draft_model = "{head}"
prompts = "{prompts}"
[[experiment.settings]]
label = "plain"
algorithm = "NONE"
[[experiment.settings]]
label = "tree"
algorithm = "EAGLE3"
topk = 2
num_steps = 3
num_draft_tokens = 6
""")
    out = tmp_path / "out"
    assert cli.main(["run", str(toml), "--out", str(out)]) == 0
    rows = json.loads((out / "tiny-sweep.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["plain", "tree"]
    assert rows[0]["mean_accept_length"] == 1.0 and rows[1]["mean_accept_length"] >= 1.0
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)
    assert (out / "tiny-sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A setting key the sweep does not know refuses the whole file before anything runs.
    toml.write_text(toml.read_text() + 'num_lanes = 3\n')
    assert cli.main(["run", str(toml), "--out", str(out)]) == cli.EXIT_REFUSED
