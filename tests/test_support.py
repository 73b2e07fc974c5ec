"""Tree-capability resolution: supported trees, each named blocker, composition rules."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from treespec_jax.config import (
    BackendsConfig,
    ConfigError,
    KVCacheConfig,
    ModelConfig,
    SamplingConfig,
    ServeConfig,
    SpeculativeConfig,
)
from treespec_jax.support import (
    AttentionLayerSpec,
    BackendGroup,
    CacheGroupFormatSpec,
    Capability,
    DrafterSpec,
    LinearAttentionLayerSpec,
    SamplingBackendSpec,
    TreeBackend,
    TreeSupport,
    TreeSupportError,
    check_startup,
    describe_backends,
    resolve_tree_support,
)


def target(*layers: TreeBackend, sampler: TreeBackend | None = None) -> BackendGroup:
    sampler = sampler or SamplingBackendSpec("gumbel")
    return BackendGroup("target", (BackendGroup("cascade", tuple(layers)), sampler))


def drafter(*layers: TreeBackend, **kw) -> DrafterSpec:
    return DrafterSpec(layers=tuple(layers) or (AttentionLayerSpec("layers.0"),), **kw)


def blockers_of(verify_root, draft_root):
    with pytest.raises(TreeSupportError) as info:
        resolve_tree_support(verify_root, draft_root)
    for b in info.value.blockers:
        assert str(b) in str(info.value)
    return info.value.blockers


def only_blocker(verify_root, draft_root):
    (blocker,) = blockers_of(verify_root, draft_root)
    return blocker


# ---- capability values ---------------------------------------------------------------------


def test_capability_requires_reason_exactly_when_refused():
    assert Capability.ok().supported and Capability.ok().reason is None
    assert not Capability.refused("why")
    with pytest.raises(ValueError):
        Capability(False, None)
    with pytest.raises(ValueError):
        Capability(False, "")
    with pytest.raises(ValueError):
        Capability(True, "reason on a yes")


# ---- supported trees -----------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["greedy", "gumbel", "rejection"])
def test_supported_tree_resolves_and_walks_every_node(sampler):
    group = CacheGroupFormatSpec("full")
    verify = target(AttentionLayerSpec("layers.0", cache_group=group),
                    AttentionLayerSpec("layers.1", kv_dtype="fp8_e4m3", cache_group=group),
                    sampler=SamplingBackendSpec(sampler))
    # A sliding-window draft layer is allowed: lanes see the window frozen at the prefix end.
    draft = drafter(AttentionLayerSpec("layers.0", sliding_window=256), algorithm="EAGLE3")
    out = resolve_tree_support(verify, draft)
    assert out.tree
    # The shared cache group is asked once, under its first parent.
    assert out.verify_paths == ("target", "target/cascade", "target/cascade/layers.0",
                                "target/cascade/layers.0/full", "target/cascade/layers.1", f"target/{sampler}")
    assert out.lanes_paths == ("drafter", "drafter/layers.0")


def test_hybrid_linear_attention_target_resolves():
    verify = target(LinearAttentionLayerSpec("layers.0", "gdn"), LinearAttentionLayerSpec("layers.1", "mamba2"),
                    AttentionLayerSpec("layers.2"))
    out = resolve_tree_support(verify, drafter(algorithm="MTP", mtp_depth=1))
    assert "target/cascade/layers.1" in out.verify_paths


def test_chain_needs_no_resolution():
    bad = target(AttentionLayerSpec("layers.0", sliding_window=128), LinearAttentionLayerSpec("l", "kda"))
    out = resolve_tree_support(bad, drafter(algorithm="MTP", mtp_depth=4), topk=1)
    assert not out.tree and out.verify_paths == () and out.lanes_paths == ()
    with pytest.raises(TreeSupportError):
        resolve_tree_support(bad, None, topk=2)
    with pytest.raises(ValueError, match="topk must be >= 1, got 0"):
        resolve_tree_support(bad, None, topk=0)


# ---- each named blocker --------------------------------------------------------------------

OK_DRAFT = drafter()
OK_TARGET = target(AttentionLayerSpec("layers.0"))


def test_blocker_sliding_window_in_target():
    b = only_blocker(target(AttentionLayerSpec("layers.3", sliding_window=4096)), OK_DRAFT)
    assert (b.role, b.path) == ("verify", "target/cascade/layers.3")
    assert "sliding window 4096" in b.reason


@pytest.mark.parametrize("side", ["target", "draft"])
def test_blocker_attention_sinks(side):
    layer = AttentionLayerSpec("layers.1", attention_sinks=True)
    if side == "target":
        b = only_blocker(target(layer), OK_DRAFT)
        assert (b.role, b.path) == ("verify", "target/cascade/layers.1")
    else:
        b = only_blocker(OK_TARGET, drafter(layer))
        assert (b.role, b.path) == ("lanes", "drafter/layers.1")
    assert "attention sinks" in b.reason


@pytest.mark.parametrize("model_dtype,kv_dtype,ok", [
    ("bf16", "bf16", True), ("bf16", "fp8_e4m3", True), ("fp16", "fp8_e4m3", True),
    ("fp16", "bf16", False), ("bf16", "fp16", False), ("bf16", "fp32", False),
])
def test_blocker_kv_dtype(model_dtype, kv_dtype, ok):
    layer = AttentionLayerSpec("layers.0", model_dtype=model_dtype, kv_dtype=kv_dtype)
    if ok:
        resolve_tree_support(target(layer), drafter(layer))
        return
    blockers = blockers_of(target(layer), drafter(layer))
    assert [(b.role, b.path) for b in blockers] == [("verify", "target/cascade/layers.0"),
                                                     ("lanes", "drafter/layers.0")]
    for b in blockers:
        assert f"kv dtype '{kv_dtype}'" in b.reason and f"model dtype '{model_dtype}'" in b.reason


@pytest.mark.parametrize("group,fragment", [
    (CacheGroupFormatSpec("swa_group", kind="sliding_window"), "'sliding_window' is not full-history"),
    (CacheGroupFormatSpec("chunk_group", kind="chunked"), "'chunked' is not full-history"),
    (CacheGroupFormatSpec("packed_group", tokens_per_row=4), "packs 4 tokens per row"),
])
def test_blocker_cache_group(group, fragment):
    b = only_blocker(target(AttentionLayerSpec("layers.2", cache_group=group)), OK_DRAFT)
    assert b.path == f"target/cascade/layers.2/{group.name}" and fragment in b.reason


def test_blocker_kda_linear_attention():
    b = only_blocker(target(LinearAttentionLayerSpec("layers.5", "kda")), OK_DRAFT)
    assert (b.role, b.path) == ("verify", "target/cascade/layers.5") and "KDA" in b.reason


@pytest.mark.parametrize("kind", ["gdn", "mamba2", "kda"])
def test_blocker_linear_attention_in_draft_lanes(kind):
    b = only_blocker(OK_TARGET, drafter(AttentionLayerSpec("layers.0"), LinearAttentionLayerSpec("layers.1", kind)))
    assert (b.role, b.path) == ("lanes", "drafter/layers.1") and "draft lanes" in b.reason


def test_blocker_sampling_backend_without_tree_verify():
    b = only_blocker(target(AttentionLayerSpec("layers.0"),
                            sampler=SamplingBackendSpec("top_p_fused", supports_tree_verify=False)), OK_DRAFT)
    assert (b.role, b.path) == ("verify", "target/top_p_fused") and "no tree verify" in b.reason
    # An unknown sampler must declare its support rather than be assumed capable.
    with pytest.raises(ValueError, match="'top_p_fused'.*declare supports_tree_verify"):
        resolve_tree_support(target(sampler=SamplingBackendSpec("top_p_fused")), None)


def test_blocker_drafter_that_cannot_draft_trees():
    b = only_blocker(OK_TARGET, drafter(algorithm="MTP", mtp_depth=2))
    assert (b.role, b.path) == ("lanes", "drafter") and "multi-depth MTP" in b.reason


def test_every_blocker_is_listed_once_in_one_error():
    verify = target(AttentionLayerSpec("layers.0", sliding_window=64, attention_sinks=True),
                    AttentionLayerSpec("layers.1", cache_group=CacheGroupFormatSpec("g", tokens_per_row=2)),
                    LinearAttentionLayerSpec("layers.2", "kda"),
                    sampler=SamplingBackendSpec("custom", supports_tree_verify=False))
    draft = drafter(AttentionLayerSpec("layers.0", attention_sinks=True), LinearAttentionLayerSpec("layers.1"),
                    algorithm="MTP", mtp_depth=3)
    blockers = blockers_of(verify, draft)
    assert [(b.role, b.path) for b in blockers] == [
        ("verify", "target/cascade/layers.0"),
        ("verify", "target/cascade/layers.1/g"),
        ("verify", "target/cascade/layers.2"),
        ("verify", "target/custom"),
        ("lanes", "drafter"),
        ("lanes", "drafter/layers.0"),
        ("lanes", "drafter/layers.1"),
    ]
    # One node with two problems gives one blocker naming both.
    assert "sliding window 64" in blockers[0].reason and "attention sinks" in blockers[0].reason


# ---- composition rules ---------------------------------------------------------------------


class _OptimisticComposite(TreeBackend):
    """A composite that claims full support: it must not be able to hide a refusing child."""

    name = "hybrid"

    def __init__(self, children: Sequence[TreeBackend]):
        self._children = tuple(children)

    def tree_support(self) -> TreeSupport:
        return TreeSupport.full()

    def child_backends(self):
        return self._children


def test_composite_cannot_answer_for_children():
    verify = BackendGroup("target", (_OptimisticComposite([LinearAttentionLayerSpec("layers.0", "kda")]),))
    b = only_blocker(verify, None)
    assert b.path == "target/hybrid/layers.0"


def test_lanes_answers_do_not_block_verify_and_vice_versa():
    # A GDN layer refuses lanes but verifies trees; a sliding window refuses verify only.
    resolve_tree_support(target(LinearAttentionLayerSpec("layers.0", "gdn")),
                         drafter(AttentionLayerSpec("layers.0", sliding_window=32)))


def test_cycles_and_non_backends_are_errors():
    class Loop(TreeBackend):
        name = "loop"

        def tree_support(self):
            return TreeSupport.full()

        def child_backends(self):
            return (self,)

    with pytest.raises(ValueError, match="cycle at loop/loop"):
        resolve_tree_support(Loop(), None)
    with pytest.raises(TypeError, match="not a TreeBackend"):
        resolve_tree_support(BackendGroup("target", ("attention",)), None)


def test_descriptor_nodes_refuse_bad_values():
    with pytest.raises(ValueError, match="kv dtype='int4'"):
        AttentionLayerSpec("l", kv_dtype="int4")
    with pytest.raises(ValueError, match="linear attention kind='rwkv'"):
        LinearAttentionLayerSpec("l", "rwkv")
    with pytest.raises(ValueError, match="tokens_per_row must be >= 1, got 0"):
        CacheGroupFormatSpec(tokens_per_row=0)
    with pytest.raises(ValueError, match="mtp_depth must be >= 1, got 0"):
        DrafterSpec(algorithm="MTP", mtp_depth=0)


# ---- from a ServeConfig --------------------------------------------------------------------


def tree_config(**sections) -> ServeConfig:
    base = dict(speculative=SpeculativeConfig(algorithm="EAGLE3", topk=4, num_steps=5, num_draft_tokens=16))
    base.update(sections)
    return ServeConfig(**base)


def startup_problems(cfg: ServeConfig) -> list[str]:
    with pytest.raises(ConfigError) as info:
        check_startup(cfg)
    return list(info.value.problems)


def test_config_blockers_reach_check_startup():
    problems = startup_problems(tree_config(
        model=ModelConfig(dtype="fp16", sliding_window=1024, linear_attention="kda"),
        kv_cache=KVCacheConfig(dtype="bf16"),
    ))
    assert any("verify target/cascade/attention" in p and "sliding window 1024" in p
               and "kv dtype 'bf16'" in p for p in problems), problems
    assert any("verify target/cascade/linear_attention" in p and "KDA" in p for p in problems)
    assert any("lanes drafter/cascade/attention" in p and "kv dtype 'bf16'" in p for p in problems)


def test_config_draft_facts():
    check_startup(tree_config(speculative=SpeculativeConfig(
        algorithm="EAGLE3", topk=4, num_steps=5, num_draft_tokens=16, draft_sliding_window=512)))
    problems = startup_problems(tree_config(speculative=SpeculativeConfig(
        algorithm="EAGLE3", topk=4, num_steps=5, num_draft_tokens=16,
        draft_attention_sinks=True, draft_linear_attention="mamba2")))
    assert len(problems) == 2 and all(p.startswith("tree blocker: lanes drafter/") for p in problems)


def test_config_multi_depth_mtp_reported_once():
    problems = startup_problems(tree_config(speculative=SpeculativeConfig(
        algorithm="MTP", topk=4, num_steps=5, num_draft_tokens=16, mtp_depth=2)))
    assert len(problems) == 1 and "multi-depth MTP" in problems[0]


def test_config_chain_skips_resolution():
    cfg = ServeConfig(model=ModelConfig(sliding_window=1024, attention_sinks=True, linear_attention="kda"),
                      speculative=SpeculativeConfig(algorithm="EAGLE3", topk=1, num_steps=3))
    assert not check_startup(cfg).tree


def test_describe_backends_follows_config():
    cfg = tree_config(model=ModelConfig(linear_attention="gdn"), kv_cache=KVCacheConfig(dtype="fp8_e4m3"),
                      sampling=SamplingConfig(backend="rejection", temperature=1.0))
    verify_root, draft_root = describe_backends(cfg)
    out = resolve_tree_support(verify_root, draft_root)
    assert "target/cascade/linear_attention" in out.verify_paths and "target/rejection" in out.verify_paths
    layer = verify_root.children[0].child_backends()[0]
    assert (layer.kv_dtype, layer.model_dtype) == ("fp8_e4m3", "bf16")
    assert describe_backends(ServeConfig())[1] is None  # no drafter without an algorithm


def test_attention_backend_choice_picks_the_real_backend_node():
    from treespec_jax.attention.backends import CascadeBackend, MlaCascadeBackend, attention_backend_node

    cfg = tree_config(backends=BackendsConfig(attention_backend="mla_cascade", drafter_attention_backend="cascade"))
    verify_root, draft_root = describe_backends(cfg)
    out = resolve_tree_support(verify_root, draft_root)
    assert "target/mla_cascade/attention" in out.verify_paths
    assert "drafter/cascade/attention" in out.lanes_paths
    assert isinstance(verify_root.children[0], MlaCascadeBackend)
    # The cascades run both roles themselves; their layers can still refuse.
    assert CascadeBackend().tree_support() == TreeSupport.full()
    with pytest.raises(ValueError, match="'flashinfer'"):
        attention_backend_node("flashinfer", ())
