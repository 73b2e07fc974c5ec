"""The serving engine: `Engine.from_pretrained(...)`, `engine.decode(requests)`, `engine.stream(requests)`."""

from treespec_jax.engine.engine import Completion, Engine, Request, StreamEvent
from treespec_jax.engine.round import DecodeState, Round, RoundShape, StepOutput
from treespec_jax.engine.stats import RequestStats, RunStats


def decode(target_dir, requests, draft_dir=None, config=None):
    """One-call decoding: loads the pair and serves `requests` (a list of `Request`)."""
    return Engine.from_pretrained(target_dir, draft_dir, config).decode(requests)


__all__ = ["Completion", "DecodeState", "Engine", "Request", "RequestStats", "Round", "RoundShape", "RunStats",
           "StepOutput", "StreamEvent", "decode"]
