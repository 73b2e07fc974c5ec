"""HF safetensors checkpoints -> params: single file and shards, tied and untied, Qwen2 biases,
Qwen3 q/k norms, EAGLE-3 heads; every tensor problem named in one error."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from treespec_jax.models import hf
from treespec_jax.models.config import Eagle3Config, LlamaConfig, ModelConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)


def tiny_cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=4, rope_theta=1e4, rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def random_tensors(specs: dict[str, tuple[int, ...]], seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Offset from zero so a param left at zeros (or swapped with another) cannot pass.
    return {k: (rng.standard_normal(s) + 0.5).astype(dtype) for k, s in specs.items()}


def write_checkpoint(root: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def layer_keys(cfg: LlamaConfig):
    """(HF suffix, param key, transposed) of one decoder layer."""
    out = [("input_layernorm.weight", "attn_norm", False), ("self_attn.q_proj.weight", "wq", True),
           ("self_attn.k_proj.weight", "wk", True), ("self_attn.v_proj.weight", "wv", True),
           ("self_attn.o_proj.weight", "wo", True), ("post_attention_layernorm.weight", "mlp_norm", False),
           ("mlp.gate_proj.weight", "w_gate", True), ("mlp.up_proj.weight", "w_up", True),
           ("mlp.down_proj.weight", "w_down", True)]
    if cfg.attention_bias:
        out += [("self_attn.q_proj.bias", "bq", False), ("self_attn.k_proj.bias", "bk", False),
                ("self_attn.v_proj.bias", "bv", False)]
    if cfg.qk_norm:
        out += [("self_attn.q_norm.weight", "q_norm", False), ("self_attn.k_norm.weight", "k_norm", False)]
    return out


def expected_target_params(cfg: LlamaConfig, t: dict[str, np.ndarray]) -> dict:
    """The params layout written out by hand, independently of the loader's own table."""
    p = {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"]}
    for i in range(cfg.num_layers):
        layer = {}
        for suffix, key, transposed in layer_keys(cfg):
            w = t[f"model.layers.{i}.{suffix}"]
            layer[key] = w.T if transposed else w
        p[f"layers_{i}"] = layer
    if not cfg.tie_word_embeddings:
        p["lm_head"] = t["lm_head.weight"].T
    return p


def assert_params_equal(got: dict, want: dict, dtype: np.dtype, path: str = ""):
    assert sorted(got) == sorted(want), path
    for k in want:
        if isinstance(want[k], dict):
            assert_params_equal(got[k], want[k], dtype, f"{path}/{k}")
            continue
        g = np.asarray(got[k])
        w = np.asarray(want[k])
        if w.dtype.kind == "f" or w.dtype == BF16:
            w = w.astype(dtype)
        assert g.dtype == w.dtype, f"{path}/{k}: {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{path}/{k}: {g.shape} != {w.shape}"
        np.testing.assert_array_equal(g.astype(np.float64), w.astype(np.float64), err_msg=f"{path}/{k}")


CASES = {
    "llama_untied": dict(),
    "smollm_tied": dict(tie_word_embeddings=True),
    "qwen2_bias": dict(family="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3_qknorm": dict(family="qwen3", qk_norm=True, num_layers=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shards", [1, 3])
def test_target_round_trip_from_hf_names(tmp_path, case, shards):
    cfg = tiny_cfg(**CASES[case])
    specs = hf.target_tensor_specs(cfg)
    assert ("lm_head.weight" in specs) == (not cfg.tie_word_embeddings)
    tensors = random_tensors(specs, seed=len(case) + shards)
    root = write_checkpoint(tmp_path / case, cfg.to_hf(), tensors, shards=shards)
    loaded_cfg, params = hf.load_target(root, "fp32")
    assert loaded_cfg == cfg
    assert_params_equal(params, expected_target_params(cfg, tensors), np.dtype(np.float32))


@pytest.mark.parametrize("dtype,npd", [("bf16", BF16), ("fp16", np.dtype(np.float16))])
def test_target_casts_to_serving_dtype(tmp_path, dtype, npd):
    cfg = tiny_cfg(tie_word_embeddings=True, num_layers=1)
    tensors = random_tensors(hf.target_tensor_specs(cfg), seed=7)
    _, params = hf.load_target(write_checkpoint(tmp_path, cfg.to_hf(), tensors), dtype)
    assert_params_equal(params, expected_target_params(cfg, tensors), npd)


def test_bf16_checkpoint_reads_back_bit_exact(tmp_path):
    cfg = tiny_cfg(num_layers=1)
    tensors = random_tensors(hf.target_tensor_specs(cfg), seed=8, dtype=BF16)
    root = write_checkpoint(tmp_path, cfg.to_hf(), tensors)
    _, params = hf.load_target(root, "bf16")
    assert_params_equal(params, expected_target_params(cfg, tensors), BF16)
    # The fallback raw reader (for safetensors builds without numpy bf16) agrees bit for bit.
    name = "model.layers.0.self_attn.q_proj.weight"
    raw = hf.read_bf16_raw(root / "model.safetensors", name)
    np.testing.assert_array_equal(raw.view(np.uint16), tensors[name].view(np.uint16))


def test_tied_checkpoint_with_redundant_lm_head_is_accepted(tmp_path):
    cfg = tiny_cfg(tie_word_embeddings=True, num_layers=1)
    tensors = random_tensors(hf.target_tensor_specs(cfg, optional=True), seed=9)
    assert "lm_head.weight" in tensors
    _, params = hf.load_target(write_checkpoint(tmp_path, cfg.to_hf(), tensors), "fp32")
    assert "lm_head" not in params
    np.testing.assert_array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"])


def test_save_target_then_load(tmp_path):
    cfg = tiny_cfg(family="qwen2", attention_bias=True)
    tensors = random_tensors(hf.target_tensor_specs(cfg), seed=10)
    params = hf.target_params_from_hf(cfg, tensors, "fp32")
    hf.save_target(tmp_path / "out", cfg, params)
    cfg2, params2 = hf.load_target(tmp_path / "out", "fp32")
    assert cfg2 == cfg
    assert_params_equal(params2, expected_target_params(cfg, tensors), np.dtype(np.float32))
    back = hf.target_params_to_hf(cfg, params2)
    assert sorted(back) == sorted(tensors)
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k])


def test_one_error_names_missing_unexpected_and_misshapen(tmp_path):
    cfg = tiny_cfg()
    tensors = random_tensors(hf.target_tensor_specs(cfg), seed=11)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["lm_head.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.ones((9, 16), np.float32)
    tensors["model.norm.weight"] = np.ones((16,), np.int32)
    root = write_checkpoint(tmp_path, cfg.to_hf(), tensors, shards=2)
    with pytest.raises(hf.CheckpointError) as info:
        hf.load_target(root, "bf16")
    msg = str(info.value)
    assert len(info.value.problems) == 5, msg
    assert "missing tensor model.layers.1.mlp.up_proj.weight (expected shape [24, 16])" in msg
    assert "missing tensor lm_head.weight (expected shape [50, 16])" in msg
    assert "unexpected tensor model.layers.0.self_attn.rotary_emb.inv_freq (shape [2])" in msg
    assert "tensor model.layers.0.self_attn.k_proj.weight has shape [9, 16], expected [8, 16]" in msg
    assert "tensor model.norm.weight has dtype int32, expected a float dtype" in msg


def test_sharded_index_problems_listed_together(tmp_path):
    cfg = tiny_cfg(num_layers=1)
    tensors = random_tensors(hf.target_tensor_specs(cfg), seed=12)
    root = write_checkpoint(tmp_path, cfg.to_hf(), tensors, shards=2)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.gone.weight"] = "model-00009-of-00009.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.CheckpointError) as info:
        hf.read_safetensors_dir(root)
    msg = str(info.value)
    assert "shard 'model-00009-of-00009.safetensors'" in msg
    assert "model.extra.weight" in msg and "lacks it" in msg


def test_directory_without_weights_names_what_it_holds(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg().to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(hf.CheckpointError, match="pytorch_model.bin"):
        hf.load_target(tmp_path)


def test_unsupported_config_values_named(tmp_path):
    config = tiny_cfg().to_hf()
    config.update(hidden_act="gelu", rope_scaling={"rope_type": "yarn", "factor": 4.0}, mlp_bias=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError) as info:
        hf.load_target(tmp_path)
    msg = str(info.value)
    assert "'gelu'" in msg and "'yarn'" in msg and "mlp_bias" in msg


def test_bad_dtype_named():
    with pytest.raises(ValueError, match="'fp8'"):
        hf.resolve_dtype("fp8")
    with pytest.raises(ValueError, match="'int8'"):
        hf.target_params_from_hf(tiny_cfg(), {}, "int8")


def test_params_to_hf_names_every_bad_param():
    cfg = tiny_cfg(num_layers=1, tie_word_embeddings=True)
    params = hf.target_params_from_hf(cfg, random_tensors(hf.target_tensor_specs(cfg), seed=13), "fp32")
    params["layers_0"].pop("wv")
    params["layers_0"]["wo"] = params["layers_0"]["wq"][:, :8]
    params["lm_head"] = params["embed"].T
    with pytest.raises(hf.CheckpointError) as info:
        hf.target_params_to_hf(cfg, params)
    msg = str(info.value)
    assert "missing param layers_0/wv" in msg
    assert "param layers_0/wo has shape [16, 8], expected [16, 16]" in msg
    assert "unexpected param lm_head" in msg


# ------------------------------------------------------------------------------------- EAGLE-3


def eagle_cfg(**kw) -> Eagle3Config:
    base = dict(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2, head_dim=4,
                vocab_size=50, draft_vocab_size=12, target_hidden_size=20, rope_theta=1e4, rms_norm_eps=1e-5)
    base.update(kw)
    return Eagle3Config(**base)


def eagle_tensors(cfg: Eagle3Config, seed: int, t2d: bool = True, embed: bool = False) -> dict[str, np.ndarray]:
    specs = dict(hf.eagle3_tensor_specs(cfg))
    specs.pop("d2t")
    out = random_tensors(specs, seed)
    rng = np.random.default_rng(seed)
    targets = np.sort(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False))
    out["d2t"] = (targets - np.arange(cfg.draft_vocab_size)).astype(np.int64)
    if t2d:
        mask = np.zeros(cfg.vocab_size, bool)
        mask[targets] = True
        out["t2d"] = mask
    if embed:
        out["embed_tokens.weight"] = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    return out


def expected_eagle_params(t: dict[str, np.ndarray]) -> dict:
    m = "midlayer."
    p = {
        "fc": t["fc.weight"].T,
        "input_norm": t[m + "input_layernorm.weight"],
        "hidden_norm": t[m + "hidden_norm.weight"],
        "layer": {
            "wq": t[m + "self_attn.q_proj.weight"].T, "wk": t[m + "self_attn.k_proj.weight"].T,
            "wv": t[m + "self_attn.v_proj.weight"].T, "wo": t[m + "self_attn.o_proj.weight"].T,
            "mlp_norm": t[m + "post_attention_layernorm.weight"],
            "w_gate": t[m + "mlp.gate_proj.weight"].T, "w_up": t[m + "mlp.up_proj.weight"].T,
            "w_down": t[m + "mlp.down_proj.weight"].T,
        },
        "norm": t["norm.weight"],
        "lm_head": t["lm_head.weight"].T,
        "d2t": t["d2t"].astype(np.int32),
    }
    if "t2d" in t:
        p["t2d"] = t["t2d"]
    return p


@pytest.mark.parametrize("t2d,embed", [(True, False), (False, True)])
def test_eagle3_head_loads(tmp_path, t2d, embed):
    cfg = eagle_cfg()
    tensors = eagle_tensors(cfg, seed=20, t2d=t2d, embed=embed)
    root = write_checkpoint(tmp_path, cfg.to_hf(), tensors)
    cfg2, params = hf.load_eagle3(root, "fp32")
    assert cfg2 == cfg
    assert_params_equal(params, expected_eagle_params(tensors), np.dtype(np.float32))
    assert np.asarray(params["d2t"]).dtype == np.int32
    target_ids = np.arange(cfg.draft_vocab_size) + np.asarray(params["d2t"])
    assert target_ids.min() >= 0 and target_ids.max() < cfg.vocab_size


def test_save_eagle3_default_bf16_round_trip(tmp_path):
    cfg = eagle_cfg()
    tensors = eagle_tensors(cfg, seed=21)
    params = hf.eagle3_params_from_hf(cfg, tensors, "fp32")
    hf.save_eagle3(tmp_path / "head", cfg, params)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["torch_dtype"] == "bfloat16"
    cfg2, params2 = hf.load_eagle3(tmp_path / "head", "bf16")
    assert cfg2 == cfg
    assert_params_equal(params2, expected_eagle_params(tensors), BF16)
    back = hf.eagle3_params_to_hf(cfg, params2)
    assert back["d2t"].dtype == np.int64 and back["fc.weight"].dtype == BF16


def test_eagle3_bad_d2t_and_layout_in_one_error(tmp_path):
    cfg = eagle_cfg()
    tensors = eagle_tensors(cfg, seed=22)
    tensors["d2t"] = tensors["d2t"].copy()
    tensors["d2t"][3] = cfg.vocab_size  # draft 3 -> beyond the target vocabulary
    tensors["midlayer.self_attn.q_proj.weight"] = np.ones((16, 16), np.float32)  # needs [16, 2H]
    del tensors["midlayer.hidden_norm.weight"]
    tensors["midlayer.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    root = write_checkpoint(tmp_path, cfg.to_hf(), tensors)
    with pytest.raises(hf.CheckpointError) as info:
        hf.load_eagle3(root)
    msg = str(info.value)
    assert len(info.value.problems) == 4, msg
    assert "missing tensor midlayer.hidden_norm.weight (expected shape [16])" in msg
    assert "unexpected tensor midlayer.self_attn.rotary_emb.inv_freq" in msg
    assert "tensor midlayer.self_attn.q_proj.weight has shape [16, 16], expected [16, 32]" in msg
    assert "d2t maps 1 draft id(s) outside the target vocabulary [0, 50): draft 3 -> " in msg


def test_eagle3_duplicate_targets_and_inconsistent_t2d_refused():
    cfg = eagle_cfg()
    tensors = eagle_tensors(cfg, seed=23)
    d2t = tensors["d2t"].copy()
    d2t[1] = d2t[0] - 1  # draft 1 -> the same target id as draft 0
    tensors["d2t"] = d2t
    with pytest.raises(hf.CheckpointError) as info:
        hf.eagle3_params_from_hf(cfg, tensors)
    msg = str(info.value)
    assert "same target id" in msg and "t2d disagrees with d2t" in msg


def test_eagle3_config_problems_named(tmp_path):
    config = eagle_cfg().to_hf()
    config.update(num_hidden_layers=2, draft_vocab_size=99)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="num_hidden_layers=2"):
        hf.load_eagle3(tmp_path)
    config.update(num_hidden_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="draft_vocab_size 99 exceeds vocab_size 50"):
        hf.load_eagle3(tmp_path)


def test_eagle3_head_must_fit_its_target(tmp_path):
    cfg = eagle_cfg()
    root = write_checkpoint(tmp_path, cfg.to_hf(), eagle_tensors(cfg, seed=24))
    fits = tiny_cfg(hidden_size=16, vocab_size=50, num_layers=4)
    # target_hidden_size 20 is not the target's 16: a head trained on another model's features.
    with pytest.raises(ModelConfigError) as info:
        hf.load_eagle3(root, target=fits)
    assert "target_hidden_size 20" in str(info.value) and len(info.value.problems) == 1
    with pytest.raises(ModelConfigError) as info:
        hf.load_eagle3(root, target=tiny_cfg(hidden_size=20, vocab_size=60, num_layers=2))
    msg = str(info.value)
    assert "vocab_size 50 differs from the target's 60" in msg and "hidden_size 16 differs" in msg
    # Layers 2, L//2 and L-3 are three distinct layers only from L = 4 on: refused at load time,
    # with the other reasons, not later when the drafter is built.
    assert "the target has only 2" in msg and len(info.value.problems) == 3
    matched = write_checkpoint(tmp_path / "ok", eagle_cfg(target_hidden_size=16).to_hf(),
                               eagle_tensors(eagle_cfg(target_hidden_size=16), seed=25))
    head_cfg, _ = hf.load_eagle3(matched, target=fits)
    assert head_cfg.target_hidden_size == 16
