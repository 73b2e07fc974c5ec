"""Tokenizer for serving: HF `tokenizers` underneath, chat templates through jinja2.

`Tokenizer.from_dir` reads a checkpoint's `tokenizer.json` (+ `tokenizer_config.json`,
`generation_config.json`, `chat_template.jinja` when present); `Tokenizer.from_gguf` rebuilds a
byte-level BPE tokenizer from GGUF metadata. Chat templates render in a sandboxed jinja2
environment set up the way transformers renders them (blocks trimmed, loop controls, a
`raise_exception` helper, a non-ASCII-escaping `tojson`), so a checkpoint's template yields the
prompt it was trained on. `IncrementalDetokenizer` turns a growing token list into text deltas
for streaming without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole character

# GGUF token types (llama.cpp's vocabulary attribute codes).
GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_UNKNOWN = 2
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4
GGUF_TOKEN_UNUSED = 5
GGUF_TOKEN_BYTE = 6
GGUF_SPECIAL_TYPES = (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)

# GGUF pre-tokenizer names this module can rebuild exactly; others would split text differently
# from what the model was trained on, so they are refused by name.
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


class TokenizerError(ValueError):
    """A tokenizer source this module cannot rebuild faithfully; lists every problem."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


class ChatTemplateError(ValueError):
    """A chat template that failed to render (including its own raise_exception calls)."""


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError("tokenizer_config.json", [f"special token {value!r} is neither a string nor has 'content'"])


