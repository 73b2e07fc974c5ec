"""One state mode for every linear-attention layer, chosen from --disable-replay-ssm."""

import argparse

import pytest

from treespec_jax.cli import add_config_flags, config_from_args
from treespec_jax.linear import GdnLayerConfig, Mamba2CommitConfig
from treespec_jax.linear.state_mode import state_mode_for


def serve_config(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize("argv,mode", [([], "replay_ssm"), (["--disable-replay-ssm"], "staged")])
def test_flag_picks_one_mode_for_gdn_and_mamba2(argv, mode):
    cfg = serve_config(argv)
    chosen = state_mode_for(cfg.backends.disable_replay_ssm)
    assert chosen == mode
    assert GdnLayerConfig(2, 4, 16, 16, mode=chosen).mode == mode
    assert Mamba2CommitConfig(mode=chosen).replay_ssm == (mode == "replay_ssm")


def test_replay_kernel_that_cannot_run_keeps_staged():
    assert state_mode_for(False, replay_supported=False) == "staged"
    assert state_mode_for(True, replay_supported=True) == "staged"


@pytest.mark.parametrize("make", [lambda m: GdnLayerConfig(2, 4, 16, 16, mode=m), lambda m: Mamba2CommitConfig(mode=m)])
def test_unknown_mode_is_named(make):
    with pytest.raises(ValueError, match="'replay'"):
        make("replay")
