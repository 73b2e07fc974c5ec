"""Tree-capability declaration and startup resolution.

Every backend that takes part in a decode step (attention, linear attention, sampling, drafter,
and the composites that hold them) declares, through `tree_support()`, whether it can

- **verify** a draft tree (run the target forward / acceptance over N tree nodes with ancestor
  masks instead of a causal chain), and
- run **lanes** (the drafter's K parallel branches per draft step, each with its own mask).

Each node answers only for itself. A composite lists its parts in `child_backends()` and never
answers on a child's behalf, so adding a composite cannot hide a child that refuses.
`resolve_tree_support(verify_root, draft_root)` walks both trees once, before any state is
allocated: the verify capability is read from every node under the target root, the lanes
capability from every node under the draft root. All blockers are gathered and raised together
as one `TreeSupportError` naming each blocker by its path (e.g. `target/hybrid/layers.3`).

With topk K = 1 (a chain) nothing tree-specific runs, so no resolution is needed:
`resolve_tree_support(..., topk=1)` returns without walking.

The descriptor nodes below (`AttentionLayerSpec`, `CacheGroupFormatSpec`, `LinearAttentionLayerSpec`,
`SamplingBackendSpec`, `DrafterSpec`, `BackendGroup`) carry the facts that decide support before
any kernel exists; real backend classes implement the same `TreeBackend` protocol.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Capability",
    "TreeSupport",
    "TreeBackend",
    "Blocker",
    "TreeSupportError",
    "ResolvedTreeSupport",
    "resolve_tree_support",
    "BackendGroup",
    "CacheGroupFormatSpec",
    "AttentionLayerSpec",
    "LinearAttentionLayerSpec",
    "SamplingBackendSpec",
    "DrafterSpec",
    "TREE_KV_DTYPES",
    "MODEL_DTYPES",
    "CACHE_GROUP_KINDS",
    "LINEAR_ATTENTION_KINDS",
    "SAMPLING_BACKENDS",
    "DRAFTER_ALGORITHMS",
    "describe_backends",
    "check_startup",
]


# --------------------------------------------------------------------------------------------
# Core API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capability:
    """One yes/no answer with the reason when it is no."""

    supported: bool  # True: this node raises no objection
    reason: str | None = None  # why not; required iff supported is False

    def __post_init__(self):
        if self.supported and self.reason is not None:
            raise ValueError(f"a supported capability carries no reason, got {self.reason!r}")
        if not self.supported and not self.reason:
            raise ValueError("a refused capability must say why (empty reason)")

    @classmethod
    def ok(cls) -> Capability:
        return cls(True, None)

    @classmethod
    def refused(cls, reason: str) -> Capability:
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.supported


@dataclass(frozen=True)
class TreeSupport:
    """A backend node's own tree answers: as part of the target (verify) and of the drafter (lanes)."""

    verify: Capability  # can this node run a tree-shaped verify forward / acceptance
    lanes: Capability  # can this node run K draft lanes with per-lane masks

    @classmethod
    def full(cls) -> TreeSupport:
        return cls(Capability.ok(), Capability.ok())

    @classmethod
    def refuse_both(cls, reason: str) -> TreeSupport:
        return cls(Capability.refused(reason), Capability.refused(reason))


class TreeBackend(abc.ABC):
    """A node in a backend tree. Subclasses set `name` and implement `tree_support()`.

    `tree_support()` answers for this node alone. Composites return their parts from
    `child_backends()`; the resolver asks each child itself.
    """

    name: str  # short path component, e.g. "cascade" or "layers.3"

    @abc.abstractmethod
    def tree_support(self) -> TreeSupport:
        """This node's own verify / lanes capability (never its children's)."""

    def child_backends(self) -> Sequence[TreeBackend]:
        """Sub-backends this node delegates to; leaves have none."""
        return ()


Role = Literal["verify", "lanes"]


