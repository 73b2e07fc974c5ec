"""Timing and device ceilings shared by every GPU benchmark module.

Speed is reported as ratios against baselines measured in the same run, so every module takes its
floors from `measure_ceilings()` here: the copy bandwidth (bytes read + written per second) and the
bf16 matmul rate, both measured on random data. Kernels are timed by `traced_time` (profiler kernel
spans after an idle pause) and the matmul ceiling the same way, so a ratio compares one power state.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp


# Seconds of back-to-back calls before a timing starts. Compiles leave the GPU idle long enough for
# its clocks to drop (nvidia-smi shows 345 MHz of 1980 at rest on the H200), and a timing of a few
# milliseconds right after one reads the same window-kernel launch up to twice as slow (0.0127 and
# 0.0244 ms in one sweep, benchmarks/archive/2026-11-30.md, 17:11 UTC).
WARM_S = 0.2


def _warm(call, state=None):
    """Runs `state = call(state)` (arrays to wait on) until WARM_S seconds have passed; returns the
    last state (a donated carry must be threaded through)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < WARM_S:
        state = jax.block_until_ready(call(state))
    return state


def median_time(fn, *args, samples=15, inner=None, warm=True, best=False):
    """Median seconds per call of `fn(*args)`: warm-up, then `samples` rounds of `inner` calls.

    `inner` defaults to enough back-to-back calls to fill ~20 ms, so launch gaps of tiny kernels
    are amortised the same way in every module. `warm`: run WARM_S seconds first; `best`: the
    fastest sample instead of the median (the device ceilings).
    """
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    inner = inner or max(1, min(20, int(0.02 / max(one, 1e-6))))
    if warm:
        _warm(lambda _: fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return min(times) if best else statistics.median(times)


def _median_seconds(call, state, reps: int):
    """(median seconds of `state = call(state)` over `reps` runs after WARM_S of warm-up, last state)."""
    state = _warm(call, jax.block_until_ready(call(state)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(call(state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def _per_call(chain, inner: int, run):
    """Device seconds per call from two chains, `inner` and 3 * `inner` calls long (`chain(n)` builds
    one, `run(f)` times it): their difference over 2 * `inner` calls, so one jit dispatch and one
    sync drop out (one chain's time over its length would leave (dispatch + sync) / `inner` in every
    figure and pull compared ratios toward 1)."""
    short = run(chain(inner))
    return (run(chain(3 * inner)) - short) / (2 * inner)


def time_step(step, carry, *, inner: int, reps: int = 7):
    """Median device seconds per `step(carry) -> carry`, from chains of steps inside one jit
    (`_per_call`). The carry is donated, so kernels that update buffers in place are timed without
    copies. Returns (seconds per step, final carry)."""
    def chain(n):
        def many(c):
            for _ in range(n):
                c = step(c)
            return c
        return jax.jit(many, donate_argnums=0)

    def run(f):
        nonlocal carry
        t, carry = _median_seconds(f, carry, reps)
        return t

    return _per_call(chain, inner, run), carry


def jitted_chain(fn, feed, n: int):
    """One jitted function running `n` calls of `fn` back to back, each call's arguments made from
    the previous call's output by `feed(args, out) -> args`; it returns the last output."""
    def many(*a):
        out = None
        for _ in range(n):
            out = fn(*a)
            a = feed(a, out)
        return out
    return jax.jit(many)


def chained_time(fn, args, feed, *, inner: int = 20, reps: int = 7):
    """Median device seconds per call of `fn(*args)`, from chains of calls inside one jit
    (`_per_call`).

    `feed(args, out) -> args` makes each call's inputs depend on the previous call's output, so XLA
    can neither merge the identical calls nor reorder them; the calls then run back to back on the
    device, as a kernel inside a model's jitted step does. Inputs are not donated.
    """
    return _per_call(lambda n: jitted_chain(fn, feed, n), inner, lambda f: _median_seconds(lambda _: f(*args), None, reps)[0])


def device_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(kernel name, start ns, duration ns) of every kernel on the device planes' stream lines of the
    trace `jax.profiler.trace` wrote under `trace_dir` (CUPTI timestamps)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    events = []
    for path in paths:
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                # Stream lines hold the kernels; XLA's op and module lines repeat them as annotations.
                if "stream" in line.name.lower() and "xla" not in line.name.lower():
                    events.extend((e.name, e.start_ns, e.duration_ns) for e in line.events)
    return events


# Seconds the device idles before each traced run (`traced_chain`). The H200 lowers its clocks at
# its power cap under sustained load and raises them after an idle moment, and every kernel and the
# matmul ceiling move with them (results: timer, benchmarks/tools/power_state.py: the bf16 matmul runs
# 819-820 TFLOP/s traced after 1 s idle, 694-741 after 2 s of load; the B=64 cascade 0.476-0.488 and
# 0.529-0.534 ms). Timing every kernel and the ceiling after the same idle pause makes a ratio
# compare like with like, in the state that repeats best (the three boost matmuls agreed to 0.1%).
IDLE_S = 1.0


def traced_chain(fn, args, feed, *, inner: int = 60, runs: int = 3, warm_s: float = 0.0,
                 idle_s: float = IDLE_S):
    """Kernel events of `runs` traced runs of a chain of `inner` calls of `fn` in one jit (fed as in
    `chained_time`): the chain is compiled and run once, then each traced run follows `idle_s`
    seconds of idle device, one untraced run and `warm_s` seconds more of the chain. A list of `runs`
    event lists; None on the CPU, which has no device kernels (elsewhere an empty trace raises)."""
    if jax.default_backend() == "cpu":  # no device kernels to trace
        return None
    chain = jitted_chain(fn, feed, inner)
    jax.block_until_ready(chain(*args))
    traces = []
    for _ in range(runs):
        time.sleep(idle_s)
        jax.block_until_ready(chain(*args))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warm_s:
            jax.block_until_ready(chain(*args))
        d = tempfile.mkdtemp(prefix="treespec_trace")
        with jax.profiler.trace(d):
            jax.block_until_ready(chain(*args))
        traces.append(device_events(d))
    if not all(traces):  # a GPU without CUPTI tracing must not fall back to another timer silently
        raise RuntimeError(f"traced_chain: the profiler recorded no device kernels on {jax.default_backend()}")
    return traces


def span_per_call(events, inner: int) -> float:
    """Seconds from the first kernel's start to the last one's end, over the chain's `inner` calls."""
    start = min(s for _, s, _ in events)
    return (max(s + d for _, s, d in events) - start) / inner / 1e9


def median_span(traces, inner: int) -> float:
    """The median over traced chains (`traced_chain`) of `span_per_call`."""
    return statistics.median(span_per_call(ev, inner) for ev in traces)


def traced_time(fn, args, feed, *, inner: int = 60, runs: int = 3, warm_s: float = 0.0,
                idle_s: float = IDLE_S):
    """Device seconds per call of `fn(*args)`: the median over `runs` traced chains of `inner` calls
    (`traced_chain`, each after `idle_s` of idle device) of the span from the chain's first kernel
    start to its last kernel end, per call. Idle gaps between kernels count; what the host does
    before the first kernel does not. That host work grows with the chain (XLA prepares every
    call's launches), so `chained_time`, a host wall-clock difference, carries it per call, and it
    runs the device under sustained load: on the H200 (2026-12-01) it read the B=64 bf16 cascade at
    0.569 ms against 0.480 traced (B=1: 0.079 against 0.065). Falls back to `chained_time` where no
    kernels are recorded (the CPU)."""
    traces = traced_chain(fn, args, feed, inner=inner, runs=runs, warm_s=warm_s, idle_s=idle_s)
    if traces is None:
        return chained_time(fn, args, feed, inner=max(1, inner // 3))
    return median_span(traces, inner)


def traced_ms(fn, args, feed_index: int, inner: int = 60) -> float:
    """`traced_time` in milliseconds, each call fed the previous output through argument
    `feed_index` (`feed_scalar`)."""
    return 1e3 * traced_time(fn, args, feed_scalar(feed_index), inner=inner)


def traced_matmul_flops(n: int = 8192, chain: int = 10, warm_s: float = 0.0, idle_s: float = IDLE_S) -> float | None:
    """bf16 FLOP/s of chained [n, n] x [n, n] matmuls (each multiplies the last product), traced as
    `traced_time` times the kernels (after `idle_s` idle, `warm_s` of load), so a floor taken from it
    and a kernel time compare in the same power state; None where no kernels are recorded (CPU)."""
    a = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    b = (jax.random.normal(jax.random.PRNGKey(3), (n, n), jnp.float32) / n ** 0.5).astype(jnp.bfloat16)
    mm = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)  # noqa: E731
    traces = traced_chain(mm, (a, b), lambda args, out: (out, args[1]), inner=chain, warm_s=warm_s, idle_s=idle_s)
    if traces is None:
        return None
    return 2 * n ** 3 / median_span(traces, chain)


def feed_scalar(index: int):
    """A `chained_time` feed that works for any output: adds (x != x), 0 for any non-NaN x, the
    first element of the output's first leaf, to the integer argument `index`. The output passes an
    optimization barrier first, so XLA must still produce all of it (else it could compute only
    that element of, e.g., a split merge). The feed is one tiny fused op per call; give every chain
    that is compared with another the same feed, so its cost cancels."""
    def feed(args, out):
        out = jax.lax.optimization_barrier(out)
        first = jax.tree_util.tree_leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
        args = list(args)
        args[index] = args[index] + (first != first).astype(args[index].dtype)
        return tuple(args)
    return feed


def feed_output(index: int):
    """A `chained_time` feed that passes the output itself (same shape and dtype) as argument `index`."""
    def feed(args, out):
        args = list(args)
        args[index] = out
        return tuple(args)
    return feed


def _torch_copy_bandwidth() -> float | None:
    """Device-to-device copy through torch, which often streams faster than an XLA elementwise op."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    bw = 2 * src.numel() * 2 / min(times)  # the fastest sample, as the XLA figure
    del src, dst
    torch.cuda.empty_cache()
    return bw


def measure_copy_bandwidth() -> float:
    """Bytes per second, read + write, of the best large device copy available (2 GiB, random)."""
    x = jax.random.normal(jax.random.PRNGKey(1), (1 << 30,), jnp.float32).astype(jnp.bfloat16)
    bw = 2 * x.nbytes / median_time(jax.jit(lambda a: a * jnp.bfloat16(2)), x, samples=10, inner=5, warm=False,
                                    best=True)
    del x
    try:
        bw = max(bw, _torch_copy_bandwidth() or 0.0)
    except Exception as exc:  # a torch without a working GPU must not cost the XLA figure
        print(f"  torch copy bandwidth unavailable: {exc}", flush=True)
    return bw


def measure_matmul_flops(n: int = 8192, sustained: bool = False) -> float:
    """bf16 matmul FLOP/s on random [n, n] operands: the fastest of 10 samples taken cold, before
    any warm-up (`sustained`: the median after WARM_S seconds of it, the power-capped clocks). The floors are the strictest this way: under sustained load the H200 lowers its
    clocks at its power cap: the same matmul ran 676-698 TFLOP/s after WARM_S seconds of it and
    744-778 cold (a median of cold samples: 718-754; 2026-11-30), while the
    attention kernels, below full tensor-core use, kept their times (`measure_ceilings` prints the
    sustained rate for reference)."""
    a = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(3), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.bfloat16))
    return 2 * n ** 3 / median_time(mm, a, b, samples=10, inner=3, warm=sustained, best=not sustained)


def traced_copy_bandwidth(chain: int = 5) -> float | None:
    """Bytes per second, read + write, of chained 2 GiB bf16 scalings (`x * 2`, each of the last
    result, behind an optimization barrier), traced like `traced_matmul_flops`; None where no kernels
    are recorded (CPU) or where the trace holds fewer kernels than calls: without the barrier XLA
    fuses the chain into one pass (it then reads 16.84 TB/s, four times the H200's)."""
    x = jax.random.normal(jax.random.PRNGKey(1), (1 << 30,), jnp.float32).astype(jnp.bfloat16)
    traces = traced_chain(lambda a: a * jnp.bfloat16(2), (x,), lambda args, out: (jax.lax.optimization_barrier(out),),
                          inner=chain)
    nbytes = x.nbytes
    del x
    if traces is None or any(len(ev) < chain for ev in traces):
        return None
    return 2 * nbytes / median_span(traces, chain)


def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s): the copy's fastest
    cold sample (a 1 ms copy, so dispatch moves it ~2%) and the traced matmul (`traced_matmul_flops`,
    the state `traced_time` times kernels in; the per-call cold sample, the earlier floor, where
    nothing is traced). Prints the traced copy (not yet checked on the GPU since its fix, so not a floor),
    the per-call cold and the sustained matmul rates for reference."""
    bw = measure_copy_bandwidth()
    traced_bw = traced_copy_bandwidth()
    cold = measure_matmul_flops()
    traced = traced_matmul_flops()
    print(f"  ceilings: copy {bw / 1e12:.2f} TB/s (traced copy {(traced_bw or float('nan')) / 1e12:.2f}, for "
          f"reference); bf16 matmul traced after idle {(traced or float('nan')) / 1e12:.0f} TFLOP/s (the floors), "
          f"per-call cold {cold / 1e12:.0f}, per-call sustained "
          f"{measure_matmul_flops(sustained=True) / 1e12:.0f}", flush=True)
    return bw, traced or cold
