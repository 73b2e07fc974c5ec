"""Tensor parallelism: the engine's models over a `jax.sharding.Mesh` with one axis, "tp".

The layout is the Megatron one, expressed as `NamedSharding`s on the parameter pytree and left
to XLA's SPMD partitioner for every jnp part of the forward:

- column-parallel `wq / wk / wv` (and their biases) on their output dim: with T dividing the KV
  heads (hence the query heads), shard t holds query heads [t Hq/T, (t+1) Hq/T) and exactly the
  KV heads they read, so GQA stays local; `w_gate / w_up` likewise on the MLP columns; the fused
  `wqkv / w_gate_up` that the engine serves with split the same way (their column order keeps
  each KV head's group and each gate, up pair together);
- row-parallel `wo / w_down` on their input dim: one all-reduce after attention and one after
  the MLP per layer;
- the embedding and the LM head by vocabulary (the lookup and the logits are partitioned);
- norms, q/k norms (per head dim), EAGLE-3's `fc`, MTP's `eh_proj` and the d2t map replicated;
- the paged KV pools `[slots, Hkv, D]` by KV head (`P(None, "tp", None)`).

The Pallas kernels are custom calls the partitioner cannot split, so they run under
`jax.shard_map` on their local shards: attention (`attend_sharded`, every mode, q on heads,
pools on KV heads) and the KV row moves of compaction (`ShardedRound.compact_stage`).

One agreed path: the accepted path is a discrete decision every device must take identically,
or the shards' pools, lengths and next trees drift apart. `ShardedRound` computes it once per
step from replicated inputs under `shard_map` and broadcasts shard 0's result (`agree`), so
compaction, commit and the next round's tree all use that one copy even where the devices'
copies of the logits differ in the last bit (a reduction order, a nondeterministic all-reduce).
Greedy decoding reduces shard-local argmaxes instead of gathering the logits; the sampling
backends gather them. The drafted tree is agreed the same way.

Multi-host: `make_mesh` takes `jax.devices()` (global), so after `jax.distributed.initialize()`
the same code places params and pools over every host's devices. What needs care there: every
process must build the engine with identical params and feed identical requests in the same
order (the host-side scheduler and the request data are replicated, not sharded), params must be
placed from process-local copies (`jax.make_array_from_process_local_data`, or loading each
host's shards directly) instead of one host's `device_put`, and the host reads of `StepOutput`
rely on its arrays being fully replicated.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "tp"

# Parameter leaves by name: column-parallel (output dim), row-parallel (input dim), vocabulary.
# `wqkv` / `w_gate_up` are the fused layout (`models.llama.fuse_projections`): their columns are
# grouped per KV head / interleaved gate, up pairs, so a column shard of whole groups / pairs is the
# same split as the separate weights'.
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "wqkv", "w_gate_up")
BIAS = ("bq", "bk", "bv", "bqkv")
ROW = ("wo", "w_down")
EMBED = ("embed",)
HEAD = ("lm_head", "lm_head_target")
KV_POOL = P(None, AXIS, None)


def make_mesh(tp_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ("tp") mesh over the first `tp_size` of `devices` (default: `jax.devices()`,
    every process's devices under `jax.distributed`)."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= tp_size <= len(devices):
        raise ValueError(f"tp_size={tp_size} needs 1 <= tp_size <= {len(devices)} devices")
    return Mesh(np.array(devices[:tp_size]), (AXIS,))


def tp_size_of(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[AXIS])


def _head_cfg(drafter):
    """The drafter's attention config (a head's layer config, or its whole model's), or None."""
    if drafter is None:
        return None
    cfg = getattr(drafter, "head_cfg", None)
    if cfg is None and hasattr(drafter, "model"):
        cfg = getattr(drafter.model, "cfg", None)
    return cfg


def tp_problems(tp_size: int, target_cfg, drafter=None, devices: Sequence | None = None) -> list[str]:
    """Every reason `tp_size` cannot place this target and drafter, naming the values."""
    if tp_size == 1:
        return []
    out = []
    count = len(jax.devices() if devices is None else devices)
    if tp_size > count:
        out.append(f"tp_size={tp_size} exceeds the {count} devices available")
    for name, cfg in (("target", target_cfg), ("drafter", _head_cfg(drafter))):
        if cfg is None:
            continue
        for what, heads in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads)):
            if heads % tp_size:
                out.append(f"tp_size={tp_size} does not divide the {name}'s {what}={heads} "
                           "(attention heads are sharded across devices)")
    if drafter is not None and _head_cfg(drafter) is None:
        out.append(f"tp_size={tp_size}: the drafter {type(drafter).__name__} has no head config to place")
    return out


