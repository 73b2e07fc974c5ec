"""`treespec check-config`: exit codes, stderr listings, flag/TOML precedence (in process)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from treespec_jax import cli
from treespec_jax.config import ServeConfig, load_toml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TREE = ["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "4",
        "--speculative-num-steps", "5", "--speculative-num-draft-tokens", "16"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["check-config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def printed_config(out: str) -> ServeConfig:
    return ServeConfig.from_dict(tomllib.loads(out))


def test_accepted_flags_print_the_resolved_config(capsys):
    code, out, err = run(capsys, *TREE, "--kv-cache-dtype", "fp8_e4m3", "--sampling-backend", "rejection",
                         "--temperature", "0.8", "--tp-size", "2", "--page-size", "16", "--seed", "7",
                         "--disable-replay-ssm", "--attention-backend", "cascade")
    assert code == 0, err
    assert "draft tree, K=4 S=5 N=16" in out.splitlines()[0]
    assert "tree support: 5 target and 4 drafter backend nodes asked, no blocker" in out
    cfg = printed_config(out)
    sp = cfg.speculative
    assert (sp.algorithm, sp.topk, sp.num_steps, sp.num_draft_tokens) == ("EAGLE3", 4, 5, 16)
    assert (cfg.kv_cache.dtype, cfg.kv_cache.page_size, cfg.sampling.backend, cfg.sampling.temperature) == (
        "fp8_e4m3", 16, "rejection", 0.8)
    assert (cfg.parallel.tp_size, cfg.seed, cfg.backends.disable_replay_ssm) == (2, 7, True)
    assert cfg.backends.attention_backend == "cascade"


@pytest.mark.parametrize("k,s,n,fragment", [
    ("17", "2", "16", "topk = 17"), ("0", "3", "4", "topk = 0"), ("4", "11", "16", "num_steps = 11"),
    ("16", "6", "64", "= 80 draft-lane slots"), ("4", "5", "8", "= 16 draft-lane slots"),
    ("4", "5", "65", "num_draft_tokens = 65"), ("2", "2", "8", "[2, 7]"),
])
def test_refused_shapes_exit_2(capsys, k, s, n, fragment):
    code, out, err = run(capsys, "--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", k,
                         "--speculative-num-steps", s, "--speculative-num-draft-tokens", n)
    assert code == 2 and out == ""
    assert "refused" in err and fragment in err


def test_every_refusal_and_blocker_listed_at_once(capsys):
    code, _, err = run(capsys, "--speculative-algorithm", "MTP", "--speculative-eagle-topk", "4",
                       "--speculative-num-steps", "5", "--speculative-num-draft-tokens", "8",
                       "--speculative-mtp-depth", "2", "--pp-size", "2", "--grammar-backend", "xgrammar",
                       "--enable-mixed-chunk", "--disaggregation-mode", "prefill", "--enable-dp-attention",
                       "--sliding-window", "4096", "--attention-sinks")
    assert code == 2
    for fragment in ["draft-lane slots exceed num_draft_tokens = 8", "multi-depth MTP", "pipeline parallelism",
                     "structured output", "mixed prefill/decode", "disaggregation", "attention data parallelism",
                     "tree blocker: verify target/cascade/attention", "sliding window 4096", "attention sinks"]:
        assert fragment in err, fragment
    assert "refused, 8 problem(s)" in err


def test_tree_without_algorithm_or_n(capsys):
    code, _, err = run(capsys, "--speculative-eagle-topk", "4")
    assert code == 2 and "needs speculative.algorithm EAGLE3 or MTP, got NONE" in err
    code, _, err = run(capsys, "--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "4")
    assert code == 2 and "explicit speculative.num_draft_tokens" in err


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_passes(capsys, path):
    code, out, err = run(capsys, "--config", str(path))
    assert code == 0, err
    assert printed_config(out) == load_toml(path)


def test_flags_override_toml(capsys):
    path = str(CONFIGS / "tree_eagle3_k4_s5_n16.toml")
    code, _, err = run(capsys, "--config", path, "--speculative-num-draft-tokens", "8")
    assert code == 2 and "exceed num_draft_tokens = 8" in err
    # Back to a chain: N set to none falls back to S + 1.
    code, out, err = run(capsys, "--config", path, "--speculative-eagle-topk", "1",
                         "--speculative-num-draft-tokens", "none")
    assert code == 0, err
    cfg = printed_config(out)
    assert cfg.speculative.topk == 1 and cfg.speculative.num_draft_tokens is None
    assert cfg.speculative.verify_tokens == 6 and cfg.sampling.backend == "gumbel"  # rest from the file


def test_negative_bool_flag_overrides_toml(tmp_path, capsys):
    path = tmp_path / "mixed.toml"
    path.write_text('[speculative]\nalgorithm = "EAGLE3"\ntopk = 2\nnum_steps = 2\nnum_draft_tokens = 6\n'
                    "[scheduler]\nenable_mixed_chunk = true\n")
    code, _, err = run(capsys, "--config", str(path))
    assert code == 2 and "mixed prefill/decode" in err
    code, out, err = run(capsys, "--config", str(path), "--no-enable-mixed-chunk")
    assert code == 0, err
    assert printed_config(out).scheduler.enable_mixed_chunk is False


def test_bad_toml_key_and_missing_file(tmp_path, capsys):
    path = tmp_path / "typo.toml"
    path.write_text("[speculative]\neagle_topk = 4\n")
    code, _, err = run(capsys, "--config", str(path))
    assert code == 2 and "unknown key 'eagle_topk'" in err
    code, _, err = run(capsys, "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "does not exist" in err


def test_bad_choices_are_refused_with_every_other_problem(capsys):
    """A flag outside its choices is a config problem like any other: one refusal lists them all."""
    code, _, err = run(capsys, "--speculative-algorithm", "EAGLE", "--kv-cache-dtype", "fp8_e5m2",
                       "--cuda-graphs", "sometimes", "--page-size", "0")
    assert code == 2, err
    for fragment in ("speculative.algorithm = 'EAGLE' is not one of", "kv_cache.dtype = 'fp8_e5m2' is not one of",
                     "backends.cuda_graphs = 'sometimes' is not one of", "page_size"):
        assert fragment in err, (fragment, err)
    assert "4 problem(s)" in err, err


def test_malformed_values_are_refused_together(capsys):
    """Flag text that is not of its field's type is named with every other such value."""
    code, _, err = run(capsys, "--speculative-eagle-topk", "four", "--speculative-num-draft-tokens", "lots",
                       "--seed", "1.5")
    assert code == 2, err
    for fragment in ("speculative.topk = 'four' must be int", "num_draft_tokens = 'lots' must be int",
                     "seed = '1.5' must be int"):
        assert fragment in err, (fragment, err)
    code, out, err = run(capsys, "--speculative-algorithm", "EAGLE3", "--speculative-num-draft-tokens", "none")
    assert code == 0, err
    assert printed_config(out).speculative.num_draft_tokens is None


