"""benchmarks/bench_e2e.py's timing rule for a served row: one long run, or an odd count of short ones."""

import types

import pytest

from benchmarks.bench_e2e import MAX_TIMED_RUNS, _timed_runs


class _FakeEngine:
    """Each `decode` "takes" the next of `decode_s` seconds at the next of `rates` tok/s."""

    def __init__(self, decode_s, rates):
        self._runs = iter(zip(decode_s, rates))
        self.calls = 0
        self.last_run = None

    def decode(self, reqs):
        seconds, rate = next(self._runs)
        self.calls += 1
        self.last_run = types.SimpleNamespace(decode_s=seconds, decode_tokens_per_s=rate)


@pytest.mark.parametrize("decode_s,rates,calls,median", [
    ([4.0], [100.0], 1, 100.0),  # long enough alone
    ([1.5, 1.5, 1.5], [90.0, 120.0, 100.0], 3, 100.0),  # three short runs reach 3 s
    ([1.0, 1.0, 0.5, 0.5, 9.0], [5.0, 4.0, 3.0, 2.0, 1.0], 5, 3.0),  # 3 s after four: a fifth keeps it odd
    ([0.1] * 9, [float(i) for i in range(9)], MAX_TIMED_RUNS, 2.0),  # never 3 s: stops at the cap
])
def test_timed_runs_take_the_median_of_an_odd_count(decode_s, rates, calls, median):
    engine = _FakeEngine(decode_s, rates)
    run, all_rates = _timed_runs(engine, [], min_decode_s=3.0)
    assert engine.calls == calls and len(all_rates) == calls
    assert run.decode_tokens_per_s == median
