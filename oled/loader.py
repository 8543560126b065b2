"""Checkpoint loading: stream tensors from a Hugging Face directory into the model and the expert store.

One streaming function hands each tensor to the parameter (or expert blob) that owns it and then checks that
everything was loaded exactly once. The model is built on `meta` and materialised empty, so no weight is ever
initialised and thrown away.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from .models.config import ModelConfig, load_config
from .models.model import MoEDiffusionLM
from .runtime.store import ExpertStore

log = logging.getLogger("oled")


class CheckpointError(ValueError):
    """A checkpoint does not match what its config promises (missing, unexpected or mis-shaped tensors)."""


# Official tensor name -> our parameter name, per architecture: (official template, our template, variants).
# {i} is a layer index, {p} one of the variants. Routed experts are handled by EXPERT_NAME (they go to the store).
GATE_UP_DOWN = ("gate", "up", "down")
NAME_TEMPLATES = {
    "llada2_moe": [
        ("model.word_embeddings.weight", "embed.weight", None),
        ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight", None),
        ("model.layers.{i}.attention.query_key_value.weight", "layers.{i}.attn.qkv.weight", None),
        ("model.layers.{i}.attention.query_layernorm.weight", "layers.{i}.attn.q_norm.weight", None),
        ("model.layers.{i}.attention.key_layernorm.weight", "layers.{i}.attn.k_norm.weight", None),
        ("model.layers.{i}.attention.dense.weight", "layers.{i}.attn.o_proj.weight", None),
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight", None),
        ("model.layers.{i}.mlp.{p}_proj.weight", "layers.{i}.mlp.{p}_proj.weight", GATE_UP_DOWN),
        ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router_weight", None),
        ("model.layers.{i}.mlp.gate.expert_bias", "layers.{i}.mlp.expert_bias", None),
        ("model.layers.{i}.mlp.shared_experts.{p}_proj.weight", "layers.{i}.mlp.shared.{p}_proj.weight", GATE_UP_DOWN),
        ("model.norm.weight", "norm.weight", None),
        ("lm_head.weight", "lm_head.weight", None),
    ],
    "lladamoe": [
        ("model.embed_tokens.weight", "embed.weight", None),
        ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight", None),
        ("model.layers.{i}.self_attn.{p}_proj.weight", "layers.{i}.attn.{p}_proj.weight", ("q", "k", "v", "o")),
        ("model.layers.{i}.self_attn.{p}_norm.weight", "layers.{i}.attn.{p}_norm.weight", ("q", "k")),
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight", None),
        ("model.layers.{i}.mlp.{p}_proj.weight", "layers.{i}.mlp.{p}_proj.weight", GATE_UP_DOWN),
        ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router_weight", None),
        ("model.layers.{i}.mlp.expert_bias", "layers.{i}.mlp.expert_bias", None),
        # a sibling of the MoE block in the official layer, fed the same normalised input: ours lives in the block
        ("model.layers.{i}.shared_expert.{p}_proj.weight", "layers.{i}.mlp.shared.{p}_proj.weight", GATE_UP_DOWN),
        ("model.norm.weight", "norm.weight", None),
        ("lm_head.weight", "lm_head.weight", None),
    ],
}
NAME_TEMPLATES["llada"] = NAME_TEMPLATES["lladamoe"]
# Our parameters of the router: a NaN or Inf in them changes which experts run without making the output non-finite
# (a NaN score is never picked), so they are checked at load, element by element (they are small).
ROUTER_PARAMS = ("mlp.router_weight", "mlp.expert_bias")
# What the loader takes, by the dtype config.json declares: that dtype, and float32 (the published files hold the
# router's bias in fp32). Anything else (float64, an FP8 type, fp16 in a bf16 checkpoint) is not what the config
# promises: refused rather than silently rounded.
DECLARED_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
LAYER_OF = re.compile(r"model\.layers\.(\d+)\.")


def name_map(config: ModelConfig, param_names) -> dict[str, str]:
    """official tensor name -> our parameter name, for the parameters this model has."""
    params = set(param_names)
    out = {}
    for official, ours, variants in NAME_TEMPLATES[config.model_type]:
        for i in range(config.num_layers) if "{i}" in official else [None]:
            for p in variants or [None]:
                o, n = official.format(i=i, p=p), ours.format(i=i, p=p)
                if n in params:
                    out[o] = n
    return out


def official_tensors(config: ModelConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor a checkpoint of this config holds: (official name, shape, dtype in the published files)."""
    with torch.device("meta"):
        model = MoEDiffusionLM(config)
    params = dict(model.named_parameters())
    out = [(o, tuple(params[n].shape), torch.float32 if n.endswith("expert_bias") else torch.bfloat16)
           for o, n in name_map(config, params).items()]
    H, I = config.hidden_size, config.expert_intermediate_size
    for layer in config.moe_layers:
        for e in range(config.num_experts):
            for part, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                out.append((f"model.layers.{layer}.mlp.experts.{e}.{part}.weight", shape, torch.bfloat16))
    return out


@dataclass
class LoadedModel:
    config: ModelConfig
    model: MoEDiffusionLM
    store: ExpertStore


