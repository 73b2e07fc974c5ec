"""`Engine`: models, drafter, pools and the jitted round behind `decode` and `stream`.

Construction resolves everything that can refuse a run before any pool is allocated: the
config's rules and tree-capability blockers (`support.check_startup`), then the facts only the
models know (head sizes the kernels need, drafter / target fit, context against the page table),
all reported together as one `ConfigError`.

`decode(requests)` runs continuous batching over B static slots: a request joins when a slot
and its pages are free (prefill runs as its own steps, never mixed into a decode batch; the
requests admitted together prefill together, `prefill_rows` at a time, and while others decode
admissions wait for `min_prefill_group` free slots), the
jitted round advances every running request, and the host reads one `StepOutput` per step,
appends the committed tokens, and finishes requests on max_new_tokens, stop tokens / strings or
EOS, releasing their slot and pages. The next step is launched before the host reads the last
one, so the host's work overlaps the device's; a finished request's slot thus runs one step more,
whose tokens are dropped. `stream(requests)` yields text as it commits.

The target's params may come in either layout of `models.config`; the engine keeps its own
fused copy of the q/k/v and gate/up weights (`fuse_projections`), so a caller that keeps its
separate ones holds both (drop them, or pass params already fused, to hold one).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import on_gpu
from treespec_jax.cache.pools import BufferSpec, CacheGroupSpec, LayerKV
from treespec_jax.cache.routing import CompactionRouter
from treespec_jax.config import MAX_SEED, ConfigError, ServeConfig
from treespec_jax.drafter.base import Drafter
from treespec_jax.engine.compile_options import step_compiler_options
from treespec_jax.engine.loading import attention_for, attention_kind
from treespec_jax.engine.round import DecodeState, Round, RoundShape, StepOutput, bootstrap_tree
from treespec_jax.engine.scheduler import PageAllocator, pages_needed, pool_pages, table_row
from treespec_jax.engine.stats import RequestStats, RunStats
from treespec_jax.models.config import LlamaConfig
from treespec_jax.models.llama import LlamaModel, fuse_projections, kv_buffer_names
from treespec_jax.sampling.keyed import DRAWS, SamplingParams, draw_for, sample_at

KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn"}
FINISH_REASONS = ("length", "stop", "eos", "refused")


@dataclasses.dataclass
class Request:
    """One generation request. Sampling fields left None take the config's defaults."""

    prompt: str | Sequence[int] | None = None  # text (tokenized) or token ids
    messages: Sequence[dict] | None = None  # chat messages, rendered with the chat template
    max_new_tokens: int = 128  # generated tokens at most
    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 / -1 = off
    top_p: float | None = None  # 1 = off
    seed: int | None = None  # keyed-sampling seed; None = the config's seed
    stop: Sequence[str] = ()  # stop strings (the text ends before the first one)
    stop_token_ids: Sequence[int] = ()  # tokens that end the reply (kept in tokens, not in text)
    ignore_eos: bool = False  # do not stop at the model's EOS tokens


@dataclasses.dataclass
class Completion:
    """The result of one request."""

    tokens: list[int]  # generated token ids
    text: str  # detokenized reply ("" without a tokenizer)
    finish_reason: str  # one of FINISH_REASONS
    prompt_tokens: int  # prompt length in tokens
    stats: RequestStats  # acceptance of this request's rounds
    error: str | None = None  # why a refused request was refused


@dataclasses.dataclass
class StreamEvent:
    """A piece of one request's output as it commits."""

    index: int  # the request's position in the list passed to stream()
    text: str  # newly committed text
    tokens: list[int]  # newly committed tokens
    finished: Completion | None = None  # set on the request's last event


@dataclasses.dataclass(frozen=True)
class ProgramCompile:
    """One program `Engine.compile` built: which, and where its seconds went."""

    name: str  # e.g. "step[argmax]", "prefill[rows=8]"
    lower_s: float  # tracing and lowering to StableHLO
    compile_s: float  # XLA's compile, its autotuning on the device included


@dataclasses.dataclass
class _Running:
    index: int
    request: Request
    prompt: list[int]
    pages: list[int]
    limit: int
    stops: frozenset
    tokens: list[int] = dataclasses.field(default_factory=list)
    stats: RequestStats = None
    emitted_text: str = ""
    finish: str | None = None
    # The reply's text so far, decoded a few tokens at a time (None without a tokenizer): the host
    # never re-decodes a whole reply per step.
    detok: Any = None
    # The finished reply's text, decoded once: both the last stream event and the completion use it.
    final_text: str | None = None
    # What drawing this request's tokens needs computed (`sampling.keyed.DRAWS`); a step computes
    # what its most demanding running request needs.
    draw: str = "auto"


def _kv_dtype(config: ServeConfig) -> str:
    return KV_DTYPES[config.kv_dtype]