def _leaf_spec(name: str, shape: tuple[int, ...], t: int) -> P:
    """PartitionSpec of one parameter leaf; a dim that T does not divide stays replicated."""
    def on(dim):
        if len(shape) <= dim or shape[dim] % t:
            return P()
        return P(*([None] * dim + [AXIS] + [None] * (len(shape) - dim - 1)))

    if name == "w_gate_up" and len(shape) == 2 and shape[1] % (2 * t):
        return P()  # a shard would split a gate, up pair
    if name in COLUMN and len(shape) == 2:
        return on(1)
    if name in BIAS and len(shape) == 1:
        return on(0)
    if name in ROW and len(shape) == 2:
        return on(0)
    if name in EMBED and len(shape) == 2:
        return on(0)
    if name in HEAD and len(shape) == 2:
        return on(1)
    return P()


def param_specs(params, tp_size: int):
    """The PartitionSpec pytree of a params dict (target, EAGLE-3 / MTP head or a whole drafter
    model), matched by leaf name. Head alignment: column shards of wq / wk / wv are whole heads
    when T divides the head counts (`tp_problems` refuses otherwise). A row-parallel weight is
    sharded only together with its column-parallel partners, so an MLP whose width T does not
    divide stays wholly replicated rather than half sharded."""
    def walk(tree):
        if not isinstance(tree, dict):
            return P()
        out = {k: walk(v) if isinstance(v, dict) else _leaf_spec(k, tuple(np.shape(v)), tp_size)
               for k, v in tree.items()}
        if "w_down" in out and P() in (out.get(k) for k in ("w_gate", "w_up", "w_gate_up") if k in out):
            out.update({k: P() for k in ("w_gate", "w_up", "w_gate_up", "w_down") if k in out})
        if "wo" in out and P() in (out.get(k) for k in ("wq", "wqkv") if k in out):
            out.update({k: P() for k in ("wq", "wk", "wv", "wqkv", "wo", "bq", "bk", "bv", "bqkv") if k in out})
        return out

    return walk(params)


def param_shardings(cfg, params, mesh: Mesh):
    """NamedSharding per leaf of `params` (see module docstring). `cfg` (LlamaConfig or None) is
    checked for head divisibility."""
    t = tp_size_of(mesh)
    if cfg is not None:
        bad = tp_problems(t, cfg, devices=list(mesh.devices.flat))
        if bad:
            raise ValueError("; ".join(bad))
    specs = param_specs(params, t)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def pool_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """A paged pool `[slots, Hkv, D]` by KV head; anything else replicated."""
    if len(shape) == 3 and shape[1] % tp_size_of(mesh) == 0:
        return NamedSharding(mesh, KV_POOL)
    return NamedSharding(mesh, P())


# ---- collectives under shard_map -------------------------------------------------------------

def _owner_broadcast(x):
    """Shard 0's copy of `x` on every shard: an all-gather read at index 0 (exact for every
    dtype, unlike a masked psum of floats)."""
    return jax.lax.all_gather(x, AXIS)[0]


def agree(fn, mesh: Mesh):
    """`fn` run on every shard from replicated inputs, its outputs replaced by shard 0's: one
    agreed result, identical on every device whatever the devices' inputs were."""
    def body(*args):
        return jax.tree.map(_owner_broadcast, fn(*args))

    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def sharded_argmax(logits: jax.Array, mesh: Mesh) -> jax.Array:
    """`argmax(logits, -1)` with the vocabulary sharded: each shard's local argmax and maximum,
    reduced over shards; ties go to the lowest id as `jnp.argmax` does. Moves `[T, ...]` values
    instead of the whole logits."""
    t = tp_size_of(mesh)
    v = logits.shape[-1]
    if v % t:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    spec = P(*([None] * (logits.ndim - 1) + [AXIS]))

    def body(local):
        idx = jnp.argmax(local, axis=-1).astype(jnp.int32)
        best = jnp.max(local, axis=-1)
        idx = idx + jax.lax.axis_index(AXIS).astype(jnp.int32) * local.shape[-1]
        vals = jax.lax.all_gather(best, AXIS)  # [T, ...], shard order = vocabulary order
        ids = jax.lax.all_gather(idx, AXIS)
        winner = jnp.argmax(vals, axis=0)  # first shard holding the maximum
        return jnp.take_along_axis(ids, winner[None], axis=0)[0]

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)(logits)


def attend_sharded(attention, mesh: Mesh, q, k_pool, v_pool, batch):
    """`attention.attend` per device on its local heads: `q [B, T, Hq, D]` on heads, pools
    `[S, Hkv, D]` on KV heads, the batch (positions, slots, page table, masks) replicated."""
    heads = P(None, None, AXIS, None)
    fn = jax.shard_map(lambda q_, k_, v_, b_: attention.attend(q_, k_, v_, b_), mesh=mesh,
                       in_specs=(heads, KV_POOL, KV_POOL, P()), out_specs=heads, check_vma=False)
    return fn(q, k_pool, v_pool, batch)


# ---- the engine's pieces ---------------------------------------------------------------------

