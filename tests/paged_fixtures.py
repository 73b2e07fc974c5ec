"""Shared fixtures of the attention tests: poisoned paged pools and relative error."""

import jax.numpy as jnp
import numpy as np


def poisoned_paged_pools(rng, batch, max_len, hkv, width, page, dtype, live_fn, spare_pages=2):
    """Random slot-major K/V pools `[num_pages * page, hkv, width]` and a random page table.

    Every slot for which `live_fn(b, pos)` is False, and every page no request owns
    (`spare_pages` of them), holds NaN / +inf / -inf in turn, so any stray read shows up.
    """
    per_req = -(-max_len // page)
    num_pages = batch * per_req + spare_pages
    table = rng.permutation(num_pages)[: batch * per_req].reshape(batch, per_req)
    k = rng.standard_normal((num_pages * page, hkv, width)).astype(np.float32)
    v = rng.standard_normal((num_pages * page, hkv, width)).astype(np.float32)
    live = np.zeros(num_pages * page, bool)
    for b in range(batch):
        for pos in range(per_req * page):
            if live_fn(b, pos):
                live[table[b, pos // page] * page + pos % page] = True
    bad = np.array([np.nan, np.inf, -np.inf], np.float32)[np.arange(live.size) % 3]
    k[~live] = bad[~live, None, None]
    v[~live] = bad[~live, None, None]
    return jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype), jnp.asarray(table, jnp.int32)


# A compiled kernel multiplies fp32 operands on the tensor cores in TF32 (Mosaic GPU's WGMMA has no
# fp32 form; Triton's dot takes TF32 by default): the operands keep 10 mantissa bits, so its fp32
# output agrees with the HIGHEST-precision reference to about 1e-3 relative (at most 4e-4 on the
# H200) and its LSE to about 1e-3 absolute, not to fp32 rounding. Interpreted, it is fp32 throughout.
TF32_REL_TOL = 2e-3
TF32_LSE_TOL = 5e-3


def fp32_tol(backend, interpreted: float, compiled: float = TF32_REL_TOL) -> float:
    """The tolerance of an fp32 kernel check: `interpreted` when `backend` (a backend name, or the
    `interpret` flag) runs the kernel interpreted or as the reference, else the TF32 one."""
    return interpreted if backend is True or backend in ("interpret", "reference") else compiled


def verify_case(rng, lengths, rows, hkv, group, width, page, dtype, q_dtype=None):
    """A poisoned verify problem: pools live at positions < P + rows, random tree masks over `rows`.

    Returns `(q [B, rows, Hkv * group, width], k_pool, v_pool, page_table, lengths [B] int32,
    mask [B, rows, 2] uint32)`; q is `q_dtype` (default `dtype`).
    """
    from treespec_jax.tree.masks import ancestor_mask
    from trees import random_parents

    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    k, v, table = poisoned_paged_pools(rng, b, int(lengths.max()) + rows, hkv, width, page, dtype,
                                       lambda bb, pos: pos < lengths[bb] + rows)
    q = jnp.asarray(rng.standard_normal((b, rows, hkv * group, width)), q_dtype or dtype)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, rows)))
    return q, k, v, table, jnp.asarray(lengths), mask


def schedule_options(spec: str):
    """"seesaw+no_p_in_ring" -> ("seesaw", {"p_in_ring": False}); "seesaw+p_in_ring" -> (..., True);
    a bare schedule -> (schedule, {}): the Mosaic MLA decode's schedule and one kernel option."""
    schedule, _, option = spec.partition("+")
    if not option:
        return schedule, {}
    name = option.removeprefix("no_")
    return schedule, {name: name == option}


def attention_triton_calls(text: str) -> int:
    """Triton kernels a lowered module calls, split merges (`split_merge`, run wherever a decode
    splits its keys) not counted: which attention halves lowered to Triton."""
    calls = [line for line in text.splitlines() if "@__gpu$xla.gpu.triton" in line]
    return sum('name = "merge_splits"' not in line for line in calls)
