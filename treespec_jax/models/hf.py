"""Hugging Face safetensors checkpoints <-> the JAX params pytrees of the target and the EAGLE-3 head.

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards listed by
`model.safetensors.index.json`. HF stores projections `[out, in]` (torch's `x @ w.T`); the JAX
model multiplies `x @ w`, so every 2-D projection is transposed on the way in and back on the way
out. Every load checks the whole tensor set against the layout the config implies and raises one
`CheckpointError` naming every missing, unexpected and misshapen tensor, so a wrong checkpoint is
diagnosed in one try rather than one tensor at a time.

Public entry points: `load_target`, `load_eagle3` (directory -> config, params), the
`*_tensor_specs` layouts, the `*_params_from_hf` / `*_params_to_hf` conversions, and
`save_target` / `save_eagle3`. `read_safetensors_dir` opens a directory lazily as `Tensors`; the GGUF
loader (`treespec_jax.models.gguf`) hands its dequantized tensors to the same conversion.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

# Imported for its side effect too: it registers bfloat16 with numpy, which safetensors' numpy
# backend needs to hand back BF16 tensors without a torch round trip.
import ml_dtypes
import numpy as np

from treespec_jax.models.config import Eagle3Config, LlamaConfig, ModelConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# Serving dtype names (as in treespec_jax.support.MODEL_DTYPES) -> numpy dtypes jax accepts.
NP_DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
}
# What each serving dtype is called in an HF config's torch_dtype field.
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

_FLOAT_KINDS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16))


class CheckpointError(ValueError):
    """A checkpoint (or params pytree) that does not match its config; lists every problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


def resolve_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a serving dtype name; a ValueError names the bad value otherwise."""
    try:
        return NP_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {dtype!r} is not one of {tuple(NP_DTYPES)}") from None


def dtype_name(dtype: Any) -> str:
    """The serving dtype name ('bf16', 'fp16', 'fp32') of a numpy / jax dtype."""
    d = np.dtype(dtype)
    for name, npd in NP_DTYPES.items():
        if d == npd:
            return name
    raise ValueError(f"dtype {d} is none of the serving dtypes {tuple(NP_DTYPES)}")


# --------------------------------------------------------------------------------------------
# Lazily read tensors
# --------------------------------------------------------------------------------------------


class Tensors(Mapping):
    """name -> numpy array, read only when asked for; shapes and dtypes are known up front.

    Checking a checkpoint needs every tensor's shape but reading it needs memory, so the loaders
    check all shapes first and then read (and convert) one tensor at a time.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, np.dtype],
                 read: Callable[[str], np.ndarray]):
        self._shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self._dtypes = dict(dtypes)
        self._read = read

    @classmethod
    def of(cls, tensors: Mapping[str, Any]) -> "Tensors":
        """Wraps a plain mapping of arrays (a `Tensors` comes back as it is)."""
        if isinstance(tensors, Tensors):
            return tensors
        arrays = {k: v if hasattr(v, "shape") and hasattr(v, "dtype") else np.asarray(v) for k, v in tensors.items()}
        return cls({k: tuple(v.shape) for k, v in arrays.items()}, {k: np.dtype(v.dtype) for k, v in arrays.items()},
                   lambda name: np.asarray(arrays[name]))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> np.dtype:
        return self._dtypes[name]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _raw_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, byte offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_bf16_raw(path: str | os.PathLike, name: str) -> np.ndarray:
    """One BF16 tensor read from the file's bytes (the fallback for a safetensors build whose
    numpy backend cannot produce bfloat16 arrays)."""
    header, start = _raw_safetensors_header(Path(path))
    entry = header[name]
    if entry["dtype"] != "BF16":
        raise ValueError(f"{path}: tensor {name!r} is {entry['dtype']}, not BF16")
    lo, hi = entry["data_offsets"]
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start + lo, shape=(hi - lo,))
    return np.array(raw).view(ml_dtypes.bfloat16).reshape(entry["shape"])


_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
}


