"""The demo is the end-to-end check of the tree pipeline: draft lanes -> select_tree -> one
target forward over the tree -> verify walk -> commit, against plain decoding with the same seed."""

from treespec_jax import cli, demo


def test_demo_tree_output_equals_plain_decoding(capsys):
    code = demo.main(["--batch", "2", "--prompt-len", "4", "--max-new-tokens", "10", "--no-chain",
                      "--speculative-eagle-topk", "3", "--speculative-num-steps", "3",
                      "--speculative-num-draft-tokens", "8", "--sampling-backend", "gumbel",
                      "--temperature", "0.8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "output equals plain decoding" in out


def test_demo_refuses_bad_tree_listing_every_problem(capsys):
    code = cli.main(["demo", "--batch", "0", "--speculative-eagle-topk", "17",
                     "--speculative-num-draft-tokens", "16"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--batch must be >= 1, got 0" in err
    assert "17" in err