def build_empty(config: ModelConfig, dtype: torch.dtype, device, pin: bool, expert_dtype: str = "bf16") -> LoadedModel:
    """The model with uninitialised non-expert weights on `device`, and an empty expert store on the host (its blobs
    in expert_dtype: runtime/store.py)."""
    with torch.device("meta"):
        # every tensor in `dtype`, the router's bias included: the official models hold it in the dtype they are
        # loaded in (the published files store it in fp32)
        model = MoEDiffusionLM(config).to(dtype)
    model = model.to_empty(device=device).eval()
    model.requires_grad_(False)
    return LoadedModel(config, model, ExpertStore(config, dtype, pin=pin, expert_dtype=expert_dtype))


def load_tensors(loaded: LoadedModel, tensors: Iterator[tuple[str, torch.Tensor, str]]) -> None:
    """Hand each (official name, tensor, source) to its owner; then check every parameter was loaded once."""
    config, model, store = loaded.config, loaded.model, loaded.store
    params = dict(model.named_parameters())
    names = name_map(config, params)
    official = {n: o for o, n in names.items()}
    loaded_count = {name: 0 for name in params}
    accepted = {DECLARED_DTYPES.get(config.torch_dtype, torch.bfloat16), torch.float32}
    extra_layers: dict[int, str] = {}             # layer index -> a file holding it
    for name, tensor, source in tensors:
        layer_m = LAYER_OF.match(name)
        if layer_m and int(layer_m.group(1)) >= config.num_layers:
            # e.g. the published LLaDA2 multi-token-prediction layer: not used for decoding, but say so
            extra_layers.setdefault(int(layer_m.group(1)), source)
            continue
        if not (tensor.is_floating_point()):
            raise CheckpointError(f"{source}: tensor {name} has dtype {tensor.dtype}, expected a floating type")
        if tensor.dtype not in accepted:
            raise CheckpointError(f"{source}: tensor {name} has dtype {str(tensor.dtype).removeprefix('torch.')}; "
                                  f"config.json declares {config.torch_dtype}, and the loader takes "
                                  f"{' or '.join(str(d).removeprefix('torch.') for d in accepted)} tensors")
        m = EXPERT_NAME.match(name)
        if m:
            layer, expert, part = int(m.group(1)), int(m.group(2)), m.group(3)
            if layer not in store.layer_pos or expert >= config.num_experts:
                raise CheckpointError(f"{source}: unexpected tensor {name} (layer {layer} has "
                                      f"{config.num_experts if layer in store.layer_pos else 0} routed experts)")
            try:
                store.put(layer, expert, part, tensor)
            except ValueError as e:
                raise CheckpointError(f"{source}: tensor {name}: {e}") from None
            continue
        target = names.get(name)
        if target is None:
            raise CheckpointError(f"{source}: unexpected tensor {name} for model_type {config.model_type}")
        param = params[target]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(param.shape)}")
        if target.endswith(ROUTER_PARAMS) and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{source}: tensor {name} holds NaN or Inf (a router weight: it would change "
                                  f"which experts run without any error)")
        param.data.copy_(tensor)
        loaded_count[target] += 1
    if extra_layers:
        log.warning("checkpoint holds layer(s) %s beyond num_hidden_layers %d (in %s): ignored",
                    ", ".join(map(str, sorted(extra_layers))), config.num_layers,
                    ", ".join(sorted(set(extra_layers.values()))))
    missing = [official[n] for n, c in loaded_count.items() if c == 0] + store.missing()
    twice = [official[n] for n, c in loaded_count.items() if c > 1]
    twice += store.duplicated()
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
    if twice:
        raise CheckpointError(f"checkpoint holds tensor(s) more than once: {', '.join(twice[:5])}")


def read_index(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), checked: a malformed index is named with its key."""
    try:
        doc = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: invalid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: key 'weight_map' must be an object of tensor name -> shard file, got "
                              f"{type(weight_map).__name__ if weight_map is not None else 'nothing'}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{index}: weight_map[{name!r}] must be a shard file name, got {file!r}")
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {file!r}, outside the model directory; shards "
                                  f"are named relative to it")
    return weight_map


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_index(index).values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{model_dir}: no model.safetensors.index.json or model.safetensors")
    paths = [model_dir / f for f in files]
    for p in paths:
        if not p.is_file():
            raise CheckpointError(f"{p}: shard listed in the index is missing")
    return paths


def stream_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Tensors one at a time from the shards (memory-mapped; never the whole checkpoint in memory)."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                names = f.keys()
                for name in names:
                    try:
                        tensor = f.get_tensor(name)
                    except (SafetensorError, RuntimeError, ValueError) as e:
                        raise CheckpointError(f"{path.name}: tensor {name} cannot be read ({e})") from None
                    yield name, tensor, path.name
        except (SafetensorError, OSError) as e:    # truncated, empty, garbage header, data beyond the file
            raise CheckpointError(f"{path.name}: not a readable safetensors file ({e})") from None


def load_checkpoint(model_dir: str | Path, dtype: torch.dtype, device, pin: bool = True,
                    progress: bool = False, expert_dtype: str = "bf16") -> LoadedModel:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    config = load_config(model_dir)
    loaded = build_empty(config, dtype, device, pin, expert_dtype)
    stream = stream_checkpoint(model_dir)
    if progress:
        stream = tqdm(stream, total=len(official_tensors(config)), desc="loading", unit="tensor", leave=False,
                      disable=None)  # None: only on a terminal
    load_tensors(loaded, stream)
    return loaded
