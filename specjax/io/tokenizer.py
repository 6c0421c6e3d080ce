"""One tokenizer interface over HF ``tokenizers`` and ``sentencepiece``.

Three sources:

* ``tokenizer.json`` of an HF checkpoint (:meth:`Tokenizer.from_hf_dir`);
* the vocabulary and merges stored in a GGUF file's metadata (:meth:`Tokenizer.from_gguf`),
  rebuilt as an HF byte-level BPE tokenizer;
* a sentencepiece ``tokenizer.model`` (:meth:`Tokenizer.from_sentencepiece`).

Chat prompts: ChatML templates of the shape SmolLM2 ships (optionally with a default system
prompt inserted when the conversation has none) are formatted natively, so the default model
needs no template engine; any other Jinja template is rendered with ``jinja2`` the way
transformers' ``apply_chat_template`` renders it.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_GGUF_NORMAL, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 3, 4

# `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp applies before byte-level BPE.
_GGUF_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
}

# ChatML as SmolLM2 writes it, with an optional default system prompt. Templates that match
# exactly are formatted by `_chatml`; anything else goes through jinja2.
_CHATML_RE = re.compile(
    re.escape("{% for message in messages %}")
    + "(?:" + re.escape("{% if loop.first and messages[0]['role'] != 'system' %}"
                        "{{ '<|im_start|>system\n")
    + r"(?P<system>[^'\\{}]*)"
    + re.escape("<|im_end|>\n' }}{% endif %}") + ")?"
    + re.escape("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
                " + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\n' }}{% endif %}")
)


class _HFBackend:
    """An HF ``tokenizers.Tokenizer``; added special tokens are matched in the input text."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        added = tok.get_added_tokens_decoder()  # ids may lie beyond the base vocabulary
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True),
                              max(added, default=-1) + 1)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)


