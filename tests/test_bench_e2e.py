"""benchmarks/bench_e2e.py: the timing rule for a served row (one long run, or an odd count of short ones)
and the shape names its tables take."""

import re
import types

import pytest

from benchmarks.bench_e2e import MAX_TIMED_RUNS, _timed_runs, main, shape_spec
from treespec_jax.config import SpeculativeConfig


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


@pytest.mark.parametrize("name,spec", [
    ("plain", dict(algorithm="NONE")),
    ("chain-s5", dict(algorithm="EAGLE3", topk=1, num_steps=5)),
    ("tree-k4s6n24", dict(algorithm="EAGLE3", topk=4, num_steps=6, num_draft_tokens=24)),
    ("tree-k8s6n64-chain16", dict(algorithm="EAGLE3", topk=8, num_steps=6, num_draft_tokens=64,
                                  chain_above_batch=16)),
])
def test_shape_names_read_as_speculative_configs(name, spec):
    assert shape_spec(name) == spec
    SpeculativeConfig(**spec)  # the engine's own config takes it


@pytest.mark.parametrize("name", ["tree-k4s5", "chain", "plain-chain8", "tree-k4s5n16x", "Tree-k4s5n16"])
def test_a_bad_shape_name_is_refused_by_name(name):
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        shape_spec(name)


def test_the_command_refuses_every_bad_shape_before_loading(monkeypatch, capsys):
    """Names that do not parse and shapes the engine's config rules refuse, all in one error."""
    monkeypatch.setattr("sys.argv", ["bench_e2e.py", "serve", "--shapes", "plain,tree-x,tree-k4s5n999,chain"])
    with pytest.raises(SystemExit):
        main()
    err = capsys.readouterr().err
    assert "'tree-x'" in err and "'chain'" in err and "num_draft_tokens = 999" in err and "'plain'" not in err