def _token_bytes(config: ServeConfig, target_cfg: LlamaConfig, drafter: Drafter | None) -> int:
    """KV bytes one token position takes across every pool: the target's K and V of each layer,
    and the drafter's buffers (`Drafter.pool_specs`)."""
    item = jnp.dtype(_kv_dtype(config)).itemsize
    rows = [(target_cfg.num_kv_heads, target_cfg.head_dim)] * (2 * target_cfg.num_layers)
    if drafter is not None:
        rows += [row for row, _ in drafter.pool_specs().values()]
    return item * sum(int(np.prod(row)) for row in rows)


def _nbytes(*trees) -> int:
    """Bytes of the arrays in `trees`, each array once (the drafter shares the target's embedding)."""
    unique = {id(x): x for x in jax.tree.leaves(trees)}
    return sum(int(getattr(x, "nbytes", 0)) for x in unique.values())


def _device_bytes(devices: Sequence[jax.Device] | None) -> int | None:
    """The memory the first device lets JAX allocate (`memory_stats()["bytes_limit"]`), or None
    where it reports none (a CPU)."""
    stats = _first_device(devices).memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _first_device(devices: Sequence[jax.Device] | None) -> jax.Device:
    """The engine's first device: of `devices`, else JAX's default ones."""
    return (list(devices) if devices else jax.devices())[0]


def _completes_stop(text: str, seen: int, stops: Sequence[str]) -> bool:
    """Whether a stop string occurs in `text` ending past its first `seen` characters."""
    return any(s and text.find(s, max(0, seen - len(s) + 1)) >= 0 for s in stops)


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """The longest end of `text` that begins some stop string (0 when none does)."""
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
               default=0)


def move_backend_for(attention) -> str | None:
    """Backend of the round's row moves (KV compaction, feature rows): the attention's kernel
    backend, except that the dense attention off a GPU moves rows with XLA's gather / scatter
    (`move_rows_reference`, the same rows bit for bit) instead of interpreting the Pallas kernel,
    which there re-writes every pool once per request and costs seconds a round on a CPU. An
    explicit "interpret" or "reference" is kept."""
    if attention.kind == "dense" and attention.kernel_backend is None and not on_gpu():
        return "reference"
    return attention.kernel_backend


def _head_dim_problems(name: str, cfg, kind: str) -> list[str]:
    d = cfg.head_dim
    if kind == "cascade" and (d < 16 or d & (d - 1)):
        return [f"{name} head_dim {d}: the cascade kernels need a power of two >= 16 (use --attention-backend dense)"]
    return []