def with_attention(drafter, attention):
    """A shallow copy of `drafter` whose attention (its own, its model's, its flax modules') is
    `attention`, so the drafter's layers run sharded like the target's."""
    from flax import linen as nn

    from treespec_jax.models.attention import PagedAttention
    from treespec_jax.models.llama import LlamaModel

    if drafter is None:
        return None
    out = copy.copy(drafter)
    for name, value in vars(drafter).items():
        if isinstance(value, PagedAttention):
            setattr(out, name, attention)
        elif isinstance(value, LlamaModel):
            setattr(out, name, LlamaModel(value.cfg, attention, value.feature_layers, value.norm_kernel,
                                          value.rope_kernel))
        elif isinstance(value, nn.Module) and isinstance(getattr(value, "attention", None), PagedAttention):
            setattr(out, name, value.clone(attention=attention))
    return out


class Placement:
    """Where the engine's arrays live on `mesh`: params by `param_shardings`, pools by KV head,
    everything else of a `DecodeState` replicated."""

    def __init__(self, mesh: Mesh, target_cfg=None):
        self.mesh = mesh
        self.target_cfg = target_cfg
        self.replicated = NamedSharding(mesh, P())

    def params(self, params: dict) -> dict:
        """`{"target": ..., "draft": ...}` placed (a None entry stays None)."""
        out = {}
        for key, tree in params.items():
            if tree is None:
                out[key] = None
                continue
            cfg = self.target_cfg if key == "target" else None
            out[key] = jax.device_put(tree, param_shardings(cfg, tree, self.mesh))
        return out

    def state_shardings(self, state):
        pools = lambda d: {k: pool_sharding(self.mesh, v.shape) for k, v in d.items()}
        rest = jax.tree.map(lambda _: self.replicated, state.replace(target_pools={}, draft_pools={}))
        return rest.replace(target_pools=pools(state.target_pools), draft_pools=pools(state.draft_pools))

    def state(self, state):
        return jax.device_put(state, self.state_shardings(state))

    def constrain(self, state):
        """Inside jit: the state keeps its placement across steps (no resharding, no recompile)."""
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    def keep(self, fn):
        """`fn` whose `DecodeState` outputs (the result itself or the first of a tuple) are constrained."""
        from treespec_jax.engine.round import DecodeState

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            if isinstance(out, DecodeState):
                return self.constrain(out)
            if isinstance(out, tuple) and out and isinstance(out[0], DecodeState):
                return (self.constrain(out[0]),) + out[1:]
            return out

        return wrapped


def local_router(router, tp_size: int):
    """The compaction router of one shard: every KV buffer's row `[Hkv, D]` as `[Hkv / T, D]`."""
    import dataclasses

    from treespec_jax.cache.routing import CompactionRouter

    def local(buf):
        row = buf.row_shape
        if len(row) == 2 and row[0] % tp_size == 0:
            row = (row[0] // tp_size,) + row[1:]
        return dataclasses.replace(buf, row_shape=row)

    return CompactionRouter([dataclasses.replace(g, buffers=tuple(local(b) for b in g.buffers))
                             for g in router.groups])


def sharded_round_class():
    """`ShardedRound`, defined lazily so this module imports without the engine."""
    from treespec_jax.engine import sampler
    from treespec_jax.engine.round import Round
    from treespec_jax.tree.verify import greedy_walk

    class ShardedRound(Round):
        """`Round` over a mesh: an agreed walk and tree, compaction on local KV heads."""

        def __init__(self, *args, mesh: Mesh, **kwargs):
            super().__init__(*args, **kwargs)
            self.mesh = mesh
            # Under shard_map each device moves rows of its own KV heads: the router's shape
            # checks see the local row [Hkv / T, D].
            self.local_router = local_router(self.router, tp_size_of(mesh))

        def walk_stage(self, spec, logits, state, draw="auto"):
            if self.shape.sampler == "greedy":
                predicts = sharded_argmax(logits, self.mesh)
                return agree(greedy_walk, self.mesh)(state.tree_tokens, spec.parents, predicts)
            return agree(lambda s, lg, st: sampler.accept(self.shape.sampler, lg, st.tree_tokens, s.parents,
                                                          s.depths, st.seeds, st.lengths, st.sampling, draw),
                         self.mesh)(spec, logits, state)

        def compact_stage(self, spec, path, pools, features, positions, state):
            if self.shape.num_nodes == 1:
                return pools, features
            specs = {k: KV_POOL if v.ndim == 3 and v.shape[1] % tp_size_of(self.mesh) == 0 else P()
                     for k, v in pools.items()}
            local = copy.copy(self)
            local.router = self.local_router
            fn = jax.shard_map(lambda *a: Round.compact_stage(local, *a), mesh=self.mesh,
                               in_specs=(P(), P(), specs, P(), P(), P()), out_specs=(specs, P()), check_vma=False)
            return fn(spec, path, pools, features, positions, state)

        def draft_stage(self, params, state, path, features, roots):
            pools, tokens, parents = super().draft_stage(params, state, path, features, roots)
            tokens, parents = agree(lambda a, b: (a, b), self.mesh)(tokens, parents)
            return pools, tokens, parents

    return ShardedRound
