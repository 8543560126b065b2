"""Tokenizer wrapper over `tokenizers` and the LLaDA2 chat template."""
from __future__ import annotations

from pathlib import Path

ROLE_NAMES = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, tok):
        self.tok = tok

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

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

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL and encode does not: a long text tokenized on a worker thread (the server)
        # then leaves the other threads running
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

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
    def chat_prompt(messages: list[dict]) -> str:
        """The LLaDA2 role template: <role>HUMAN</role>...<|role_end|> per message, then the assistant's turn."""
        parts = []
        for m in messages:
            role = ROLE_NAMES.get(m.get("role"))
            if role is None:
                raise ValueError(f"unknown chat role {m.get('role')!r}; expected system, user or assistant")
            parts.append(f"<role>{role}</role>{m.get('content', '')}<|role_end|>")
        return "".join(parts) + "<role>ASSISTANT</role>"