def _ids_of(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _chat_environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Templates print tool schemas with tojson; keeping non-ASCII text readable matches what
        # the model saw in training (jinja's own tojson escapes it and HTML characters).
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs around it: special tokens, stop ids,
    the chat template."""

    def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, extra_stop_ids: Iterable[int] = (),
                 source: str = "tokenizer"):
        self.backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        problems = []
        for label, tok in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
                           ("unk_token", unk_token)):
            if tok is not None and backend.token_to_id(tok) is None:
                problems.append(f"{label} {tok!r} is not in the vocabulary")
        stops = [int(i) for i in extra_stop_ids]
        size = backend.get_vocab_size(with_added_tokens=True)
        problems += [f"stop id {i} is outside the vocabulary [0, {size})" for i in stops if not 0 <= i < size]
        if problems:
            raise TokenizerError(source, problems)
        if eos_token is not None:
            stops.insert(0, backend.token_to_id(eos_token))
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))  # ordered, no repeats
        self._template = None

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """From an HF checkpoint directory: tokenizer.json, and when present tokenizer_config.json
        (special tokens, chat_template), chat_template.jinja, generation_config.json and
        config.json (their eos_token_id entries become extra stop ids)."""
        from tokenizers import Tokenizer as Backend

        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(str(root), ["no tokenizer.json (only fast-tokenizer checkpoints are supported)"])
        backend = Backend.from_file(str(file))
        config = _read_json(root / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):
            # A list of named templates; "default" is the one a plain chat uses.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
            if template is None:
                raise TokenizerError(str(root / "tokenizer_config.json"),
                                     [f"chat_template lists {sorted(map(str, named))} but no 'default'"])
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        stops: list[int] = []
        for extra in ("generation_config.json", "config.json"):
            stops += _ids_of(_read_json(root / extra).get("eos_token_id"))
        return cls(backend, bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")),
                   pad_token=_token_content(config.get("pad_token")),
                   unk_token=_token_content(config.get("unk_token")),
                   chat_template=template, extra_stop_ids=stops, source=str(root))

    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        """A byte-level BPE tokenizer from a GGUF's `tokenizer.*` metadata.

        Only `tokenizer.ggml.model == "gpt2"` is rebuilt, with the pre-tokenizers named in
        GGUF_PRE_TOKENIZERS; anything else raises TokenizerError naming it. CONTROL and
        USER_DEFINED tokens become special added tokens, matched before BPE.
        """
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, processors

        from treespec_jax.models.gguf import GGUFMetadata, open_gguf

        reader = open_gguf(reader_or_path)
        source = str(getattr(reader, "path", reader_or_path))
        meta = GGUFMetadata(reader)
        problems = []
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            problems.append(f"tokenizer.ggml.model {model!r} is not supported (only 'gpt2', byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            problems.append(f"tokenizer.ggml.pre {pre!r} is not supported (only {list(GGUF_PRE_TOKENIZERS)})")
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if tokens is None:
            problems.append("no tokenizer.ggml.tokens")
        if merges is None and model == "gpt2":
            problems.append("no tokenizer.ggml.merges")
        if problems:
            raise TokenizerError(source, problems)
        types = meta.get("tokenizer.ggml.token_type") or [GGUF_TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            problems.append(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if tok in vocab:
                problems.append(f"token {tok!r} appears twice (ids {vocab[tok]} and {i})")
            else:
                vocab[tok] = i
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                problems.append(f"merge {m!r} is not two space-separated tokens")
            else:
                pairs.append((parts[0], parts[1]))
        ids = {}
        for key in ("bos", "eos", "unknown", "padding", "eot", "eom"):
            value = meta.get(f"tokenizer.ggml.{key}_token_id")
            if value is not None:
                if not 0 <= int(value) < len(tokens):
                    problems.append(f"tokenizer.ggml.{key}_token_id {value} is outside [0, {len(tokens)})")
                else:
                    ids[key] = int(value)
        if problems:
            raise TokenizerError(source, problems)

        backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            # SmolLM's pre-tokenizer splits numbers into single digits before the GPT-2 split.
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, t in enumerate(types) if int(t) in GGUF_SPECIAL_TYPES]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = tokens[ids["bos"]] if "bos" in ids else None
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])])
        stops = [ids[k] for k in ("eot", "eom") if k in ids]
        return cls(backend, bos_token=bos, eos_token=tokens[ids["eos"]] if "eos" in ids else None,
                   pad_token=tokens[ids["padding"]] if "padding" in ids else None,
                   unk_token=tokens[ids["unknown"]] if "unknown" in ids else None,
                   chat_template=meta.get("tokenizer.chat_template"), extra_stop_ids=stops, source=source)

    # ---------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.backend.token_to_id(self.pad_token)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # ---------------------------------------------------------------- text <-> ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` lets the tokenizer's post-processor add
        its BOS (or whatever it adds). Special-token strings in `text` map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text of a conversation, rendered by the checkpoint's chat template.

        `messages`: [{"role": ..., "content": ...}, ...]. Extra keyword arguments (tools,
        documents, ...) are passed to the template as variables.
        """
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source} has no chat template")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        bad = [i for i, m in enumerate(messages) if not isinstance(m, Mapping) or "role" not in m]
        if bad:
            raise ValueError(f"messages at positions {bad} are not dicts with a 'role'")
        if self._template is None:
            self._template = _chat_environment().from_string(self.chat_template)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **kwargs,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        import jinja2

        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"chat template of {self.source} failed: {err}") from err

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation. The template writes any BOS itself, so the
        post-processor adds nothing."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---------------------------------------------------------------- streaming

    def detokenizer(self, *, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def stream(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> Iterator[str]:
        """Text pieces of a token stream as they become whole characters (empty pieces skipped)."""
        d = self.detokenizer(skip_special_tokens=skip_special_tokens)
        for i in ids:
            piece = d.push([i])
            if piece:
                yield piece
        tail = d.flush()
        if tail:
            yield tail


class IncrementalDetokenizer:
    """Text deltas of a growing token list.

    Each `push` decodes only a short window: the tokens since the last emitted point plus the
    tokens before it back to the point before that. Decoding the window with and without the
    new tokens and taking the difference keeps decoders that treat a sequence's first token
    specially (SentencePiece's leading space) from changing already emitted text. A delta that
    ends in U+FFFD is held back: its last token ended inside a multi-byte character whose
    remaining bytes come with later tokens. `flush` emits whatever is still held.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been emitted
        self.text = ""  # everything emitted so far

    def _delta(self) -> str:
        before = self._tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self.ids[self._prefix:], skip_special_tokens=self._skip)
        return after[len(before):] if after.startswith(before) else after

    def _advance(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def push(self, new_ids: Iterable[int]) -> str:
        """Appends tokens; returns the text they complete ("" while a character is unfinished)."""
        self.ids.extend(int(i) for i in new_ids)
        if len(self.ids) == self._read:
            return ""
        delta = self._delta()
        if delta.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(delta)

    def flush(self) -> str:
        """At the end of the stream: the held-back text, undecodable bytes as U+FFFD."""
        if len(self.ids) == self._read:
            return ""
        return self._advance(self._delta())


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except ValueError as err:
        raise TokenizerError(str(file), [f"not valid JSON: {err}"]) from None
    return data if isinstance(data, dict) else {}