def test_no_command_exits_2(capsys):
    assert cli.main([]) == 2
    assert "check-config" in capsys.readouterr().err


def test_decode_and_run_use_a_persistent_compile_cache(monkeypatch, tmp_path):
    """`treespec decode` / `run` keep compiled programs across runs: under the user's
    JAX_COMPILATION_CACHE_DIR if set, else TREESPEC_COMPILE_CACHE; "off" leaves JAX's cache off."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("TREESPEC_COMPILE_CACHE", "off")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        assert cli.use_compile_cache() is None
        assert jax.config.jax_compilation_cache_dir == before
        monkeypatch.setenv("TREESPEC_COMPILE_CACHE", str(tmp_path / "xla"))
        assert cli.use_compile_cache() == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "own"))
        assert cli.use_compile_cache() == str(tmp_path / "own")
        monkeypatch.delenv("TREESPEC_COMPILE_CACHE")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "models"))
        assert cli.use_compile_cache() == str(tmp_path / "models" / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_decode_refuses_bad_prompts_and_config_together_before_loading_a_model(capsys, tmp_path, monkeypatch):
    """Every problem of the prompts file (missing; or its bad lines, each by line) and of the
    configuration is named at once, and no model is loaded or fetched for a run that is refused."""
    from treespec_jax.engine import Engine

    def no_model(*args, **kwargs):
        raise AssertionError("a refused run loaded a model")

    monkeypatch.setattr(Engine, "from_pretrained", no_model)
    monkeypatch.setattr("treespec_jax.decode_cli._resolve", no_model)
    missing = tmp_path / "missing.jsonl"
    assert cli.main(["decode", "--prompts-file", str(missing), "--speculative-eagle-topk", "0"]) == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    assert f"prompts file {missing}: No such file or directory" in err and "topk = 0" in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n"just a string"\n\n{"prompt": "x", "temprature": 0.5}\n')
    assert cli.main(["decode", "--prompts-file", str(bad)]) == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    assert f"{bad}:2: not JSON" in err
    assert f"{bad}:3: a request is a JSON object, got str" in err
    assert f"{bad}:5: request fields ['temprature']" in err
    assert f"{bad}:1" not in err


def test_a_temperature_alone_samples_by_default(capsys):
    """The default sampling backend (gumbel) takes a temperature without further flags; the greedy
    backend, asked for by name, refuses it."""
    code, out, err = run(capsys, *TREE, "--temperature", "0.8")
    assert code == 0, err
    assert printed_config(out).sampling.backend == "gumbel"
    code, _, err = run(capsys, *TREE, "--temperature", "0.8", "--sampling-backend", "greedy")
    assert code == 2 and "'greedy' takes argmax" in err