def _safetensors_dtype(code: str) -> np.dtype:
    # An exotic code (FP8, ...) gets a placeholder that is neither float nor int, so the layout
    # check reports it by name instead of this reader refusing the whole file.
    return np.dtype(_SAFETENSORS_DTYPES.get(code, np.void))


def read_safetensors_dir(path: str | os.PathLike) -> Tensors:
    """Every tensor of a checkpoint directory (one file or an index of shards), read lazily.

    Accepts `model.safetensors`, else `model.safetensors.index.json` with its shards, else a
    directory holding exactly one `*.safetensors` file. Raises CheckpointError listing every
    problem of the index (unreadable, shards missing, tensors absent from their shard).
    """
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(str(root), ["not a directory"])
    files: dict[str, Path] = {}  # tensor name -> the file holding it
    problems: list[str] = []
    if (root / SINGLE_FILE).is_file():
        chosen = [root / SINGLE_FILE]
        index = None
    elif (root / INDEX_FILE).is_file():
        try:
            index = json.loads((root / INDEX_FILE).read_text())
            weight_map = dict(index["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(str(root / INDEX_FILE), [f"unreadable index: {err}"]) from None
        shard_names = sorted(set(weight_map.values()))
        missing_shards = [s for s in shard_names if not (root / s).is_file()]
        problems += [f"shard {s!r} named by {INDEX_FILE} does not exist" for s in missing_shards]
        chosen = [root / s for s in shard_names if s not in missing_shards]
    else:
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if len(found) != 1:
            others = sorted(p.name for p in root.iterdir())
            raise CheckpointError(str(root), [
                f"no {SINGLE_FILE} or {INDEX_FILE} (and {len(found)} *.safetensors files, not exactly one); "
                f"the directory holds {others}"])
        chosen = [root / found[0]]
        index = None

    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, np.dtype] = {}
    for file in chosen:
        try:
            header, _ = _raw_safetensors_header(file)
        except (OSError, ValueError, struct.error) as err:
            problems.append(f"{file.name}: not a readable safetensors file ({err})")
            continue
        for name, entry in header.items():
            if index is not None and weight_map.get(name) != file.name:
                continue  # the index is authoritative about which shard holds a tensor
            shapes[name] = tuple(entry["shape"])
            dtypes[name] = _safetensors_dtype(entry["dtype"])
            files[name] = file
    if index is not None:
        for name, shard in sorted(weight_map.items()):
            if name not in files and (root / shard).is_file():
                problems.append(f"tensor {name!r} is listed in {INDEX_FILE} under {shard!r} but that shard lacks it")
    if problems:
        raise CheckpointError(str(root), problems)

    def read(name: str) -> np.ndarray:
        file = files[name]
        with safe_open(str(file), framework="numpy") as f:
            try:
                return f.get_tensor(name)
            except TypeError:
                if dtypes[name] == np.dtype(ml_dtypes.bfloat16):
                    return read_bf16_raw(file, name)
                raise

    return Tensors(shapes, dtypes, read)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory; a clear error when absent or not JSON."""
    file = Path(path) / CONFIG_FILE
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(str(path), [f"no {CONFIG_FILE}"]) from None
    except ValueError as err:
        raise CheckpointError(str(file), [f"not valid JSON: {err}"]) from None
    if not isinstance(data, dict):
        raise CheckpointError(str(file), [f"holds a {type(data).__name__}, not a JSON object"])
    return data


# --------------------------------------------------------------------------------------------
# Layouts: HF name, HF shape, where the tensor lives in the params pytree
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    hf_name: str
    shape: tuple[int, ...]  # HF shape ([out, in] for projections)
    path: tuple[str, ...] | None  # key path in the params pytree; None: accepted and dropped
    transpose: bool = False  # HF [out, in] <-> JAX [in, out]
    kind: str = "float"  # "float" (cast to the serving dtype), "int" (int32), "bool"
    required: bool = True


def _target_layout(cfg: LlamaConfig) -> list[_Entry]:
    H, V, F, D = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    Q, KV = cfg.q_width, cfg.kv_width
    out = [_Entry("model.embed_tokens.weight", (V, H), ("embed",))]
    for i in range(cfg.num_layers):
        p, k = f"model.layers.{i}.", f"layers_{i}"
        out += [
            _Entry(p + "input_layernorm.weight", (H,), (k, "attn_norm")),
            _Entry(p + "self_attn.q_proj.weight", (Q, H), (k, "wq"), transpose=True),
            _Entry(p + "self_attn.k_proj.weight", (KV, H), (k, "wk"), transpose=True),
            _Entry(p + "self_attn.v_proj.weight", (KV, H), (k, "wv"), transpose=True),
            _Entry(p + "self_attn.o_proj.weight", (H, Q), (k, "wo"), transpose=True),
        ]
        if cfg.attention_bias:
            out += [
                _Entry(p + "self_attn.q_proj.bias", (Q,), (k, "bq")),
                _Entry(p + "self_attn.k_proj.bias", (KV,), (k, "bk")),
                _Entry(p + "self_attn.v_proj.bias", (KV,), (k, "bv")),
            ]
        if cfg.qk_norm:
            out += [
                _Entry(p + "self_attn.q_norm.weight", (D,), (k, "q_norm")),
                _Entry(p + "self_attn.k_norm.weight", (D,), (k, "k_norm")),
            ]
        out += [
            _Entry(p + "post_attention_layernorm.weight", (H,), (k, "mlp_norm")),
            _Entry(p + "mlp.gate_proj.weight", (F, H), (k, "w_gate"), transpose=True),
            _Entry(p + "mlp.up_proj.weight", (F, H), (k, "w_up"), transpose=True),
            _Entry(p + "mlp.down_proj.weight", (H, F), (k, "w_down"), transpose=True),
        ]
    out.append(_Entry("model.norm.weight", (H,), ("norm",)))
    if cfg.tie_word_embeddings:
        # Some tied checkpoints still ship lm_head.weight (a copy of the embedding). Under tying
        # the embedding is the head, as transformers also treats it, so the copy is dropped.
        out.append(_Entry("lm_head.weight", (V, H), None, required=False))
    else:
        out.append(_Entry("lm_head.weight", (V, H), ("lm_head",), transpose=True))
    return out


def _eagle3_layout(cfg: Eagle3Config) -> list[_Entry]:
    H, F, Ht = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    m = "midlayer."
    return [
        _Entry("fc.weight", (H, 3 * Ht), ("fc",), transpose=True),
        _Entry(m + "input_layernorm.weight", (H,), ("input_norm",)),
        _Entry(m + "hidden_norm.weight", (H,), ("hidden_norm",)),
        _Entry(m + "self_attn.q_proj.weight", (Q, 2 * H), ("layer", "wq"), transpose=True),
        _Entry(m + "self_attn.k_proj.weight", (KV, 2 * H), ("layer", "wk"), transpose=True),
        _Entry(m + "self_attn.v_proj.weight", (KV, 2 * H), ("layer", "wv"), transpose=True),
        _Entry(m + "self_attn.o_proj.weight", (H, Q), ("layer", "wo"), transpose=True),
        _Entry(m + "post_attention_layernorm.weight", (H,), ("layer", "mlp_norm")),
        _Entry(m + "mlp.gate_proj.weight", (F, H), ("layer", "w_gate"), transpose=True),
        _Entry(m + "mlp.up_proj.weight", (F, H), ("layer", "w_up"), transpose=True),
        _Entry(m + "mlp.down_proj.weight", (H, F), ("layer", "w_down"), transpose=True),
        _Entry("norm.weight", (H,), ("norm",)),
        _Entry("lm_head.weight", (cfg.draft_vocab_size, H), ("lm_head",), transpose=True),
        _Entry("d2t", (cfg.draft_vocab_size,), ("d2t",), kind="int"),
        _Entry("t2d", (cfg.vocab_size,), ("t2d",), kind="bool", required=False),
        # Some published heads carry a copy of the target's token embedding; the head embeds
        # with the target's own table, so the copy is dropped.
        _Entry("embed_tokens.weight", (cfg.vocab_size, H), None, required=False),
    ]


def target_tensor_specs(cfg: LlamaConfig, *, optional: bool = False) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape that a target checkpoint of `cfg` must hold.

    With `optional=True` also the tensors it may hold (a tied model's redundant lm_head.weight).
    """
    return {e.hf_name: e.shape for e in _target_layout(cfg) if e.required or optional}


def eagle3_tensor_specs(cfg: Eagle3Config, *, optional: bool = False) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape that an EAGLE-3 head of `cfg` must hold (`optional=True`: also
    t2d and a copied embed_tokens.weight, which it may hold)."""
    return {e.hf_name: e.shape for e in _eagle3_layout(cfg) if e.required or optional}


def _kind_ok(kind: str, dtype: np.dtype) -> bool:
    if kind == "float":
        return dtype in _FLOAT_KINDS
    if kind == "int":
        return np.issubdtype(dtype, np.integer)
    return dtype == np.dtype(np.bool_)


def _layout_problems(layout: list[_Entry], tensors: Tensors) -> list[str]:
    """Every missing, unexpected, misshapen or wrongly typed tensor."""
    by_name = {e.hf_name: e for e in layout}
    missing, unexpected, misshapen, mistyped = [], [], [], []
    for e in layout:
        if e.hf_name not in tensors and e.required:
            missing.append(f"missing tensor {e.hf_name} (expected shape {list(e.shape)})")
    for name in sorted(tensors):
        e = by_name.get(name)
        if e is None:
            unexpected.append(f"unexpected tensor {name} (shape {list(tensors.shape(name))})")
            continue
        got = tensors.shape(name)
        if got != e.shape:
            misshapen.append(f"tensor {name} has shape {list(got)}, expected {list(e.shape)}")
        dt = tensors.dtype(name)
        if not _kind_ok(e.kind, dt):
            want = {"float": "a float dtype", "int": "an integer dtype", "bool": "bool"}[e.kind]
            mistyped.append(f"tensor {name} has dtype {dt}, expected {want}")
    return missing + unexpected + misshapen + mistyped


@functools.lru_cache(maxsize=None)
def _on_device(transpose: bool, dtype: np.dtype):
    import jax

    return jax.jit(lambda x: (x.T if transpose else x).astype(dtype))


def _convert(e: _Entry, arr: np.ndarray, dtype: np.dtype):
    import jax.numpy as jnp

    arr = np.asarray(arr)
    if e.kind == "int":
        return jnp.asarray(arr.astype(np.int32))
    if e.kind == "bool":
        return jnp.asarray(arr.astype(np.bool_))
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)  # jax holds no float64 unless x64 is enabled
    # The transpose and the cast run on the device: the host would do both at memory speed on
    # one core, the accelerator far faster. XLA's float -> bf16 rounds to nearest even, as
    # ml_dtypes does on the host.
    return _on_device(e.transpose, dtype)(jnp.asarray(arr))


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _params_from(layout: list[_Entry], tensors: Tensors, dtype: np.dtype) -> dict:
    params: dict = {}
    for e in layout:
        if e.path is None or e.hf_name not in tensors:
            continue
        _set(params, e.path, _convert(e, tensors[e.hf_name], dtype))
    return params


def target_params_from_hf(cfg: LlamaConfig, tensors: Mapping[str, Any], dtype: str = "bf16",
                          source: str = "checkpoint") -> dict:
    """The JAX params pytree of `cfg` from HF-named tensors, cast to `dtype`.

    Raises CheckpointError listing every missing, unexpected, misshapen or wrongly typed tensor.
    """
    npd = resolve_dtype(dtype)
    tensors = Tensors.of(tensors)
    layout = _target_layout(cfg)
    problems = _layout_problems(layout, tensors)
    if problems:
        raise CheckpointError(source, problems)
    return _params_from(layout, tensors, npd)


def _d2t_problems(cfg: Eagle3Config, tensors: Tensors) -> list[str]:
    """d2t must send every draft id into [0, V), to distinct target ids, and agree with t2d."""
    if tensors.shape("d2t") != (cfg.draft_vocab_size,) or not np.issubdtype(tensors.dtype("d2t"), np.integer):
        return []  # already reported by the layout check
    d2t = np.asarray(tensors["d2t"]).astype(np.int64)
    target = np.arange(cfg.draft_vocab_size, dtype=np.int64) + d2t
    problems = []
    bad = np.flatnonzero((target < 0) | (target >= cfg.vocab_size))
    if bad.size:
        shown = ", ".join(f"draft {i} -> {target[i]}" for i in bad[:8])
        problems.append(f"d2t maps {bad.size} draft id(s) outside the target vocabulary [0, {cfg.vocab_size}): "
                        f"{shown}{' ...' if bad.size > 8 else ''}")
        return problems
    uniq, counts = np.unique(target, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1]
        problems.append(f"d2t maps several draft ids to the same target id ({dup.size} target ids shared, "
                        f"e.g. {dup[:8].tolist()})")
    if "t2d" in tensors and tensors.shape("t2d") == (cfg.vocab_size,) and tensors.dtype("t2d") == np.dtype(np.bool_):
        t2d = np.asarray(tensors["t2d"])
        expected = np.zeros(cfg.vocab_size, dtype=bool)
        expected[target] = True
        wrong = np.flatnonzero(t2d != expected)
        if wrong.size:
            problems.append(f"t2d disagrees with d2t at {wrong.size} target id(s), e.g. {wrong[:8].tolist()} "
                            f"(t2d must be true exactly at the targets of d2t)")
    return problems


def eagle3_params_from_hf(cfg: Eagle3Config, tensors: Mapping[str, Any], dtype: str = "bf16",
                          source: str = "checkpoint") -> dict:
    """The EAGLE-3 head's JAX params from HF-named tensors, floats cast to `dtype`, d2t int32.

    Raises CheckpointError listing every layout problem and every defect of the d2t / t2d maps.
    """
    npd = resolve_dtype(dtype)
    tensors = Tensors.of(tensors)
    layout = _eagle3_layout(cfg)
    problems = _layout_problems(layout, tensors)
    if "d2t" in tensors:
        problems += _d2t_problems(cfg, tensors)
    if problems:
        raise CheckpointError(source, problems)
    return _params_from(layout, tensors, npd)


def _params_to(layout: list[_Entry], params: Mapping, dtype: np.dtype | None, source: str) -> dict[str, np.ndarray]:
    """HF-named numpy arrays from a params pytree, after checking it has exactly the layout."""
    problems = []
    leaves: dict[tuple[str, ...], Any] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, prefix + (str(k),))
        else:
            leaves[prefix] = node

    walk(params, ())
    expected_paths = {e.path: e for e in layout if e.path is not None}
    for path, e in expected_paths.items():
        want = e.shape[::-1] if e.transpose else e.shape
        if path not in leaves:
            if e.required:
                problems.append(f"missing param {'/'.join(path)} (expected shape {list(want)})")
            continue
        got = tuple(np.shape(leaves[path]))
        if got != want:
            problems.append(f"param {'/'.join(path)} has shape {list(got)}, expected {list(want)}")
    for path in sorted(set(leaves) - set(expected_paths)):
        problems.append(f"unexpected param {'/'.join(path)} (shape {list(np.shape(leaves[path]))})")
    if problems:
        raise CheckpointError(source, problems)
    out = {}
    for path, e in expected_paths.items():
        if path not in leaves:
            continue
        arr = np.asarray(leaves[path])
        if e.kind == "int":
            arr = arr.astype(np.int64)  # the published d2t is int64
        elif e.kind == "bool":
            arr = arr.astype(np.bool_)
        else:
            if e.transpose:
                arr = arr.T
            if dtype is not None:
                arr = arr.astype(dtype)
        out[e.hf_name] = np.ascontiguousarray(arr)
    return out


def target_params_to_hf(cfg: LlamaConfig, params: Mapping, dtype: str | None = None) -> dict[str, np.ndarray]:
    """HF name -> numpy array (HF `[out, in]` layout) of a target params pytree.

    `dtype`: cast floats to this serving dtype; None keeps each array's own dtype.
    """
    npd = None if dtype is None else resolve_dtype(dtype)
    return _params_to(_target_layout(cfg), params, npd, "target params")


def eagle3_params_to_hf(cfg: Eagle3Config, params: Mapping, dtype: str | None = None) -> dict[str, np.ndarray]:
    """HF name -> numpy array of an EAGLE-3 head's params (d2t as int64, t2d bool if present)."""
    npd = None if dtype is None else resolve_dtype(dtype)
    return _params_to(_eagle3_layout(cfg), params, npd, "EAGLE-3 params")


# --------------------------------------------------------------------------------------------
# Directories
# --------------------------------------------------------------------------------------------


def _write(path: str | os.PathLike, config: dict[str, Any], tensors: dict[str, np.ndarray],
           dtype_label: str | None) -> Path:
    from safetensors.numpy import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if dtype_label is not None:
        config = {**config, "torch_dtype": TORCH_DTYPE_NAMES[dtype_label]}
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(root / SINGLE_FILE), metadata={"format": "pt"})
    return root


