"""Tokenizer wrapper over `tokenizers` and the LLaDA2 chat template.

User text is text: a special token written in it (`<|role_end|>`, `<|mask|>`) is tokenized as its characters, never
as the special token, so a message cannot close its turn and open another, nor place a mask. Only the chat
template's own markers are special tokens. `special_tokens=True` restores the raw parsing (the CLI's
--allow-special-tokens, the server's allow_special_tokens field).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

ROLE_NAMES = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}
ASSISTANT_TURN = "<role>ASSISTANT</role>"


class TokenizerError(ValueError):
    pass


def text_only(tok):
    """A copy of the `tokenizers` Tokenizer `tok` that never extracts an added token from text: every added token
    is marked special and special tokens are encoded as text (`encode_special_tokens`). The ids are the same."""
    doc = json.loads(tok.to_str())
    for added in doc.get("added_tokens") or []:
        added["special"] = True
    copy = HFTokenizer.from_str(json.dumps(doc))
    copy.encode_special_tokens = True
    return copy


class Tokenizer:
    def __init__(self, tok):
        self.tok = tok                       # parses special tokens written in the text (the template's markers)
        self.text_tok = text_only(tok)       # takes every character as text (user content)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json in the model directory")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:     # the Rust library raises a bare Exception for any malformed file
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None

    def check_against(self, config, source: str = "tokenizer.json") -> None:
        """The tokenizer and the model must agree: every id it can produce is a row of the embedding, and the mask
        and EOS ids the decoder relies on are tokens of it (else a prompt could index past the embedding, or
        generation could never stop)."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        top = max(vocab.values(), default=-1)
        if top >= config.vocab_size:
            token = next(t for t, i in vocab.items() if i == top)
            raise TokenizerError(f"{source}: token {token!r} has id {top}, beyond the model's vocab_size "
                                 f"{config.vocab_size}")
        for key in ("mask_token_id", "eos_token_id"):
            if self.tok.id_to_token(getattr(config, key)) is None:
                raise TokenizerError(f"{source}: no token has the config's {key} {getattr(config, key)}")

    def encode(self, text: str, special_tokens: bool = False) -> list[int]:
        """Token ids of `text` as text; special_tokens=True: a special token written in it is that token."""
        return self._encode([text], special_tokens)[0]

    def _encode(self, texts: list[str], special_tokens: bool) -> list[list[int]]:
        # encode_batch releases the GIL and encode does not: a long text tokenized on a worker thread (the server)
        # then leaves the other threads running
        tok = self.tok if special_tokens else self.text_tok
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for (the longest token), so that a text of more than
        n × this many characters is known to need more than n tokens without tokenizing it. None where that does
        not hold: a normalizer can shrink the text first, and an unknown-token symbol can stand for any run."""
        model = self.tok.model
        if self.tok.normalizer is not None or type(model).__name__ != "BPE" or model.unk_token is not None:
            return None
        return max(len(t) for t in self.tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def chat_segments(messages: list[dict]) -> list[tuple[str, bool]]:
        """The LLaDA2 role template as (text, is_template) pieces: <role>HUMAN</role>, the content, <|role_end|> per
        message, then the assistant's turn."""
        parts = []
        for m in messages:
            role = ROLE_NAMES.get(m.get("role"))
            if role is None:
                raise ValueError(f"unknown chat role {m.get('role')!r}; expected system, user or assistant")
            content = m.get("content", "")
            if not isinstance(content, str):
                raise ValueError(f"a chat message's content must be a string, got {type(content).__name__}")
            parts += [(f"<role>{role}</role>", True), (content, False), ("<|role_end|>", True)]
        return parts + [(ASSISTANT_TURN, True)]

    @classmethod
    def chat_prompt(cls, messages: list[dict]) -> str:
        """The chat template's text (for display; chat_ids tokenizes it with the contents as text)."""
        return "".join(text for text, _ in cls.chat_segments(messages))

    def chat_ids(self, messages: list[dict], special_tokens: bool = False) -> list[int]:
        """Token ids of the chat template: its markers are special tokens, the messages' contents text (with
        special_tokens=True, special tokens written in them are parsed too). The same ids as the template's text
        tokenized in one piece when no content holds a special token: the library splits text at special tokens
        first and tokenizes the pieces between them separately."""
        segments = self.chat_segments(messages)
        template = iter(self._encode([t for t, is_template in segments if is_template], True))
        content = iter(self._encode([t for t, is_template in segments if not is_template], special_tokens))
        return [i for _, is_template in segments for i in next(template if is_template else content)]
