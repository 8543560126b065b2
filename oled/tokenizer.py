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
        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

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
