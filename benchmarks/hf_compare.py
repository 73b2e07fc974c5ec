"""Greedy decoding of the default GGUF: our engine against Hugging Face transformers, on the GPU.

    PYTHONPATH=. python benchmarks/hf_compare.py --gguf /root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--new-tokens 48] [--out DIR]

Both sides read the same GGUF and run fp32: transformers dequantizes it itself
(`from_pretrained(..., gguf_file=...)`), we load it with `models.gguf.load_gguf`. Prompts are the
built-in ones of `treespec decode` wrapped in the chat template (our tokenizer's ids are fed to
both, so only the models are compared). Reports, per prompt, the tokens compared and the first
mismatch; then the same prompts through the bf16 kernel path (token agreement with fp32), and
transformers' `generate` throughput at batch 1 and 8 (fp32 eager; `--peer-batches`), the peer of
bench_e2e; `--peer-only` measures that alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def ours(gguf: Path, prompts: list[list[int]], new_tokens: int, dtype: str, attention: str):
    from treespec_jax.config import (BackendsConfig, KVCacheConfig, ModelConfig, SchedulerConfig, ServeConfig)
    from treespec_jax.engine import Engine, Request

    config = ServeConfig(model=ModelConfig(dtype=dtype), kv_cache=KVCacheConfig(page_size=64, max_total_tokens=65536),
                         scheduler=SchedulerConfig(max_running_requests=8),
                         backends=BackendsConfig(attention_backend=attention))
    engine = Engine.from_pretrained(gguf, None, config)
    reqs = [Request(prompt=p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.decode(reqs)
    return [o.tokens for o in outs], time.perf_counter() - t0, engine.tokenizer


def hf(gguf: Path, prompts: list[list[int]], new_tokens: int, peer_batches=(1, 8), equality: bool = True):
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    model = model.cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts if equality else ():
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
        rates = {}
        for batch in peer_batches:
            ids = torch.tensor([prompts[0]] * batch, device="cuda")
            model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            rates[batch] = batch * new_tokens / (time.perf_counter() - t0)
    return outs, rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--equality-only", action="store_true", help="skip the bf16 kernel run and HF throughput")
    ap.add_argument("--peer-only", action="store_true",
                    help="only transformers' generate throughput (the peer of bench_e2e's serve table)")
    ap.add_argument("--peer-batches", default="1,8", help="batches of the throughput peer")
    args = ap.parse_args()
    peer_batches = () if args.equality_only else tuple(int(b) for b in args.peer_batches.split(","))
    import jax

    # fp32 means fp32 on both sides: XLA's GPU default would run fp32 matmuls in TF32.
    jax.config.update("jax_default_matmul_precision", "highest")
    from treespec_jax.decode_cli import BUILTIN_PROMPTS
    from treespec_jax.models.gguf import load_gguf  # noqa: F401 (fails early without the gguf package)
    from treespec_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(args.gguf)
    texts = list(BUILTIN_PROMPTS) + ["Write a haiku about the sea.", "Give three uses of a hash map."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    if args.peer_only:
        _, rates = hf(args.gguf, prompts, args.new_tokens, peer_batches, equality=False)
        _write(args, {"hf_generate_tok_s_fp32_eager": rates, "new_tokens": args.new_tokens})
        return
    mine, mine_s, _ = ours(args.gguf, prompts, args.new_tokens, "fp32", "dense")
    theirs, rates = hf(args.gguf, prompts, args.new_tokens, peer_batches)
    rows = []
    for text, a, b in zip(texts, mine, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append({"prompt": text, "compared": min(len(a), len(b)), "first_mismatch": first,
                     "equal": a == b, "ours": tok.decode(a)})
    kernel, kernel_s, agree = [], None, []
    if not args.equality_only:
        kernel, kernel_s, _ = ours(args.gguf, prompts, args.new_tokens, "bf16", "auto")
        agree = [float(np.mean([x == y for x, y in zip(a, b)])) for a, b in zip(kernel, mine)]
    _write(args, {"fp32_greedy_vs_transformers": rows, "all_equal": all(r["equal"] for r in rows),
                  "bf16_kernels_token_agreement_with_fp32": agree, "hf_generate_tok_s_fp32_eager": rates,
                  "ours_fp32_dense_wall_s": mine_s, "ours_bf16_kernels_wall_s": kernel_s})


def _write(args, doc: dict) -> None:
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ("hf_peer.json" if args.peer_only else "hf_compare.json")).write_text(text)


if __name__ == "__main__":
    main()
