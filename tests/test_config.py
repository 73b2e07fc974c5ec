"""ServeConfig: tree-shape rules, tree-incompatible features, ranges, TOML loading and round trip."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from treespec_jax.config import (
    BackendsConfig,
    ConfigError,
    KVCacheConfig,
    ModelConfig,
    ParallelConfig,
    SamplingConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
    load_toml,
    to_toml,
)
from treespec_jax.support import check_startup

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def spec(k, s, n, algorithm="EAGLE3", **kw) -> ServeConfig:
    return ServeConfig(speculative=SpeculativeConfig(
        algorithm=algorithm, topk=k, num_steps=s, num_draft_tokens=n, **kw))


def problems_of(cfg: ServeConfig) -> list[str]:
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    # The exception text lists every problem, one per line.
    for p in info.value.problems:
        assert p in str(info.value)
    return list(info.value.problems)


def one_problem_containing(cfg: ServeConfig, *fragments: str) -> str:
    problems = problems_of(cfg)
    hits = [p for p in problems if all(f in p for f in fragments)]
    assert hits, f"no problem contains {fragments}: {problems}"
    return hits[0]


# ---- accepted shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("k,s,n", [(4, 5, 16), (16, 5, 64), (8, 9, 64), (1, 3, 4)])
def test_accepted_shapes(k, s, n):
    cfg = spec(k, s, n).validate()
    assert cfg.speculative.verify_tokens == n
    assert cfg.speculative.is_tree == (k > 1)
    check_startup(cfg)  # the default backends raise no blocker either


def test_chain_defaults_num_draft_tokens_to_steps_plus_one():
    assert spec(1, 5, None).validate().speculative.verify_tokens == 6
    # An algorithm with nothing else is the chain K = 1, S = 3, N = 4.
    cfg = ServeConfig(speculative=SpeculativeConfig(algorithm="MTP")).validate()
    assert (cfg.speculative.topk, cfg.speculative.steps, cfg.speculative.verify_tokens) == (1, 3, 4)


def test_plain_decoding_is_the_default():
    cfg = ServeConfig().validate()
    assert not cfg.speculative.enabled and cfg.speculative.verify_tokens == 1


# ---- refused shapes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k,s,n,fragments",
    [
        (17, 2, 16, ("topk = 17", "outside 1..16")),
        (0, 3, 4, ("topk = 0", "outside 1..16")),
        (4, 11, 16, ("num_steps = 11", "outside 1..10")),
        (16, 6, 64, ("(6 - 1) * 16 = 80", "exceed num_draft_tokens = 64")),
        (4, 5, 8, ("(5 - 1) * 4 = 16", "exceed num_draft_tokens = 8")),
        (4, 5, 65, ("num_draft_tokens = 65", "[2, 64]")),
        (2, 2, 8, ("num_draft_tokens = 8", "= 7", "[2, 7]")),
    ],
)
def test_refused_shapes(k, s, n, fragments):
    one_problem_containing(spec(k, s, n), *fragments)


def test_tree_needs_an_algorithm():
    cfg = ServeConfig(speculative=SpeculativeConfig(topk=4))  # algorithm NONE
    one_problem_containing(cfg, "topk = 4", "EAGLE3 or MTP", "NONE")


def test_tree_needs_eagle3_or_mtp():
    # An algorithm outside the enum can only arrive by constructing the dataclass directly.
    cfg = spec(4, 5, 16, algorithm="NGRAM")
    one_problem_containing(cfg, "'NGRAM'", "EAGLE3 or MTP")
    one_problem_containing(cfg, "speculative.algorithm = 'NGRAM' is not one of")


def test_tree_needs_an_explicit_num_draft_tokens():
    one_problem_containing(spec(4, 5, None), "topk = 4", "explicit speculative.num_draft_tokens")


@pytest.mark.parametrize("n", [3, 5])
def test_chain_num_draft_tokens_must_be_steps_plus_one(n):
    one_problem_containing(spec(1, 3, n), f"num_draft_tokens = {n}", "num_steps + 1 = 4")


def test_num_draft_tokens_lower_bound():
    one_problem_containing(spec(2, 1, 1), "num_draft_tokens = 1", "outside [2,")


def test_plain_decoding_refuses_ignored_speculative_fields():
    cfg = ServeConfig(speculative=SpeculativeConfig(num_steps=5, num_draft_tokens=6))
    problems = problems_of(cfg)
    assert any("num_steps = 5 is set but" in p for p in problems)
    assert any("num_draft_tokens = 6 is set but" in p for p in problems)


def test_mtp_depth_only_with_mtp():
    one_problem_containing(spec(1, 3, 4, mtp_depth=2), "mtp_depth = 2 applies to MTP only")


def test_chain_above_batch_applies_to_trees_that_hold_the_chain():
    spec(4, 5, 16, chain_above_batch=8).validate()
    one_problem_containing(spec(4, 5, 16, chain_above_batch=0), "chain_above_batch = 0 must be >= 1")
    one_problem_containing(spec(1, 5, None, chain_above_batch=8), "chain_above_batch = 8 applies to trees",
                           "topk = 1")
    one_problem_containing(spec(2, 2, 2, chain_above_batch=8), "num_steps + 1 = 3", "num_draft_tokens = 2")
    one_problem_containing(ServeConfig(speculative=SpeculativeConfig(chain_above_batch=8)),
                           "speculative.chain_above_batch = 8 is set but speculative.algorithm is NONE")


def test_multi_depth_mtp_refuses_trees_but_runs_chains():
    one_problem_containing(spec(4, 5, 16, algorithm="MTP", mtp_depth=3),
                           "topk = 4", "multi-depth MTP", "mtp_depth = 3")
    spec(1, 3, 4, algorithm="MTP", mtp_depth=3).validate()
    spec(4, 5, 16, algorithm="MTP", mtp_depth=1).validate()


# ---- tree-incompatible serving features --------------------------------------------------------

FEATURES = {
    "structured output": dict(scheduler=SchedulerConfig(grammar_backend="xgrammar")),
    "mixed prefill/decode": dict(scheduler=SchedulerConfig(enable_mixed_chunk=True)),
    "disaggregation": dict(scheduler=SchedulerConfig(disaggregation_mode="decode")),
    "pipeline parallelism": dict(parallel=ParallelConfig(pp_size=2)),
    "attention data parallelism": dict(parallel=ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_trees_refuse_feature_chains_allow_it(feature):
    one_problem_containing(spec(4, 5, 16).replace(**FEATURES[feature]), "topk = 4", feature)
    spec(1, 3, 4).replace(**FEATURES[feature]).validate()


def test_every_problem_is_reported_at_once():
    cfg = dataclasses.replace(
        spec(17, 11, 65, algorithm="MTP", mtp_depth=2),
        scheduler=SchedulerConfig(grammar_backend="outlines", enable_mixed_chunk=True),
        parallel=ParallelConfig(pp_size=4),
        kv_cache=KVCacheConfig(page_size=48),
    )
    problems = problems_of(cfg)
    expected = ["topk = 17", "num_steps = 11", "(11 - 1) * 17", "num_draft_tokens = 65",
                "multi-depth MTP", "structured output", "mixed prefill/decode", "pipeline parallelism",
                "page_size = 48"]
    for fragment in expected:
        assert any(fragment in p for p in problems), (fragment, problems)
    assert len(problems) >= len(expected)


# ---- other sections --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sections,fragment",
    [
        (dict(kv_cache=KVCacheConfig(page_size=0)), "page_size = 0"),
        (dict(kv_cache=KVCacheConfig(mem_fraction_static=1.5)), "mem_fraction_static = 1.5"),
        (dict(kv_cache=KVCacheConfig(host_kv_gib=0.0)), "host_kv_gib = 0.0"),
        (dict(sampling=SamplingConfig(backend="gumbel", top_p=0.0)), "top_p = 0.0"),
        (dict(sampling=SamplingConfig(backend="gumbel", top_k=0)), "top_k = 0"),
        (dict(sampling=SamplingConfig(backend="gumbel", temperature=math.nan)), "temperature = nan"),
        (dict(sampling=SamplingConfig(backend="greedy", temperature=0.7)), "'greedy' takes argmax"),
        (dict(parallel=ParallelConfig(tp_size=3, dp_size=2, enable_dp_attention=True)), "tp_size = 3, dp_size = 2"),
        (dict(model=ModelConfig(dtype="int8")), "model.dtype = 'int8' is not one of"),
        (dict(scheduler=SchedulerConfig(max_running_requests=0)), "max_running_requests = 0"),
        (dict(scheduler=SchedulerConfig(max_running_requests=8, min_prefill_group=9)), "min_prefill_group = 9"),
        (dict(seed=2**31), "seed = 2147483648 is outside"),
        (dict(seed=-1), "seed = -1 is outside"),
        (dict(backends=BackendsConfig(prefix_kernel="mosaic_gpu"), kv_cache=KVCacheConfig(page_size=32)),
         "needs kv_cache.page_size 64 or 128, got 32"),
        (dict(backends=BackendsConfig(prefix_kernel="cuda")), "prefix_kernel = 'cuda' is not one of"),
    ],
)
def test_section_ranges(sections, fragment):
    one_problem_containing(ServeConfig(**sections), fragment)


# ---- TOML ------------------------------------------------------------------------------------


def test_toml_round_trip(tmp_path):
    cfg = ServeConfig(
        model=ModelConfig(path="/ckpt/qwen3", dtype="fp16", linear_attention="mamba2", context_length=4096),
        speculative=SpeculativeConfig(algorithm="EAGLE3", topk=8, num_steps=9, num_draft_tokens=64,
                                      draft_model_path='/ckpt/"eagle"', draft_sliding_window=512),
        kv_cache=KVCacheConfig(dtype="fp8_e4m3", page_size=16, mem_fraction_static=0.7),
        sampling=SamplingConfig(backend="rejection", temperature=0.6, top_k=20, top_p=0.9),
        parallel=ParallelConfig(tp_size=4),
        seed=987654321,
    ).validate()
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    assert load_toml(path) == cfg
    assert ServeConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "text,fragments",
    [
        ("[speculative]\ntopkk = 4\n", ("speculative: unknown key 'topkk'",)),
        ("[speculativ]\ntopk = 4\n", ("unknown key 'speculativ'",)),
        ("sed = 1\n", ("unknown key 'sed'",)),
        ('[speculative]\ntopk = "4"\n', ("speculative.topk = '4' must be int",)),
        ("[kv_cache]\npage_size = true\n", ("kv_cache.page_size = True must be int",)),
        ("[backends]\ndisable_replay_ssm = 1\n", ("disable_replay_ssm = 1 must be bool",)),
        ("model = 3\n", ("[model] must be a table",)),
    ],
)
def test_toml_bad_keys_and_types_are_named(tmp_path, text, fragments):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_toml(path)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_toml_reports_every_bad_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[speculative]\ntopkk = 4\nnum_steps = "5"\n[sampling]\nbakend = "gumbel"\n')
    with pytest.raises(ConfigError) as info:
        load_toml(path)
    assert len(info.value.problems) == 3


def test_toml_int_is_accepted_for_float(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("[sampling]\nbackend = \"gumbel\"\ntemperature = 1\n")
    cfg = load_toml(path)
    assert isinstance(cfg.sampling.temperature, float) and cfg.sampling.temperature == 1.0


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    path = tmp_path / "broken.toml"
    path.write_text("[speculative\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)


def test_every_shipped_config_is_valid():
    files = sorted(CONFIGS.glob("*.toml"))
    names = {f.name for f in files}
    assert {"tree_eagle3_k4_s5_n16.toml", "tree_k8_s9_n64.toml", "chain_k1_s3.toml"} <= names
    for path in files:
        check_startup(load_toml(path).validate())


def test_prefix_kernel_choices_match_the_cascade():
    from treespec_jax.attention.cascade import PREFIX_KERNELS as CASCADE
    from treespec_jax.config import PREFIX_KERNELS
    assert PREFIX_KERNELS == CASCADE
    ServeConfig(backends=BackendsConfig(prefix_kernel="mosaic_gpu")).validate()  # page 64, auto dtype: fine
    # "auto" (the default) never refuses: it falls back to Triton where the Mosaic kernel cannot run.
    assert BackendsConfig().prefix_kernel == "auto"
    ServeConfig(kv_cache=KVCacheConfig(dtype="fp8_e4m3", page_size=32)).validate()
    # Both Mosaic kernels (GQA prefix, MLA latent decode) take FP8 caches.
    for attention in ("cascade", "mla_cascade"):
        ServeConfig(backends=BackendsConfig(prefix_kernel="mosaic_gpu", attention_backend=attention),
                    kv_cache=KVCacheConfig(dtype="fp8_e4m3")).validate()


def test_kernel_backend_choices_match_the_kernels():
    from pallas_kernels.common import BACKENDS

    from treespec_jax.config import KERNEL_BACKENDS

    assert KERNEL_BACKENDS == BACKENDS


def test_tree_without_n_has_no_verify_token_default():
    with pytest.raises(ValueError, match="topk = 4"):
        spec(4, 5, None).speculative.verify_tokens
