"""Tokenization in the router, without torch: the `tokenizers` library reads the model
folder's `tokenizer.json`, and jinja2 renders the chat template of `tokenizer_config.json`
(or `chat_template.jinja`). Streamed ids become text in `detokenizer.py`.

API: `RouterTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

_GIL_FREE_CHARS = 16384  # longer texts are encoded without holding the GIL
_GIL_FREE_IDS = 16384  # and longer id lists decoded without it


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class RouterTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in the model folder {folder}")
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        self.bos_token = _token_text(tok_config.get("bos_token")) or ""
        self.eos_token = _token_text(tok_config.get("eos_token")) or ""
        eos_id = model_config.get("eos_token_id")
        eos_ids = eos_id if isinstance(eos_id, list) else [eos_id]
        self.eos_token_ids = [i for i in eos_ids if isinstance(i, int)]
        self.max_model_len = int(model_config.get("max_position_embeddings")
                                 or tok_config.get("model_max_length") or 2048)
        template = tok_config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self.template_source = template if isinstance(template, str) else ""
        self._template = env.from_string(template) if isinstance(template, str) else None
        self._token_texts: dict[int, str] = {}
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items()
                                      if t.special)
        # SentencePiece byte fallback ("<0xE2>"): the decode joins a run of them as one text
        byte_ids = (self._tok.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self.byte_token_ids = frozenset(i for i in byte_ids if i is not None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # `Tokenizer.encode` holds the GIL throughout (seconds for a prompt of megabytes,
            # stalling the event loop even from a thread); `encode_batch` releases it
            batch = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            return batch[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) > _GIL_FREE_IDS:  # as `encode`: `decode` holds the GIL throughout
            return self._tok.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decodable_ids(self, token_ids: list[int]) -> list[int]:
        """`token_ids` less the special ids that `decode` skips (the decode is the same)."""
        special = self._special_ids
        return [i for i in token_ids if i not in special]

    @property
    def template_uses_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (else tools go in a prompt)."""
        return "tools" in self.template_source

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), as logprobs show it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < (1 << 18):
                self._token_texts[token_id] = text
        return text

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this (excluded), added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (e.g. "▁Hello", "Ġworld")."""
        return [self._tok.id_to_token(i) or "" for i in token_ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            add_special_tokens: bool = False,
                            tools: list[dict] | None = None) -> list[int]:
        """Render the chat and tokenize it; the template places the special tokens itself
        (`add_special_tokens` adds the tokenizer's own as well, as /tokenize may ask).
        `tools` (OpenAI function tools) are passed to the template as HF templates expect."""
        if self._template is None:
            raise ValueError("this model has no chat template: use /v1/completions")
        try:
            text = self._template.render(messages=messages, bos_token=self.bos_token,
                                         eos_token=self.eos_token, tools=tools,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return self.encode(text, add_special_tokens=add_special_tokens)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
