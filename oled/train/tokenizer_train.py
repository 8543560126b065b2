"""Byte-level BPE tokenizer trained with the ``tokenizers`` library, saved as ``tokenizer.json``.

Special tokens come first, so their ids are fixed whatever the corpus: ``<|endoftext|>`` (EOS and pad) = 0,
``<|mask|>`` = 1, then the chat role tokens ``<role>``, ``</role>``, ``<|role_end|>``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
ROLE_TOKENS = ("<role>", "</role>", "<|role_end|>")
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, *ROLE_TOKENS)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 6144, out_path: str | Path | None = None,
                    min_frequency: int = 2):
    """Train byte-level BPE on an iterator of documents; returns the ``tokenizers.Tokenizer`` (saved if out_path)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    if out_path is not None:
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out_path))
    return tok


def load_tokenizer(path: str | Path):
    return Tokenizer.from_file(str(path))


def special_token_ids(tokenizer) -> dict[str, int]:
    """Ids of EOS, pad and mask as the config must name them."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    mask = tokenizer.token_to_id(MASK_TOKEN)
    if eos is None or mask is None:
        raise ValueError("tokenizer lacks <|endoftext|> or <|mask|>")
    return {"eos_token_id": eos, "pad_token_id": eos, "mask_token_id": mask}


def write_tokenizer_config(out_dir: str | Path) -> None:
    """A small tokenizer_config.json naming the special tokens (the engine reads tokenizer.json itself)."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
        "model_max_length": 1 << 30,
    }
    Path(out_dir, "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
