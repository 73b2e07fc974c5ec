"""Acceptance statistics: the numbers that tell a user whether K or S should grow.

Per decode round a request commits `accept_len` tokens (accepted drafts + the bonus). From the
rounds we keep: the accept-length histogram (its mean is the mean accept length); acceptance by
tree depth (rounds whose path reached depth d, d = 1..D, D the deepest draft: S draft steps give
depth S at most, whatever N) and the per-position rate (reached d given reached d-1); and the
sibling rank of every accepted node (0 = its parent's best-scored child, DFS numbering puts it
first): mass at high ranks says K pays, deep acceptance says S does.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestStats:
    """Acceptance of one request's decode rounds (or of a whole run)."""

    num_nodes: int  # N: longest possible accept length
    max_depth: int | None = None  # D: deepest draft node (S draft steps); None = N - 1 (a chain of N)
    rounds: int = 0  # decode rounds run
    histogram: np.ndarray = None  # [N + 1] rounds by accept length
    by_rank: np.ndarray = None  # [N] accepted nodes by sibling rank

    def __post_init__(self):
        if self.histogram is None:
            self.histogram = np.zeros(self.num_nodes + 1, np.int64)
        if self.by_rank is None:
            self.by_rank = np.zeros(max(self.num_nodes, 1), np.int64)
        if self.max_depth is None:
            self.max_depth = self.num_nodes - 1
        if not 0 <= self.max_depth <= self.num_nodes - 1:
            raise ValueError(f"max_depth must lie in [0, num_nodes - 1 = {self.num_nodes - 1}], "
                             f"got {self.max_depth}")

    def record(self, accept_len: int, ranks) -> None:
        """One round: `accept_len` committed tokens, `ranks` of its accepted draft nodes."""
        self.rounds += 1
        self.histogram[accept_len] += 1
        for r in np.asarray(ranks, np.int64):
            self.by_rank[r] += 1

    @property
    def mean_accept_length(self) -> float:
        if not self.rounds:
            return 0.0
        return float((self.histogram * np.arange(self.histogram.size)).sum() / self.rounds)

    @property
    def reached_depth(self) -> np.ndarray:
        """`[N]` rounds whose accepted path reached depth d (index 0 = every round)."""
        return self.histogram[::-1].cumsum()[::-1][1:]

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Fraction of rounds accepting a draft at depth d, d = 1..D (no deeper node exists)."""
        reach = self.reached_depth
        return [float(reach[d] / self.rounds) if self.rounds else 0.0 for d in range(1, self.max_depth + 1)]

    @property
    def per_position_rate(self) -> list[float]:
        """P(depth d accepted | depth d-1 accepted), d = 1..D (no deeper node exists)."""
        reach = self.reached_depth
        return [float(reach[d] / reach[d - 1]) if reach[d - 1] else 0.0 for d in range(1, self.max_depth + 1)]

    @property
    def acceptance_by_rank(self) -> list[float]:
        """Share of accepted draft nodes that were their parent's rank-r child."""
        total = self.by_rank.sum()
        return [float(x / total) if total else 0.0 for x in self.by_rank]

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "mean_accept_length": self.mean_accept_length,
                "accept_length_histogram": self.histogram.tolist(),
                "acceptance_by_depth": self.acceptance_by_depth, "per_position_rate": self.per_position_rate,
                "acceptance_by_sibling_rank": self.acceptance_by_rank}


@dataclasses.dataclass
class RunStats(RequestStats):
    """A whole `decode` call: acceptance over every request's rounds plus times."""

    steps: int = 0  # jitted decode steps (each advances every running request)
    chain_steps: int = 0  # of those, steps that verified a chain (`speculative.chain_above_batch`)
    prefill_s: float = 0.0  # seconds in prefill (target + drafter), first tokens included
    decode_s: float = 0.0  # seconds launching decode steps and waiting for their outputs
    wall_s: float = 0.0  # the whole call
    prompt_tokens: int = 0  # prompt tokens prefilled
    generated_tokens: int = 0  # tokens returned to the caller

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole call."""
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens committed by decode rounds per second of decode steps."""
        committed = int((self.histogram * np.arange(self.histogram.size)).sum())
        return committed / self.decode_s if self.decode_s else 0.0

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.update(steps=self.steps, chain_steps=self.chain_steps, prefill_s=self.prefill_s, decode_s=self.decode_s,
                   wall_s=self.wall_s, prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                   tokens_per_s=self.tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s)
        return out