def _float_label(tensors: dict[str, np.ndarray]) -> str | None:
    for arr in tensors.values():
        if arr.dtype in _FLOAT_KINDS:
            try:
                return dtype_name(arr.dtype)
            except ValueError:
                return None
    return None


def save_target(path: str | os.PathLike, cfg: LlamaConfig, params: Mapping, dtype: str | None = None) -> Path:
    """Writes `config.json` and one `model.safetensors` that `load_target` reads back.

    `dtype`: the stored float dtype; None keeps the params' own.
    """
    tensors = target_params_to_hf(cfg, params, dtype)
    return _write(path, cfg.to_hf(), tensors, dtype or _float_label(tensors))


def save_eagle3(path: str | os.PathLike, cfg: Eagle3Config, params: Mapping, dtype: str | None = "bf16") -> Path:
    """Writes an EAGLE-3 head in the published HF layout (`config.json` + `model.safetensors`),
    floats in `dtype` (bf16 by default, as heads are published; None keeps the params' dtype)."""
    tensors = eagle3_params_to_hf(cfg, params, dtype)
    return _write(path, cfg.to_hf(), tensors, dtype or _float_label(tensors))


def load_target(path: str | os.PathLike, dtype: str = "bf16") -> tuple[LlamaConfig, dict]:
    """(config, params) of an HF target checkpoint directory, floats cast to `dtype`.

    Raises ModelConfigError for an unsupported config and CheckpointError naming every tensor
    problem at once.
    """
    resolve_dtype(dtype)
    cfg = LlamaConfig.from_hf(read_config(path), source=str(Path(path) / CONFIG_FILE))
    tensors = read_safetensors_dir(path)
    return cfg, target_params_from_hf(cfg, tensors, dtype, source=str(path))


