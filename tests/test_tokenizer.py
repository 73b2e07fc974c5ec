"""Tokenizer: a tiny byte-level BPE from tokenizer.json and from GGUF metadata, ChatML chat
templates rendered as transformers renders them, streaming detokenization across split UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from treespec_jax.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, TokenizerError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few merges so words become multi-byte tokens, and "€" (three UTF-8 bytes) splits into the
# tokens "âĤ" and "¬": a character that ends only with the token after.
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
          ("Ġwor", "l"), ("Ġworl", "d"), ("â", "Ĥ"), ("u", "s"), ("us", "er"), ("e", "r")]

# Written for these tests in the layout SmolLM2's ChatML template uses (a default system turn
# when the conversation has none), spread over lines so block trimming shows in the output.
CHATML = (
    "{% for message in messages %}\n"
    "    {% if loop.first and message['role'] != 'system' %}\n"
    "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
    "    {% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}\n"
)


def tiny_vocab() -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens in id order, merges): specials, the 256 byte symbols, then each merge's result."""
    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [a + b for a, b in MERGES]
    return tokens, list(MERGES)


def tiny_backend() -> Backend:
    tokens, merges = tiny_vocab()
    tok = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def add_tiny_tokenizer(w: gguf.GGUFWriter, template: str = CHATML, model: str = "gpt2", pre: str = "gpt2") -> None:
    """The tiny tokenizer's GGUF metadata, as llama.cpp's converter lays it out."""
    tokens, merges = tiny_vocab()
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(template)


def write_tokenizer_gguf(path: Path, **kw) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    add_tiny_tokenizer(w, **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def ckpt_dir(tmp_path) -> Path:
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tmp_path


TEXTS = ["hello world", "hello  hello\nworld", "user: hé €€ 😀!", "<|im_start|>user\nhello<|im_end|>\n", ""]


def test_from_dir_encode_decode_and_special_tokens(ckpt_dir):
    tok = Tokenizer.from_dir(ckpt_dir)
    tokens, _ = tiny_vocab()
    assert tok.vocab_size == len(tokens)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.stop_token_ids == (2, 0)  # eos first, then generation_config's, no repeats
    assert tok.special_token_ids == {0, 1, 2}
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld"]
    assert tok.encode("<|im_start|>user")[:1] == [1]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("<|im_start|>hello"), skip_special_tokens=True) == "hello"
    with pytest.raises(ValueError, match=r"\[9999\]"):
        tok.decode([3, 9999])


def test_chat_template_renders_like_transformers(ckpt_dir):
    tok = Tokenizer.from_dir(ckpt_dir)
    msgs = [{"role": "user", "content": "hello"}]
    expected = ("<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
                "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs) == expected
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected[:-len("<|im_start|>assistant\n")]
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.apply_chat_template(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    ids = tok.encode_chat(msgs)
    assert ids[0] == 1 and tok.decode(ids) == expected
    assert ids.count(2) == 2  # <|im_end|> is one special token, not spelled out in bytes


def test_chat_template_helpers_and_sandbox(tmp_path):
    def with_template(t: str) -> Tokenizer:
        return Tokenizer(tiny_backend(), bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=t)

    tok = with_template("{% if messages[0]['role'] == 'tool' %}{{ raise_exception('tool turns come later') }}"
                        "{% endif %}{{ bos_token }}{{ tools | tojson }}{{ eos_token }}")
    assert tok.apply_chat_template([{"role": "user", "content": ""}], tools=[{"name": "café"}]) == \
        '<|im_start|>[{"name": "café"}]<|im_end|>'
    with pytest.raises(ChatTemplateError, match="tool turns come later"):
        tok.apply_chat_template([{"role": "tool", "content": ""}])
    with pytest.raises(ChatTemplateError):
        with_template("{{ ''.__class__.__mro__ }}").apply_chat_template([])
    with pytest.raises(ChatTemplateError):
        with_template("{% set _ = messages.append(1) %}").apply_chat_template([])
    with pytest.raises(ValueError, match=r"\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": ""}, {"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tiny_backend()).apply_chat_template([])


def test_incremental_detokenizer_holds_back_split_characters(ckpt_dir):
    tok = Tokenizer.from_dir(ckpt_dir)
    text = "hello €😀 world€"
    ids = tok.encode(text)
    pieces_of = [tok.id_to_token(i) for i in ids]
    assert "âĤ" in pieces_of and "¬" in pieces_of  # "€" really spans two tokens
    d = IncrementalDetokenizer(tok)
    deltas = [d.push([i]) for i in ids]
    assert "" in deltas  # something was held back
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) + d.flush() == text == d.text
    assert list(tok.stream(ids)) == [x for x in deltas if x]

    # A stream that ends inside a character: flush gives up and emits the replacement char.
    d = tok.detokenizer()
    assert d.push(tok.encode("hello ")) == "hello "
    assert d.push([tok.token_to_id("âĤ")]) == ""
    assert d.flush() == "\ufffd"
    assert d.flush() == ""


def test_incremental_detokenizer_skips_special_tokens(ckpt_dir):
    tok = Tokenizer.from_dir(ckpt_dir)
    ids = tok.encode("hello<|im_end|> world")
    assert "".join(tok.stream(ids, skip_special_tokens=True)) == "hello world"
    assert "".join(tok.stream(ids)) == "hello<|im_end|> world"


def test_from_gguf_matches_tokenizer_json(ckpt_dir, tmp_path):
    ref = Tokenizer.from_dir(ckpt_dir)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf")
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == ref.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.stop_token_ids) == (1, 2, (2,))
    assert tok.special_token_ids == {0, 1, 2}
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "hello €"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    reader = gguf.GGUFReader(str(path))
    assert Tokenizer.from_gguf(reader).encode("hello world") == ref.encode("hello world")


def test_from_gguf_smollm_splits_digits(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "tok.gguf", pre="smollm"))
    plain = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "plain.gguf"))
    # With single-digit splitting "2025" is four pre-tokens; the tiny vocabulary has no digit
    # merges, so only the pre-tokens show (byte tokens either way), through decode and offsets.
    assert tok.backend.pre_tokenizer.pre_tokenize_str("in 2025") == [
        ("in", (0, 2)), ("Ġ", (2, 3)), ("2", (3, 4)), ("0", (4, 5)), ("2", (5, 6)), ("5", (6, 7))]
    assert tok.decode(tok.encode("in 2025")) == "in 2025"
    assert len(plain.backend.pre_tokenizer.pre_tokenize_str("in 2025")) == 2


def test_from_gguf_refuses_other_models_by_name(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", model="llama", pre="qwen2")
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf(path)
    msg = str(info.value)
    assert "tokenizer.ggml.model 'llama' is not supported" in msg
    assert "tokenizer.ggml.pre 'qwen2' is not supported" in msg


def test_from_dir_problems(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    assert "eos_token '</s>'" in str(info.value) and "bos_token '<s>'" in str(info.value)
