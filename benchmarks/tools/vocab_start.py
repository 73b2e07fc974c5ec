"""How a run that goes on from an exported head starts under each draft vocabulary rule: the
held-out loss and top-1 agreement of its step-0 weights (no training), per variant.

    PYTHONPATH=. python benchmarks/tools/vocab_start.py --data DATA [--head treespec_jax/data/smollm2-eagle3]
        [--variants inherit:8192,data:8192,data:16384] [--eval-batches 6]

A variant is `init_vocab:draft_vocab_size` (`configs/train/eagle3.toml`, [head] and [vocab]). The
head's held-out sequences of DATA are scored as `train.eagle3 export` scores them; runs go to a
temporary directory. Runs on the CPU (a few minutes for 2 shards) as on the GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from treespec_jax.train import eagle3 as trainer_mod
from treespec_jax.train.config import load_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--head", default="treespec_jax/data/smollm2-eagle3")
    ap.add_argument("--variants", default="inherit:8192,data:8192,data:16384")
    ap.add_argument("--eval-batches", type=int, default=6)
    args = ap.parse_args()
    target = None
    rows = []
    for variant in args.variants.split(","):
        rule, vd = variant.split(":")
        cfg = load_config(overrides={"head.init_from": args.head, "head.init_vocab": rule,
                                     "vocab.draft_vocab_size": int(vd), "train.batch_rows": 2,
                                     "train.eval_batches": args.eval_batches})
        target = target or trainer_mod._load_target(cfg)
        with tempfile.TemporaryDirectory() as run:
            result = trainer_mod.train(cfg, args.data, run, stop_after=0, export=True, target=target, log=lambda m: None)
        rows.append({"variant": variant, **{k: result.export[k] for k in ("heldout_loss", "acc", "coverage")}})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