def load_eagle3(path: str | os.PathLike, dtype: str = "bf16",
                target: LlamaConfig | None = None) -> tuple[Eagle3Config, dict]:
    """(config, params) of a published-format EAGLE-3 head directory, floats cast to `dtype`.

    `target`: the config of the model it drafts for; a head that does not fit it is refused.
    Config problems (with any misfit to `target`) raise one ModelConfigError; tensor problems
    one CheckpointError.
    """
    resolve_dtype(dtype)
    source = str(Path(path) / CONFIG_FILE)
    cfg = Eagle3Config.from_hf(read_config(path), source=source)
    problems = []
    for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                 "draft_vocab_size", "target_hidden_size"):
        value = getattr(cfg, name)
        if value < 1:
            problems.append(f"{name} must be a positive integer, got {value}")
    if cfg.num_kv_heads >= 1 and cfg.num_heads % cfg.num_kv_heads:
        problems.append(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    if cfg.head_dim % 2:
        problems.append(f"head_dim {cfg.head_dim} must be even (RoPE rotates halves)")
    if cfg.draft_vocab_size > cfg.vocab_size:
        problems.append(f"draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
    if target is not None:
        problems += cfg.target_problems(target)
    if problems:
        raise ModelConfigError(source, problems)
    tensors = read_safetensors_dir(path)
    return cfg, eagle3_params_from_hf(cfg, tensors, dtype, source=str(path))
