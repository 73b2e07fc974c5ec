"""Attention backends as nodes of the capability tree (`treespec_jax.support`).

Each backend answers for its own kernels only; the per-layer facts that can still refuse a tree
(sliding window or sinks in a target layer, KV dtype, cache group) are its children, asked by the
resolver one by one. This module holds no kernels, so `treespec check-config` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treespec_jax.support import TreeBackend, TreeSupport


@dataclass(frozen=True, eq=False)
class CascadeBackend(TreeBackend):
    """GQA cascade: Pallas paged prefix decode + tree window kernel (`attention.cascade`).

    Verify runs R = W = N rows over the ancestor masks, lanes R = K over the (S-1)K lane window,
    both for bf16 and FP8 E4M3 pools; so this node supports both roles itself.
    """

    layers: tuple[TreeBackend, ...] = ()  # the attention layers (and their cache groups) it runs
    name: str = "cascade"  # path component

    def tree_support(self) -> TreeSupport:
        return TreeSupport.full()

    def child_backends(self) -> Sequence[TreeBackend]:
        return self.layers


@dataclass(frozen=True, eq=False)
class MlaCascadeBackend(CascadeBackend):
    """MLA cascade over the latent cache: Pallas latent decode + the same window kernel with
    ROPE_DIM > 0 (`attention.mla`); verify and lanes like the GQA cascade."""

    name: str = "mla_cascade"


@dataclass(frozen=True, eq=False)
class DenseBackend(CascadeBackend):
    """fp32 dense masked attention over the gathered pages (`models.attention`, kind "dense"):
    the reference the kernel path is tested against; verify and lanes by construction."""

    name: str = "dense"


# `--attention-backend` / `--drafter-attention-backend` choices -> backend node class. "auto" is
# the GQA cascade until model configs say which attention a model has.
ATTENTION_BACKEND_NODES: dict[str, type[CascadeBackend]] = {
    "auto": CascadeBackend,
    "cascade": CascadeBackend,
    "mla_cascade": MlaCascadeBackend,
    "dense": DenseBackend,
}


def attention_backend_node(choice: str, layers: tuple[TreeBackend, ...]) -> CascadeBackend:
    """The backend node for a config choice, holding `layers` as its children."""
    try:
        cls = ATTENTION_BACKEND_NODES[choice]
    except KeyError:
        raise ValueError(f"attention backend {choice!r} is not one of {sorted(ATTENTION_BACKEND_NODES)}") from None
    return cls(layers=layers)