@dataclass(frozen=True)
class Blocker:
    """One reason the tree cannot run: which role, where in the backend tree, and why."""

    role: Role  # "verify" (target tree) or "lanes" (draft tree)
    path: str  # slash-joined backend names from the root, e.g. "target/hybrid/layers.3"
    reason: str  # the refusing node's reason

    def __str__(self) -> str:
        return f"{self.role} {self.path}: {self.reason}"


class TreeSupportError(RuntimeError):
    """Raised once at startup with every blocker found in both backend trees."""

    def __init__(self, blockers: Sequence[Blocker]):
        self.blockers = tuple(blockers)
        lines = "\n".join(f"  - {b}" for b in self.blockers)
        super().__init__(
            f"draft trees (topk > 1) are not supported by this configuration; "
            f"{len(self.blockers)} blocker(s):\n{lines}"
        )


@dataclass(frozen=True)
class ResolvedTreeSupport:
    """Outcome of a successful resolution."""

    tree: bool  # False when topk == 1: nothing was checked because nothing tree-specific runs
    verify_paths: tuple[str, ...]  # every node asked for verify, in walk order
    lanes_paths: tuple[str, ...]  # every node asked for lanes, in walk order


def _node_name(node: TreeBackend) -> str:
    name = getattr(node, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend node {node!r} has no non-empty string `name`")
    return name


def _walk(root: TreeBackend, role: Role, blockers: list[Blocker]) -> tuple[str, ...]:
    """Asks every node under `root` for `role` once (depth first); appends refusals to `blockers`."""
    visited: list[str] = []
    seen: set[int] = set()  # a node shared by several parents (e.g. one cache group) is asked once

    def visit(node: TreeBackend, prefix: str, on_path: tuple[int, ...]):
        if not isinstance(node, TreeBackend):
            raise TypeError(
                f"{prefix or '<root>'}: child {node!r} is not a TreeBackend; every backend node "
                f"must declare tree_support()"
            )
        path = f"{prefix}/{_node_name(node)}" if prefix else _node_name(node)
        if id(node) in on_path:
            raise ValueError(f"backend tree has a cycle at {path}")
        if id(node) in seen:
            return
        seen.add(id(node))
        visited.append(path)
        support = node.tree_support()
        if not isinstance(support, TreeSupport):
            raise TypeError(f"{path}.tree_support() returned {support!r}, not a TreeSupport")
        cap = support.verify if role == "verify" else support.lanes
        if not cap.supported:
            blockers.append(Blocker(role, path, cap.reason))
        for child in node.child_backends():
            visit(child, path, on_path + (id(node),))

    visit(root, "", ())
    return tuple(visited)


def resolve_tree_support(
    verify_root: TreeBackend,
    draft_root: TreeBackend | None,
    *,
    topk: int | None = None,
) -> ResolvedTreeSupport:
    """Checks that a draft tree can run; raises `TreeSupportError` listing every blocker.

    `verify_root`: the target side (attention / linear layers, KV cache groups, sampling backend);
    every node's `verify` answer counts. `draft_root`: the drafter and its layers; every node's
    `lanes` answer counts (None: no drafter tree to check). `topk`: with 1 (a chain) nothing is
    walked and `tree=False` is returned; None means "a tree is requested".
    """
    if topk is not None and topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if topk == 1:
        return ResolvedTreeSupport(tree=False, verify_paths=(), lanes_paths=())
    blockers: list[Blocker] = []
    verify_paths = _walk(verify_root, "verify", blockers)
    lanes_paths = _walk(draft_root, "lanes", blockers) if draft_root is not None else ()
    if blockers:
        raise TreeSupportError(blockers)
    return ResolvedTreeSupport(tree=True, verify_paths=verify_paths, lanes_paths=lanes_paths)


# --------------------------------------------------------------------------------------------
# Declarative descriptor nodes
# --------------------------------------------------------------------------------------------

# KV cache dtypes a tree can run with, besides the model's own dtype. FP8 E4M3 is unscaled:
# the window kernel widens the loaded K/V to the query dtype, which changes no structure.
TREE_KV_DTYPES = ("fp8_e4m3",)
MODEL_DTYPES = ("bf16", "fp16", "fp32")
LINEAR_ATTENTION_KINDS = ("gdn", "mamba2", "kda")
SAMPLING_BACKENDS = ("greedy", "gumbel", "rejection")
DRAFTER_ALGORITHMS = ("EAGLE3", "MTP")
CACHE_GROUP_KINDS = ("full_history", "sliding_window", "chunked")


def _check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{what}={value!r} is not one of {tuple(choices)}")


@dataclass(frozen=True, eq=False)
class BackendGroup(TreeBackend):
    """A plain composite (a model's layer stack, a hybrid backend, the target side as a whole).

    It holds no tree restriction of its own and never answers for its children.
    """

    name: str  # path component, e.g. "target" or "hybrid_gdn"
    children: tuple[TreeBackend, ...] = ()  # the parts the resolver asks one by one

    def tree_support(self) -> TreeSupport:
        return TreeSupport.full()

    def child_backends(self) -> Sequence[TreeBackend]:
        return self.children


@dataclass(frozen=True, eq=False)
class CacheGroupFormatSpec(TreeBackend):
    """A KV cache group's row format (which rows it keeps, tokens per row) as the tree-support
    resolver sees it; the group's pages, buffers and layers are `cache.pools.CacheGroupSpec`.

    Tree compaction moves one slot per verify node and later reads keys by absolute position, so
    the group must keep every token's row (full history) and hold exactly one token per row.
    """

    name: str = "kv_group"  # path component
    kind: str = "full_history"  # one of CACHE_GROUP_KINDS; only full_history keeps every row
    tokens_per_row: int = 1  # tokens packed into one pool row; compaction needs exactly 1

    def __post_init__(self):
        _check_choice("cache group kind", self.kind, CACHE_GROUP_KINDS)
        if self.tokens_per_row < 1:
            raise ValueError(f"tokens_per_row must be >= 1, got {self.tokens_per_row}")

    def tree_support(self) -> TreeSupport:
        problems = []
        if self.kind != "full_history":
            problems.append(
                f"cache group kind {self.kind!r} is not full-history (tree rows are compacted by "
                f"slot and must stay addressable)"
            )
        if self.tokens_per_row != 1:
            problems.append(
                f"cache group packs {self.tokens_per_row} tokens per row (tree compaction moves "
                f"one token per row)"
            )
        if problems:
            return TreeSupport.refuse_both("; ".join(problems))
        return TreeSupport.full()


@dataclass(frozen=True, eq=False)
class AttentionLayerSpec(TreeBackend):
    """One softmax-attention layer's tree-relevant facts; its cache group is a child node.

    Sliding windows and attention sinks are per-layer facts, so they are declared here rather
    than on the backend. A target layer with a sliding window would need the window to follow
    each tree path; a draft layer is fine because lanes see the window frozen at the prefix end.
    Sinks are refused on both sides (the cascade merge has no sink term).
    """

    name: str  # path component, e.g. "layers.3"
    model_dtype: str = "bf16"  # activation / weight dtype of the model (one of MODEL_DTYPES)
    kv_dtype: str = "bf16"  # dtype of this layer's KV pool
    sliding_window: int | None = None  # window length in tokens; None = full attention
    attention_sinks: bool = False  # learned sink logits in the softmax (gpt-oss style)
    cache_group: CacheGroupFormatSpec | None = None  # pages this layer's K/V live in; None = default

    def __post_init__(self):
        _check_choice("model dtype", self.model_dtype, MODEL_DTYPES)
        _check_choice("kv dtype", self.kv_dtype, MODEL_DTYPES + TREE_KV_DTYPES)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    def tree_support(self) -> TreeSupport:
        verify: list[str] = []
        lanes: list[str] = []
        if self.kv_dtype != self.model_dtype and self.kv_dtype not in TREE_KV_DTYPES:
            why = (
                f"kv dtype {self.kv_dtype!r} is neither the model dtype {self.model_dtype!r} "
                f"nor one of {TREE_KV_DTYPES}"
            )
            verify.append(why)
            lanes.append(why)
        if self.sliding_window is not None:
            verify.append(
                f"sliding window {self.sliding_window} in a target layer (tree verify needs "
                f"full-history keys; only draft layers may slide)"
            )
        if self.attention_sinks:
            why = "attention sinks (the cascade merge has no sink term)"
            verify.append(why)
            lanes.append(why)
        return TreeSupport(
            Capability.refused("; ".join(verify)) if verify else Capability.ok(),
            Capability.refused("; ".join(lanes)) if lanes else Capability.ok(),
        )

    def child_backends(self) -> Sequence[TreeBackend]:
        return (self.cache_group,) if self.cache_group is not None else ()


@dataclass(frozen=True, eq=False)
class LinearAttentionLayerSpec(TreeBackend):
    """One linear-attention (recurrent-state) layer.

    GDN and Mamba2 verify trees by starting each node from its parent's state. KDA's verify kernel
    only follows a chain. Draft lanes have no per-lane recurrent state, so no linear-attention
    layer may sit in a drafter.
    """

    name: str  # path component, e.g. "layers.0"
    kind: str = "gdn"  # one of LINEAR_ATTENTION_KINDS

    def __post_init__(self):
        _check_choice("linear attention kind", self.kind, LINEAR_ATTENTION_KINDS)

    def tree_support(self) -> TreeSupport:
        lanes = Capability.refused(
            f"{self.kind} linear-attention layer in draft lanes (lanes keep no per-lane "
            f"recurrent state)"
        )
        if self.kind == "kda":
            verify = Capability.refused("KDA linear attention verifies chains only (topk = 1)")
        else:
            verify = Capability.ok()
        return TreeSupport(verify, lanes)


@dataclass(frozen=True, eq=False)
class SamplingBackendSpec(TreeBackend):
    """The target's sampling / acceptance backend.

    greedy and gumbel accept by the greedy walk over (keyed) draws; rejection runs recursive
    rejection sampling on the tree. A backend that can do neither sets supports_tree_verify=False
    and tree drafting is refused with it at startup.
    """

    name: str  # backend name, e.g. "gumbel"; also the path component
    supports_tree_verify: bool | None = None  # None: known for the built-in SAMPLING_BACKENDS

    def tree_support(self) -> TreeSupport:
        tree_ok = self.supports_tree_verify
        if tree_ok is None:
            if self.name not in SAMPLING_BACKENDS:
                raise ValueError(
                    f"sampling backend {self.name!r} is not built in {SAMPLING_BACKENDS}; "
                    f"declare supports_tree_verify explicitly"
                )
            tree_ok = True
        verify = (
            Capability.ok()
            if tree_ok
            else Capability.refused(f"sampling backend {self.name!r} has no tree verify")
        )
        # The sampler is not part of the drafter's lanes; it raises no lanes objection.
        return TreeSupport(verify, Capability.ok())


@dataclass(frozen=True, eq=False)
class DrafterSpec(TreeBackend):
    """The draft model: EAGLE3 or EAGLE-style MTP; its layers are children.

    EAGLE3 and single-depth MTP re-run one draft layer per step, so they can expand K lanes.
    A multi-depth MTP drafter chains several depth-specific heads and cannot branch.
    """

    name: str = "drafter"  # path component
    algorithm: str = "EAGLE3"  # one of DRAFTER_ALGORITHMS
    mtp_depth: int = 1  # number of chained MTP heads (only meaningful for MTP)
    layers: tuple[TreeBackend, ...] = ()  # the drafter's own attention / other layers

    def __post_init__(self):
        _check_choice("drafter algorithm", self.algorithm, DRAFTER_ALGORITHMS)
        if self.mtp_depth < 1:
            raise ValueError(f"mtp_depth must be >= 1, got {self.mtp_depth}")

    def tree_support(self) -> TreeSupport:
        if self.algorithm == "MTP" and self.mtp_depth > 1:
            lanes = Capability.refused(
                f"multi-depth MTP drafter (depth {self.mtp_depth}) cannot draft trees"
            )
        else:
            lanes = Capability.ok()
        return TreeSupport(Capability.ok(), lanes)

    def child_backends(self) -> Sequence[TreeBackend]:
        return self.layers



# --------------------------------------------------------------------------------------------
# From a ServeConfig: the descriptor trees check-config resolves before any model is loaded
# --------------------------------------------------------------------------------------------


def describe_backends(config) -> tuple[TreeBackend, TreeBackend | None]:
    """`(verify_root, draft_root)` descriptor trees for a `ServeConfig`'s declared facts.

    The target side holds one attention-layer node (the config declares facts per model, not per
    layer), a linear-attention node for hybrid models, and the sampling backend; the draft side
    holds the drafter with its attention layer (and a linear-attention layer if it has one).
    Once real backends exist, the engine resolves over those instead.
    """
    # Imported here: the backend nodes subclass TreeBackend, defined above in this module.
    from treespec_jax.attention.backends import attention_backend_node

    model, spec = config.model, config.speculative
    kv_group = CacheGroupFormatSpec(name="kv_group")
    target_layers: list[TreeBackend] = [
        AttentionLayerSpec(
            name="attention",
            model_dtype=model.dtype,
            kv_dtype=config.kv_dtype,
            sliding_window=model.sliding_window,
            attention_sinks=model.attention_sinks,
            cache_group=kv_group,
        )
    ]
    if model.linear_attention != "none":
        target_layers.append(LinearAttentionLayerSpec(name="linear_attention", kind=model.linear_attention))
    verify_root = BackendGroup(
        name="target",
        children=(
            attention_backend_node(config.backends.attention_backend, tuple(target_layers)),
            SamplingBackendSpec(name=config.sampling.backend),
        ),
    )
    if not spec.enabled:
        return verify_root, None
    draft_layers: list[TreeBackend] = [
        AttentionLayerSpec(
            name="attention",
            model_dtype=model.dtype,
            kv_dtype=config.kv_dtype,
            sliding_window=spec.draft_sliding_window,
            attention_sinks=spec.draft_attention_sinks,
            cache_group=CacheGroupFormatSpec(name="draft_kv_group"),
        )
    ]
    if spec.draft_linear_attention != "none":
        draft_layers.append(
            LinearAttentionLayerSpec(name="linear_attention", kind=spec.draft_linear_attention)
        )
    draft_root = DrafterSpec(
        name="drafter",
        algorithm=spec.algorithm,
        mtp_depth=spec.mtp_depth,
        layers=(attention_backend_node(config.backends.drafter_attention_backend, tuple(draft_layers)),),
    )
    return verify_root, draft_root


def check_startup(config) -> ResolvedTreeSupport:
    """Every startup refusal for a `ServeConfig` at once: its configuration rules and, for a
    tree, the capability blockers of its declared backends. Raises `ConfigError` listing both.

    Resolution runs only when the config's own choices are legal (descriptor nodes refuse unknown
    dtypes / kinds themselves, and those are already reported as config problems).
    """
    from treespec_jax.config import ConfigError  # support stays importable without config

    problems = list(config.problems())
    resolved = ResolvedTreeSupport(tree=False, verify_paths=(), lanes_paths=())
    topk = config.speculative.topk
    if config.speculative.enabled and topk > 1:
        try:
            roots = describe_backends(config)
        except ValueError:
            roots = None  # an illegal choice; config.problems() already names it
        if roots is not None:
            try:
                resolved = resolve_tree_support(*roots, topk=topk)
            except TreeSupportError as err:
                spec = config.speculative
                for b in err.blockers:
                    # The config rules already name a multi-depth MTP drafter under a tree.
                    if b.path == "drafter" and spec.algorithm == "MTP" and spec.mtp_depth > 1:
                        continue
                    problems.append(f"tree blocker: {b}")
    if problems:
        raise ConfigError(problems)
    return resolved
