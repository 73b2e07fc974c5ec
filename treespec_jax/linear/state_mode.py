"""How a linear-attention layer keeps what its commit needs: ReplaySSM or staged.

"replay_ssm" (default): verify never writes the committed state pool; it keeps per-node replay
payload rows and the commit replays the accepted path as a chain. "staged": verify writes each
node's state to a scratch and the commit copies the last accepted node's row. Every GDN and Mamba2
layer of a model runs the same mode, chosen once at startup by `state_mode_for`.
"""

from __future__ import annotations

from typing import Literal

StateMode = Literal["replay_ssm", "staged"]
STATE_MODES: tuple[str, ...] = ("replay_ssm", "staged")


def check_state_mode(mode: str, what: str) -> None:
    if mode not in STATE_MODES:
        raise ValueError(f"{what} state mode {mode!r} is not one of {STATE_MODES}")


def state_mode_for(disable_replay_ssm: bool, replay_supported: bool = True) -> StateMode:
    """`--disable-replay-ssm`, or a replay kernel that cannot run for the model, keeps staged."""
    return "replay_ssm" if replay_supported and not disable_replay_ssm else "staged"