class _SentencePieceBackend:
    """A sentencepiece model. sentencepiece never produces control pieces (``<s>``, ``</s>``,
    ``control_symbols``) from text, so we split the text at their spellings ourselves, as HF
    slow tokenizers do, and encode the pieces between."""

    def __init__(self, sp):
        self.sp = sp
        self.vocab_size = sp.get_piece_size()
        self.bos = sp.bos_id() if sp.bos_id() >= 0 else None
        self.special = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i)}
        self.special_ids = set(self.special.values())
        longest_first = sorted(self.special, key=len, reverse=True)
        self.special_re = (re.compile("|".join(map(re.escape, longest_first)))
                           if self.special else None)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [self.bos] if add_special_tokens and self.bos is not None else []
        pos = 0
        for m in self.special_re.finditer(text) if self.special_re else ():
            if m.start() > pos:
                ids += self.sp.encode(text[pos:m.start()])
            ids.append(self.special[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self.sp.encode(text[pos:])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out, run = [], []
        for i in ids:
            if i in self.special_ids:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens:
                    out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None


class Tokenizer:
    """Text <-> token ids, end-of-sequence ids, and chat formatting.

    Args:
      backend: a ``tokenizers.Tokenizer`` or a ``sentencepiece.SentencePieceProcessor``.
      eos_ids: every id that ends generation; the first is the primary one.
      bos_id: the beginning-of-sequence id, or None when the model has none.
      chat_template: the checkpoint's Jinja chat template, or None (then plain ChatML, if the
        vocabulary has ``<|im_start|>`` and ``<|im_end|>``).
    """

    def __init__(self, backend, *, eos_ids: Iterable[int], bos_id: int | None = None,
                 chat_template: str | None = None):
        if isinstance(backend, tokenizers.Tokenizer):
            self._backend = _HFBackend(backend)
        else:
            self._backend = _SentencePieceBackend(backend)
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.bos_id = None if bos_id is None else int(bos_id)
        self.chat_template = chat_template
        ids = self.eos_ids if self.bos_id is None else (*self.eos_ids, self.bos_id)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"bos/eos ids {bad} out of range for a vocabulary of {self.vocab_size}")

    def __repr__(self) -> str:
        kind = "hf" if isinstance(self._backend, _HFBackend) else "sentencepiece"
        return (f"Tokenizer({kind}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, "
                f"bos_id={self.bos_id})")

    # ----------------------------------------------------------------------------- basics

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id (added tokens included)."""
        return self._backend.vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token spellings in it become their single ids.

        ``add_special_tokens`` adds what the tokenizer adds around a sequence (e.g. Llama-3's
        BOS); it changes nothing for SmolLM2. Chat prompts already contain their special tokens:
        use :meth:`encode_chat`.
        """
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (ints, or a 1-D int array); special tokens are spelled out
        unless ``skip_special_tokens``."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token``, or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(int(i))

    # ------------------------------------------------------------------------------- chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation of ``{"role": ..., "content": ...}`` messages.

        For SmolLM2 (ChatML with a default system prompt) and one user message "Hi"::

            <|im_start|>system
            You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
            <|im_start|>user
            Hi<|im_end|>
            <|im_start|>assistant

        (the last line is the generation prompt, ending in a newline).
        """
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        template = self.chat_template
        if template is None:
            if None in (self.token_to_id("<|im_start|>"), self.token_to_id("<|im_end|>")):
                raise ValueError("this tokenizer has no chat template and no ChatML tokens")
            return _chatml(messages, add_generation_prompt, default_system=None)
        match = _CHATML_RE.fullmatch(template)
        if match:
            return _chatml(messages, add_generation_prompt, default_system=match["system"])
        bos = None if self.bos_id is None else self.id_to_token(self.bos_id)
        eos = self.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        return _compile_jinja(template).render(
            messages=list(messages), tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
        )

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """``encode(apply_chat_template(...))`` without adding special tokens twice."""
        prompt = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)

    # ------------------------------------------------------------------------ constructors

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From an HF checkpoint directory: ``tokenizer.json`` plus, where present,
        ``tokenizer_config.json`` (bos/eos tokens, chat template), ``chat_template.jinja``, and
        the ``eos_token_id`` of ``generation_config.json`` and ``config.json``."""
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tc = _read_json(path / "tokenizer_config.json")
        eos_token = _token_text(tc.get("eos_token"))
        eos = [None if eos_token is None else tok.token_to_id(eos_token)]
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            eos += value if isinstance(value, list) else [value]
        bos = _token_text(tc.get("bos_token"))
        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, eos_ids=[i for i in eos if i is not None],
                   bos_id=None if bos is None else tok.token_to_id(bos), chat_template=template)

    @classmethod
    def from_sentencepiece(cls, path: str | Path, *, chat_template: str | None = None,
                           eos_ids: Iterable[int] | None = None) -> "Tokenizer":
        """From a sentencepiece ``tokenizer.model``; eos defaults to the model's ``</s>``."""
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        if eos_ids is None:
            eos_ids = [sp.eos_id()] if sp.eos_id() >= 0 else []
        bos = sp.bos_id() if sp.bos_id() >= 0 else None
        return cls(sp, eos_ids=eos_ids, bos_id=bos, chat_template=chat_template)

    @classmethod
    def from_gguf(cls, path: str | Path, *, cache: bool = True) -> "Tokenizer":
        """From the tokenizer stored in a GGUF file's metadata (cached like its weights)."""
        from specjax.io.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path, cache=cache)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Rebuild the tokenizer from GGUF ``tokenizer.*`` metadata values.

        Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizers in
        ``_GGUF_PRE_TOKENIZERS`` is supported: ``models.BPE(vocab, merges)``, the matching
        pre-tokenizer, a ByteLevel decoder, and CONTROL tokens added as special tokens (without
        them ``<|im_start|>`` would be split into pieces).
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' "
                             "(byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                             f"{sorted(_GGUF_PRE_TOKENIZERS)}")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("GGUF vocabulary has duplicate tokens")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)])
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(tok, eos_ids=[i for i in eos if i is not None], bos_id=bos,
                   chat_template=meta.get("tokenizer.chat_template"))

    # ---------------------------------------------------------------------- serialisation

    def to_json(self) -> str:
        """Everything needed by :meth:`from_json` (HF-backed tokenizers only)."""
        if not isinstance(self._backend, _HFBackend):
            raise TypeError("only tokenizers backed by HF `tokenizers` serialise to JSON")
        return json.dumps({"format": 1, "tokenizer": self._backend.tok.to_str(),
                           "eos_ids": list(self.eos_ids), "bos_id": self.bos_id,
                           "chat_template": self.chat_template})

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        data = json.loads(text)
        if data.get("format") != 1:
            raise ValueError(f"unknown tokenizer JSON format {data.get('format')!r}")
        return cls(tokenizers.Tokenizer.from_str(data["tokenizer"]), eos_ids=data["eos_ids"],
                   bos_id=data["bos_id"], chat_template=data["chat_template"])


def _chatml(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
            default_system: str | None) -> str:
    parts = []
    if default_system is not None and messages and messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


@functools.lru_cache(maxsize=8)
def _compile_jinja(template: str):
    """Compile a chat template in the sandboxed environment transformers uses."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("this chat template needs jinja2: pip install jinja2") from None
    import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (older tokenizer_config.json) -> ``"<s>"``."""
    return token.get("content") if isinstance(token, Mapping) else token
