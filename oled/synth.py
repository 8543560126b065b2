"""Random-weight models in the published layout: presets, deterministic random tensors, checkpoint writer.

The same tensor stream feeds `oled synth` (written to safetensors shards) and `--random-weights PRESET` (loaded
straight into memory), so a written checkpoint and the in-memory preset are the same model.
The initialisation is scaled so that routing is not tied and the LM head is confident enough for multi-token
commits at threshold 0.95 (a uniform-logit model would commit one token per iteration and exercise nothing).
"""
from __future__ import annotations

import json
import math
import zlib
from importlib import resources
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from .loader import official_tensors
from .models.config import ModelConfig, config_from_dict

PRESETS = ("tiny", "tiny-lladamoe", "llada2-mini", "llada2-flash", "llada-moe-7b")
LM_HEAD_LOGIT_STD = 16.0     # std of the random LM head's logits: peaked enough that some positions pass 0.95


def preset_config(name: str, layers: int | None = None) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    raw = json.loads(resources.files("oled.presets").joinpath(f"{name}.json").read_text())
    if layers is not None:
        raw["num_hidden_layers"] = layers
    return raw


def _std(name: str, shape: tuple[int, ...], config: ModelConfig) -> float:
    fan_in = shape[-1]
    if name.endswith("expert_bias"):
        return 0.05
    if "embed" in name or "word_embeddings" in name:
        return 1.0
    if name == "lm_head.weight":
        return LM_HEAD_LOGIT_STD / math.sqrt(fan_in)
    if name.endswith("gate.weight"):           # router: logits of std ~1 on a normalised hidden state
        return 1.0 / math.sqrt(fan_in)
    if "dense" in name or "o_proj" in name or "down_proj" in name:   # residual outputs: keep the stream bounded
        return 1.0 / math.sqrt(fan_in * config.num_layers)
    return 1.0 / math.sqrt(fan_in)


def random_tensors(config: ModelConfig, seed: int = 0, device="cpu",
                   dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(official name, tensor, source) for every tensor of the config; each tensor depends only on (seed, name)."""
    gen = torch.Generator(device=device)
    for name, shape, file_dtype in official_tensors(config):
        if "layernorm" in name or name.endswith("norm.weight"):
            t = torch.ones(shape, device=device)
        else:
            gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            t = torch.randn(shape, generator=gen, device=device) * _std(name, shape, config)
        yield name, t.to(file_dtype if file_dtype == torch.float32 else dtype), f"random(seed={seed})"


def build_tokenizer(config: ModelConfig):
    """A byte-level tokenizer with the model's vocabulary size and its special tokens at the configured ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    special = {config.eos_token_id: "<|endoftext|>", config.mask_token_id: "<|mask|>"}
    role = ["<role>", "</role>", "<|role_end|>"]
    vocab: dict[str, int] = {}
    next_role = iter(role)
    for i in range(config.vocab_size):
        if i < len(alphabet):
            tok = alphabet[i]
        elif i in special:
            tok = special[i]
        else:
            tok = next(next_role, None) or f"<|reserved_{i}|>"
        vocab[tok] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special.values()) + role)
    return tok


def write_checkpoint(raw_config: dict, out_dir: str | Path, seed: int = 0,
                     shard_bytes: int = 2 * 2**30, progress: bool = False) -> Path:
    """Write config.json, sharded safetensors with an index, and tokenizer.json, as published."""
    config = config_from_dict(raw_config)          # an invalid config is refused before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))
    build_tokenizer(config).save(str(out / "tokenizer.json"))
    stream = random_tensors(config, seed)
    if progress:
        stream = tqdm(stream, total=len(official_tensors(config)), desc="writing", unit="tensor")
    # Shards are flushed as they fill (the model is never whole in memory) and renamed once their count is known.
    shard: dict[str, torch.Tensor] = {}
    written: list[tuple[Path, list[str]]] = []
    size = total = 0

    def flush():
        path = out / f"shard-{len(written):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, tensor, _ in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > shard_bytes and shard:
            flush()
            size = 0
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, (path, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / fname)
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