class Engine:
    """Serving engine over one target and an optional drafter (see module docstring)."""

    def __init__(self, config: ServeConfig, target_cfg: LlamaConfig, target_params: dict,
                 drafter: Drafter | None = None, draft_params: dict | None = None, tokenizer: Any = None,
                 devices: Sequence[jax.Device] | None = None):
        from treespec_jax import parallel
        from treespec_jax.support import check_startup

        problems: list[str] = []
        try:
            check_startup(config)
        except ConfigError as err:
            problems += err.problems
        sp = config.speculative
        kind = attention_kind(config)
        problems += _head_dim_problems("target", target_cfg, kind)
        if sp.enabled and drafter is None:
            problems.append(f"speculative algorithm {sp.algorithm} needs a drafter (a draft model directory)")
        if not sp.enabled and drafter is not None:
            problems.append("a drafter was given but the speculative algorithm is NONE")
        if drafter is not None and hasattr(drafter, "head_cfg"):
            problems += _head_dim_problems("drafter", drafter.head_cfg, kind)
        problems += parallel.tp_problems(config.parallel.tp_size, target_cfg, drafter, devices)
        context = config.model.context_length or target_cfg.max_position_embeddings
        if context > target_cfg.max_position_embeddings:
            problems.append(f"context_length {context} exceeds the model's {target_cfg.max_position_embeddings}")
        if config.sampling.backend == "greedy" and config.sampling.temperature != 0:
            problems.append(f"sampling backend greedy needs temperature 0, the default is {config.sampling.temperature}")
        slots = config.scheduler.max_running_requests
        num_nodes = sp.verify_tokens if sp.enabled else 1
        table_width = pages_needed(context, num_nodes, config.kv_cache.page_size)
        # Under tensor parallelism on GPUs the pools and weights are sharded: sized in full. A CPU's
        # devices all share the host's memory, so its budget holds with or without parallelism.
        device_bytes = _device_bytes(devices) if config.parallel.tp_size == 1 else None
        on_host = _first_device(devices).platform == "cpu"
        host_kv_bytes = int(config.kv_cache.host_kv_gib * 2 ** 30) if on_host and device_bytes is None else None
        num_pages, pool_problems = pool_pages(
            slots=slots, table_width=table_width, page_size=config.kv_cache.page_size,
            page_bytes=config.kv_cache.page_size * _token_bytes(config, target_cfg, drafter),
            max_total_tokens=config.kv_cache.max_total_tokens, mem_fraction=config.kv_cache.mem_fraction_static,
            weight_bytes=_nbytes(target_params, draft_params), device_bytes=device_bytes, host_kv_bytes=host_kv_bytes)
        problems += pool_problems
        if problems:
            raise ConfigError(problems)

        self.config = config
        self.tokenizer = tokenizer
        self.target_cfg = target_cfg
        self.num_nodes = num_nodes
        # Each draft step adds one tree level: no accepted path is deeper than S.
        self.max_depth = min(sp.steps, self.num_nodes - 1) if sp.enabled else 0
        self.page_size = config.kv_cache.page_size
        self.slots = slots
        self.context = context
        self.table_width = table_width
        self.num_pages = num_pages
        self.chunk = min(config.scheduler.chunked_prefill_size, 256)
        # Requests prefilled in one batch, at most: as many chunks as the prefill token budget holds,
        # at most the slots. A batch's rows are padded to a power of two (padding rows prefill
        # nothing): a few compiled shapes, and a lone admission does not pay for a full batch.
        self.prefill_rows = max(1, min(self.slots, config.scheduler.chunked_prefill_size // self.chunk))
        # While others decode, admissions wait for this many free slots: under churn (one request
        # finishing every step or two) they would otherwise prefill one or two at a time, and at
        # B = 256 such groups took most of the run (RESULTS.md, e2e).
        self.min_prefill_group = config.scheduler.min_prefill_group or max(1, self.slots // 8)

        self.attention = attention_for(config)
        backend = move_backend_for(self.attention)
        if drafter is not None and getattr(drafter, "attention", self.attention) != self.attention:
            raise ConfigError([f"drafter attention {drafter.attention} differs from the target's {self.attention}"])
        # Tensor parallelism (`treespec_jax.parallel`): a "tp" mesh, attention under shard_map in
        # target and drafter alike, params and pools placed by their shardings, an agreed walk.
        mesh = parallel.make_mesh(config.parallel.tp_size, devices) if config.parallel.tp_size > 1 else None
        self.mesh = mesh
        self.placement = parallel.Placement(mesh, target_cfg) if mesh is not None else None
        if mesh is not None:
            self.attention = dataclasses.replace(self.attention, mesh=mesh)
            drafter = parallel.with_attention(drafter, self.attention)
        feature_layers = drafter.feature_layers if drafter is not None else ()
        self.target = LlamaModel(target_cfg, self.attention, feature_layers, config.backends.norm_kernel,
                                 config.backends.rope_kernel)
        self.drafter = drafter
        # The target serves with fused q/k/v and gate/up projections (`fuse_projections`: fewer,
        # wider matmuls read its weights nearer copy bandwidth at decode batch sizes), and a
        # drafter with its own serving layout (`Drafter.serving_params`: the EAGLE-3 head fuses too).
        if drafter is not None and draft_params is not None:
            draft_params = drafter.serving_params(draft_params)
        self.params = {"target": fuse_projections(target_params, target_cfg), "draft": draft_params}
        if self.placement is not None:
            self.params = self.placement.params(self.params)
        names = kv_buffer_names(target_cfg.num_layers)
        dtype = _kv_dtype(config)
        row = (target_cfg.num_kv_heads, target_cfg.head_dim)
        self.group = CacheGroupSpec(
            "target", self.page_size, num_pages,
            tuple(BufferSpec(n, row, dtype) for kv in names for n in kv),
            tuple(LayerKV(i, k, v) for i, (k, v) in enumerate(names)))
        self.router = CompactionRouter([self.group])
        def make_round(shape: RoundShape) -> Round:
            if mesh is None:
                return Round(self.target, drafter, shape, self.router, move_backend=backend)
            return parallel.sharded_round_class()(self.target, drafter, shape, self.router, move_backend=backend,
                                                  mesh=mesh)

        self.round = make_round(RoundShape(self.num_nodes, sp.topk, sp.steps, config.sampling.backend))
        # Under load a round may verify a chain instead (`speculative.chain_above_batch`): a step
        # verifies every running request's tree, so at large batches a wide tree's verify costs
        # more than its extra accepted tokens bring (RESULTS.md, e2e).
        self.chain_above = sp.chain_above_batch
        self.chain_round = (make_round(RoundShape(sp.steps + 1, 1, sp.steps, config.sampling.backend))
                            if self.chain_above is not None else None)
        self.state = self._fresh_state()
        keep = self.placement.keep if self.placement is not None else (lambda fn: fn)
        if self.placement is not None:
            self.state = self.placement.state(self.state)
        self.allocator = PageAllocator(num_pages)
        # Only the decode step runs often enough for its launch gaps to matter (`compile_options`).
        def jit_step(round_: Round):
            return jax.jit(keep(round_.step), donate_argnums=(1,), static_argnames=("draw",),
                           compiler_options=step_compiler_options(config))

        self._step = jit_step(self.round)
        self._chain_step = jit_step(self.chain_round) if self.chain_round is not None else None
        self._prefill = jax.jit(keep(self._prefill_chunk), donate_argnums=(1,))
        self._draft_prefill = jax.jit(keep(self._draft_prefill_chunk), donate_argnums=(1,))
        self._admit = jax.jit(keep(self._admit_slots), donate_argnums=(0,))
        self._release = jax.jit(keep(self._release_slot), donate_argnums=(0,))

        def first_token(logits, seeds, positions, params, draw):
            fn = functools.partial(sample_at, draw=draw)
            return (fn if mesh is None else parallel.agree(fn, mesh))(logits, seeds, positions, params)

        self._first_token = jax.jit(first_token, static_argnames=("draw",))
        self.last_run: RunStats | None = None
        # Each program the last `compile` call built, in the order they finished.
        self.last_compile: tuple[ProgramCompile, ...] = ()

    # ---- construction from checkpoints -------------------------------------------------

    @classmethod
    def from_pretrained(cls, target_dir, draft_dir=None, config: ServeConfig | None = None) -> "Engine":
        """Loads an HF-layout (or GGUF) target and an EAGLE-3 head; `config` defaults to a
        chain-free plain decode unless a draft directory is given (then EAGLE-3, K=4, S=5, N=16)."""
        from treespec_jax.engine.loading import load_pair

        return load_pair(cls, target_dir, draft_dir, config)

    # ---- state ---------------------------------------------------------------------------

    def _fresh_state(self) -> DecodeState:
        b, n = self.slots, self.num_nodes
        pools = {buf.name: jnp.zeros(self.group.pool_shape(buf.name), jnp.dtype(buf.dtype)) for buf in self.group.buffers}
        draft_pools = {}
        if self.drafter is not None:
            dtype = _kv_dtype(self.config)
            slots = self.num_pages * self.page_size
            draft_pools = {name: jnp.zeros((slots,) + row, jnp.dtype(dtype))
                           for name, (row, _) in self.drafter.pool_specs().items()}
        tokens, parents = bootstrap_tree(jnp.zeros((b,), jnp.int32), n)
        return DecodeState(
            target_pools=pools, draft_pools=draft_pools, page_table=jnp.zeros((b, self.table_width), jnp.int32),
            lengths=jnp.zeros((b,), jnp.int32), tree_tokens=tokens, tree_parents=parents,
            active=jnp.zeros((b,), bool), seeds=jnp.zeros((b,), jnp.int32),
            sampling=SamplingParams(jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32)))

    def _prefill_chunk(self, params, state: DecodeState, tokens, table, start, valid):
        logits, features, pools = self.target.prefill(params["target"], state.target_pools, tokens, table, start, valid)
        return state.replace(target_pools=pools), logits[:, 0], features

    def _draft_prefill_chunk(self, params, state: DecodeState, tokens, next_tokens, features, table, start, valid):
        pools = self.drafter.prefill(params["draft"], dict(state.draft_pools), tokens, next_tokens, features, table,
                                     start, valid)
        return state.replace(draft_pools=pools)

    def _admit_slots(self, state: DecodeState, slots, rows, lengths, roots, seeds, sampling: SamplingParams):
        """A prefill group's requests into their slots, one program for the group: `slots [R]`
        (rows past the group name slot B, out of range, and are dropped), `rows [R, W]` page
        tables, `lengths / roots / seeds [R]`, `sampling` per row."""
        tokens, parents = bootstrap_tree(roots, self.num_nodes)
        put = lambda a, v: a.at[slots].set(v.astype(a.dtype), mode="drop")  # noqa: E731
        sp = state.sampling
        return state.replace(
            page_table=put(state.page_table, rows), lengths=put(state.lengths, lengths),
            tree_tokens=put(state.tree_tokens, tokens), tree_parents=put(state.tree_parents, parents),
            active=put(state.active, jnp.ones(slots.shape, bool)), seeds=put(state.seeds, seeds),
            sampling=SamplingParams(put(sp.temperature, sampling.temperature), put(sp.top_k, sampling.top_k),
                                    put(sp.top_p, sampling.top_p)))

    def _release_slot(self, state: DecodeState, slot):
        return state.replace(page_table=state.page_table.at[slot].set(0), active=state.active.at[slot].set(False),
                             lengths=state.lengths.at[slot].set(0))

    # ---- requests ------------------------------------------------------------------------

    def _prompt_ids(self, req: Request) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("a request needs exactly one of prompt and messages")
        if req.messages is not None:
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer")
            text = self.tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True)
            return list(self.tokenizer.encode(text))
        if isinstance(req.prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            return list(self.tokenizer.encode(req.prompt))
        return [int(t) for t in req.prompt]

    def _sampling_of(self, req: Request) -> tuple[float, int, float, int]:
        s = self.config.sampling
        temperature = s.temperature if req.temperature is None else float(req.temperature)
        top_k = s.top_k if req.top_k is None else int(req.top_k)
        top_p = s.top_p if req.top_p is None else float(req.top_p)
        seed = self.config.seed if req.seed is None else int(req.seed)
        # -1 and 0 both mean off; any other negative value is refused by name (`_refusal`).
        return temperature, 0 if top_k == -1 else top_k, top_p, seed

    def _refusal(self, req: Request, prompt: list[int]) -> str | None:
        """Why a request cannot be served (every reason), or None."""
        reasons = []
        temperature, top_k, top_p, seed = self._sampling_of(req)
        if req.max_new_tokens < 1:
            reasons.append(f"max_new_tokens={req.max_new_tokens} must be >= 1")
        if not prompt:
            reasons.append("the prompt is empty")
        vocab = self.target_cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            reasons.append(f"prompt token ids {bad[:5]} outside [0, {vocab})")
        if not (np.isfinite(temperature) and temperature >= 0):
            reasons.append(f"temperature={temperature} must be finite and >= 0")
        elif self.config.sampling.backend == "greedy" and temperature > 0:
            reasons.append(f"temperature={temperature} under the greedy sampling backend (use gumbel or rejection)")
        if top_k < 0:
            reasons.append(f"top_k={top_k} must be -1 or 0 (off) or >= 1")
        if not 0 < top_p <= 1:
            reasons.append(f"top_p={top_p} must lie in (0, 1]")
        if not 0 <= seed <= MAX_SEED:
            reasons.append(f"seed={seed} must lie in [0, 2^31)")
        limit = len(prompt) + req.max_new_tokens
        if limit > self.context:
            reasons.append(f"prompt ({len(prompt)}) + max_new_tokens ({req.max_new_tokens}) = {limit} exceeds the "
                           f"context length {self.context}")
        need = pages_needed(limit, self.num_nodes, self.page_size)
        if need > self.num_pages - 1:
            reasons.append(f"needs {need} pages of {self.page_size} tokens, the pool has {self.num_pages - 1}")
        return "; ".join(reasons) or None

    def _stop_ids(self, req: Request) -> frozenset:
        ids = set(int(t) for t in req.stop_token_ids)
        if not req.ignore_eos:
            ids |= set(self.target_cfg.eos_token_ids)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if eos is not None:
                ids.add(int(eos))
        return frozenset(ids)

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    # ---- the serving loop -----------------------------------------------------------------

    def prefill_batch_rows(self, requests: int) -> int:
        """Rows of the prefill batch that `requests` admitted together run in: their count rounded
        up to a power of two, at most `prefill_rows`."""
        return min(1 << (requests - 1).bit_length(), self.prefill_rows)

    def prefill_row_counts(self) -> list[int]:
        """Every prefill batch row count a run can launch (`prefill_batch_rows` of 1 .. B
        requests), ascending: one prefill program each."""
        return sorted({self.prefill_batch_rows(k) for k in range(1, self.slots + 1)})

    def compile(self, requests: Sequence[Request] = (), workers: int | None = None, progress=None) -> float:
        """Compiles every program a run of `requests` can launch before it starts; returns the
        seconds it took. Each program otherwise compiles when a run first needs it, which stalls
        every running request (a new prefill row count mid-run), and on the H100 a batch-8 SmolLM2
        engine took 70 s to serve its first requests.

        Compiled: for each prefill row count (`prefill_batch_rows`), the target's and drafter's
        prefill, the first-token draw and the admission; the decode step (and the chain's, under
        `speculative.chain_above_batch`); the slot release. The draws are those `requests` ask
        for (greedy when none are given): a step draws as the most demanding of its running
        requests, so a run of sampled requests alone never runs the greedy step, and compiling it
        would cost as much as the step it serves. Each program is lowered with inputs of the
        types `_start` and `stream` pass, so the run finds it in the jit cache; nothing runs and
        no state changes.

        `workers`: compiling threads. Default: one on a GPU, where XLA's autotuner times candidate
        kernels on the device and programs compiled side by side would disturb each other's
        timings; elsewhere 16. `progress(program, total)`, if given, is called as each program is
        built (`ProgramCompile`; `total`: the programs of this call), from the compiling thread.
        """
        import concurrent.futures

        t0 = time.perf_counter()
        # A batch's draw is the most demanding of its requests' own (`draw_for`), so any running
        # set draws as one of its members would alone: only the requests' own draws can run.
        draws = sorted({self._request_draw(r) for r in requests} or {"argmax"}, key=DRAWS.index)
        step_draws = draws if self.config.sampling.backend == "gumbel" else ("auto",)
        steps = [self._step] + ([self._chain_step] if self._chain_step is not None else [])
        prefill_rows = self.prefill_row_counts()
        # Per prefill row count: the prefill, each first-token draw, the drafter's prefill, the admission.
        total = len(steps) * len(step_draws) + 1 + len(prefill_rows) * (2 + len(draws) + (self.drafter is not None))
        with concurrent.futures.ThreadPoolExecutor(workers or (1 if on_gpu() else 16)) as pool:
            done: list[ProgramCompile] = []

            def compiled(name, lower):
                def job():
                    t_lower = time.perf_counter()
                    lowered = lower()
                    t_compile = time.perf_counter()
                    program = lowered.compile()
                    built = ProgramCompile(name, t_compile - t_lower, time.perf_counter() - t_compile)
                    done.append(built)
                    if progress is not None:
                        progress(built, total)
                    return program
                return pool.submit(job)

            jobs = [compiled(f"{kind}[{d}]", functools.partial(step.lower, self.params, self.state, draw=d))
                    for kind, step in zip(("step", "chain_step"), steps) for d in step_draws]
            jobs.append(compiled("release", functools.partial(self._release.lower, self.state, 0)))
            ints = lambda *shape: jnp.asarray(np.zeros(shape, np.int32))  # noqa: E731
            prefills = {}
            for rows in prefill_rows:
                inputs = (ints(rows, self.table_width), ints(rows, self.chunk), ints(rows))
                prefills[rows] = inputs, compiled(f"prefill[rows={rows}]", functools.partial(
                    self._prefill.lower, self.params, self.state, inputs[1], inputs[0], inputs[2], inputs[2]))
            # The first-token draw and the drafter's prefill read the target prefill's logits and
            # features: placeholders of their shapes, typed as the run's will be. Under tensor
            # parallelism the inputs are placed, so the prefill's outputs are too (sharded as its
            # compiled program says); on one device nothing is placed, and neither are its outputs.
            placed = self.placement is not None
            for rows, ((table, toks, lengths), prefill) in prefills.items():
                program = prefill.result()
                _, logits, features = jax.tree.map(
                    lambda info, sharding: (jax.device_put(jnp.zeros(info.shape, info.dtype), sharding) if placed
                                            else jnp.zeros(info.shape, info.dtype)),
                    program.out_info, program.output_shardings)
                params = SamplingParams.create([0.0] * rows, [0] * rows, [1.0] * rows)
                jobs += [compiled(f"first_token[rows={rows},{d}]", functools.partial(
                    self._first_token.lower, logits, lengths, lengths, params, draw=d)) for d in draws]
                if self.drafter is not None:
                    jobs.append(compiled(f"draft_prefill[rows={rows}]", functools.partial(
                        self._draft_prefill.lower, self.params, self.state, toks, toks, features, table, lengths,
                        lengths)))
                jobs.append(compiled(f"admit[rows={rows}]", functools.partial(
                    self._admit.lower, self.state, lengths, table, lengths, lengths, lengths, params)))
            for job in jobs:
                job.result()
        self.last_compile = tuple(done)
        return time.perf_counter() - t0

    def _start(self, group: list[tuple[_Running, int]], run_stats: RunStats) -> None:
        """Prefills up to `prefill_rows` admitted requests together (target, then drafter), draws
        their first tokens and admits request i of `group` into its slot.

        Row i of the `[rows, chunk]` batches holds request i, rows = `prefill_batch_rows(len(group))`;
        rows past the group are padding (valid 0, scratch-page tables). Chunk j covers prompt positions [j * chunk, (j + 1)
        * chunk); a request whose prompt ended before it takes part with valid 0 and its own length
        as start, so it writes nothing and reads only its own keys.
        """
        t0 = time.perf_counter()
        rows, c = self.prefill_batch_rows(len(group)), self.chunk
        tables = np.zeros((rows, self.table_width), np.int32)
        lengths = np.zeros((rows,), np.int32)
        for i, (run, _) in enumerate(group):
            tables[i] = table_row(run.pages, self.table_width)
            lengths[i] = len(run.prompt)
        table = jnp.asarray(tables)
        chunks = []
        logits = None
        for start in range(0, int(lengths.max()), c):
            toks = np.zeros((rows, c), np.int32)
            for i, (run, _) in enumerate(group):
                piece = run.prompt[start:start + c]
                toks[i, :len(piece)] = piece
            starts = np.minimum(start, lengths)
            valid = np.clip(lengths - start, 0, c).astype(np.int32)
            self.state, chunk_logits, features = self._prefill(self.params, self.state, jnp.asarray(toks), table,
                                                               jnp.asarray(starts), jnp.asarray(valid))
            # Each request's next-token logits come from the chunk holding its last prompt token.
            ends_here = jnp.asarray((lengths > start) & (lengths <= start + c))[:, None]
            logits = chunk_logits if logits is None else jnp.where(ends_here, chunk_logits, logits)
            chunks.append((toks, starts, valid, features))
        sampling = [self._sampling_of(run.request) for run, _ in group]
        sampling += [(0.0, 0, 1.0, 0)] * (rows - len(group))  # padding rows draw greedily, unused
        temperature, top_k, top_p, seed = (list(col) for col in zip(*sampling))
        params = SamplingParams.create(temperature, top_k, top_p)
        draw = draw_for(temperature, top_k, top_p, self.target_cfg.vocab_size)
        first = np.asarray(self._first_token(logits, jnp.asarray(seed, jnp.int32), jnp.asarray(lengths), params,
                                             draw=draw))
        if self.drafter is not None:
            # The drafter's row t pairs prompt token t with the token after it (the first drawn one
            # after the last prompt token).
            shifted = [list(run.prompt[1:]) + [int(first[i])] for i, (run, _) in enumerate(group)]
            for toks, starts, valid, features in chunks:
                nxt = np.zeros((rows, c), np.int32)
                for i in range(len(group)):
                    nxt[i, :valid[i]] = shifted[i][starts[i]:starts[i] + valid[i]]
                self.state = self._draft_prefill(self.params, self.state, jnp.asarray(toks), jnp.asarray(nxt),
                                                 features, table, jnp.asarray(starts), jnp.asarray(valid))
        slots = np.full((rows,), self.slots, np.int32)  # padding rows name no slot: their writes drop
        slots[:len(group)] = [slot for _, slot in group]
        self.state = self._admit(self.state, jnp.asarray(slots), table, jnp.asarray(lengths), jnp.asarray(first),
                                 jnp.asarray(seed, jnp.int32), params)
        jax.block_until_ready(self.state.lengths)
        run_stats.prefill_s += time.perf_counter() - t0
        for i, (run, _) in enumerate(group):
            run_stats.prompt_tokens += len(run.prompt)
            run_stats.generated_tokens += len(self._append(run, [int(first[i])]))

    def _append(self, run: _Running, tokens: list[int]) -> list[int]:
        """Adds committed tokens up to the first stop / the limit; returns those kept.

        Token by token, so a request keeps the same tokens whether a round commits one token or
        several: none past the one that ends it (a stop token, the limit, or the token that
        completes a stop string).
        """
        kept = []
        for t in tokens:
            if run.finish is not None:
                break
            t = int(t)
            run.tokens.append(t)
            kept.append(t)
            if t in run.stops:
                run.finish = "eos" if t not in run.request.stop_token_ids else "stop"
            elif len(run.tokens) >= run.request.max_new_tokens:
                run.finish = "length"
            if run.detok is not None:
                seen = len(run.detok.text)
                run.detok.push([t])
                if run.finish in (None, "length") and _completes_stop(run.detok.text, seen, run.request.stop):
                    run.finish = "stop"
        return kept

    def _final_text(self, run: _Running) -> str:
        if run.final_text is None:
            run.final_text = self._decode_final_text(run)
        return run.final_text

    def _decode_final_text(self, run: _Running) -> str:
        tokens = run.tokens
        if run.finish == "eos" or (run.finish == "stop" and tokens and tokens[-1] in run.stops):
            tokens = tokens[:-1]
        text = self._text(tokens)
        for s in run.request.stop:
            at = text.find(s) if s else -1
            if at >= 0:
                text = text[:at]
        return text

    def _new_stats(self, kind=RequestStats):
        """Empty acceptance statistics (a request's, or with `kind=RunStats` a run's) of this tree shape."""
        return kind(num_nodes=self.num_nodes, max_depth=self.max_depth)

    def _completion(self, run: _Running) -> Completion:
        return Completion(tokens=list(run.tokens), text=self._final_text(run), finish_reason=run.finish,
                          prompt_tokens=len(run.prompt), stats=run.stats)

    def refusal(self, req: Request) -> str | None:
        """Why `decode` / `stream` would refuse `req` (every reason, in one string), or None: the
        check they make when they read it, so a caller can sort out requests before it compiles
        or serves anything. Nothing runs on the device."""
        return self._checked(req)[1]

    def _checked(self, req: Request) -> tuple[list[int], str | None]:
        """(prompt ids, refusal or None) of `req`."""
        try:
            prompt = self._prompt_ids(req)
            return prompt, self._refusal(req, prompt)
        except ValueError as err:
            return [], str(err)

    def _read_request(self, index: int, req: Request) -> _Running | Completion:
        """A request as read from the input: its running record, or the refusal that answers it."""
        prompt, reason = self._checked(req)
        if reason is not None:
            return Completion([], "", "refused", len(prompt), self._new_stats(), error=reason)
        limit = len(prompt) + req.max_new_tokens
        return _Running(index, req, prompt, [], limit, self._stop_ids(req), stats=self._new_stats(),
                        detok=self.tokenizer.detokenizer() if self.tokenizer is not None else None,
                        draw=self._request_draw(req))

    def _request_draw(self, req: Request) -> str:
        """The least draw that is exact for `req`'s sampling parameters (`draw_for`)."""
        temperature, top_k, top_p, _ = self._sampling_of(req)
        return draw_for([temperature], [top_k], [top_p], self.target_cfg.vocab_size)

    def _draw_of(self, runs) -> str:
        """The step's `draw` for these running requests: known here, so the step holds no
        device-side branch (each one the GPU runtime resolves by waiting on the device). Only the
        gumbel backend uses it; the others always pass "auto" and keep one compiled step."""
        if self.config.sampling.backend != "gumbel":
            return "auto"
        return DRAWS[max((DRAWS.index(r.draw) for r in runs), default=DRAWS.index("argmax"))]

    def stream(self, requests: Iterable[Request], progress=None) -> Iterator[StreamEvent]:
        """Serves `requests` with continuous batching, yielding each request's text as it commits.

        `requests` is read lazily, a request at a time while slots are free, so it may be a
        generator that produces requests as they arrive, or that stops producing them (at a
        deadline, say): what it has produced is served to the end. A refused request is answered
        as it is read; `StreamEvent.index` counts requests in the order they were read.
        """
        run_stats = self._new_stats(RunStats)
        pending = enumerate(requests)
        queue: collections.deque[_Running] = collections.deque()
        exhausted = False

        def read(want: int) -> Iterator[StreamEvent]:
            """Reads requests until the queue holds `want` or the input ends."""
            nonlocal exhausted
            while not exhausted and len(queue) < want:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    return
                got = self._read_request(*item)
                if isinstance(got, Completion):
                    yield StreamEvent(item[0], "", [], finished=got)
                else:
                    queue.append(got)

        running: dict[int, _Running] = {}
        free_slots = list(range(self.slots - 1, -1, -1))
        # The step in flight, launched before the host reads the one before it, so that the host's
        # work on a step's tokens overlaps the device's next step: its outputs and the runs it served.
        in_flight: tuple[StepOutput, dict[int, _Running]] | None = None
        t_start = time.perf_counter()
        while queue or running or in_flight is not None or not exhausted:
            # Admission: first come, first served; a request whose pages are not free waits. The
            # requests admitted together prefill together, `prefill_rows` at a time.
            yield from read(len(free_slots))
            # Decoding goes on meanwhile, so admissions wait for a group's worth of free slots,
            # unless everything still waiting fits now.
            enough = min(self.min_prefill_group, len(queue)) if exhausted else self.min_prefill_group
            blocked = bool(running) and len(free_slots) < enough
            while queue and free_slots and not blocked:
                group = []
                while queue and free_slots and len(group) < self.prefill_rows:
                    need = pages_needed(queue[0].limit, self.num_nodes, self.page_size)
                    if need > self.allocator.free_pages:
                        if not running and not group:
                            raise RuntimeError(f"request {queue[0].index} needs {need} pages and none will free up")
                        blocked = True
                        break
                    run = queue.popleft()
                    run.pages = self.allocator.allocate(need)
                    group.append((run, free_slots.pop()))
                if not group:
                    break
                self._start(group, run_stats)
                for run, slot in group:
                    running[slot] = run
                    yield from self._emit(run, run.tokens[:], progress)
                    if run.finish is not None:
                        yield from self._finish(slot, running, free_slots, progress)
                yield from read(len(free_slots))
            launched = None
            if running:
                t0 = time.perf_counter()
                chain = self.chain_above is not None and len(running) > self.chain_above
                step = self._chain_step if chain else self._step
                self.state, out = step(self.params, self.state, draw=self._draw_of(running.values()))
                run_stats.decode_s += time.perf_counter() - t0
                run_stats.steps += 1
                run_stats.chain_steps += chain
                launched = (out, dict(running))
            if in_flight is not None:
                yield from self._take_step(*in_flight, running, free_slots, run_stats, progress)
            in_flight = launched
        run_stats.wall_s = time.perf_counter() - t_start
        self.last_run = run_stats

    def _take_step(self, out: StepOutput, served: dict[int, _Running], running: dict, free_slots: list,
                   run_stats: RunStats, progress) -> Iterator[StreamEvent]:
        """Commits a step's tokens to the runs it served. A run that finished on the step before
        was still active in this one (launched before the host saw it finish): its slot ran once
        more inside its reserved pages (`scheduler.pages_needed`), and its outputs are dropped."""
        t0 = time.perf_counter()
        out = jax.device_get(out)
        run_stats.decode_s += time.perf_counter() - t0
        for slot, run in served.items():
            if run.finish is not None:
                continue
            a = int(out.accept_len[slot])
            run.stats.record(a, out.sibling_rank[slot, 1:a])
            run_stats.record(a, out.sibling_rank[slot, 1:a])
            kept = self._append(run, out.tokens[slot, :a].tolist())
            run_stats.generated_tokens += len(kept)
            yield from self._emit(run, kept, progress)
            if run.finish is not None:
                yield from self._finish(slot, running, free_slots, progress)

    def _emit(self, run: _Running, kept: list[int], progress) -> Iterator[StreamEvent]:
        if progress is not None and kept:
            progress(len(kept))
        if not kept:
            return
        if run.finish:
            text = self._final_text(run)
        else:
            # An unfinished character is not in the decoded text yet; text that could still
            # become a stop string is held back too.
            text = run.detok.text if run.detok is not None else ""
            text = text[:len(text) - _stop_prefix_len(text, run.request.stop)]
        new = text[len(run.emitted_text):] if text.startswith(run.emitted_text) else ""
        run.emitted_text = text if text.startswith(run.emitted_text) else run.emitted_text
        yield StreamEvent(run.index, new, kept)

    def _finish(self, slot: int, running: dict, free_slots: list, progress) -> Iterator[StreamEvent]:
        run = running.pop(slot)
        self.state = self._release(self.state, slot)
        self.allocator.release(run.pages)
        free_slots.append(slot)
        yield StreamEvent(run.index, "", [], finished=self._completion(run))

    def decode(self, requests: Sequence[Request], progress=None) -> list[Completion]:
        """Serves every request; returns completions in request order."""
        requests = list(requests)
        out: list[Completion | None] = [None] * len(requests)
        for ev in self.stream(requests, progress):
            if ev.finished is not None:
                out[ev.index] = ev.finished
        return out
