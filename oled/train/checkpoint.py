"""Save / load the training module in EXACTLY the official LLaDA2 Hugging Face layout.

Directory: ``config.json`` (keys of the published LLaDA2.0-mini config plus eos/pad/mask token ids and
block_length), ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, ``tokenizer.json`` (+ ``tokenizer_config.json``). Weights are bf16 except
``mlp.gate.expert_bias`` (fp32). Tensor names: ``model.word_embeddings.weight``; per layer
``model.layers.{i}.input_layernorm.weight``, ``.attention.query_key_value.weight``,
``.attention.query_layernorm.weight``, ``.attention.key_layernorm.weight``, ``.attention.dense.weight``,
``.post_attention_layernorm.weight``; dense layers ``.mlp.{gate,up,down}_proj.weight``; MoE layers
``.mlp.gate.weight``, ``.mlp.gate.expert_bias``, ``.mlp.experts.{e}.{gate,up,down}_proj.weight``,
``.mlp.shared_experts.{gate,up,down}_proj.weight``; ``model.norm.weight``; ``lm_head.weight``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import LLaDA2MoeModelLM, TinyConfig
from .tokenizer_train import write_tokenizer_config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def official_state_dict(model: LLaDA2MoeModelLM, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Name -> tensor in the official layout (stacked experts split per expert), cast to dtype except the
    fp32 expert_bias. Tensors are contiguous CPU copies."""
    out: dict[str, torch.Tensor] = {}
    inter = model.config.moe_intermediate_size
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if name.endswith("mlp.experts.gate_up"):
            prefix = name[: -len("gate_up")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].to(dtype).contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].to(dtype).contiguous()
        elif name.endswith("mlp.experts.down"):
            prefix = name[: -len("down")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].to(dtype).contiguous()
        elif name.endswith("mlp.gate.expert_bias"):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def load_official_state_dict(model: LLaDA2MoeModelLM, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of official_state_dict (keys of layers >= num_hidden_layers are ignored, as the engine does)."""
    c = model.config
    own = model.state_dict()
    new = {}
    for name in own:
        if name.endswith("mlp.experts.gate_up"):
            prefix = name[: -len("gate_up")]
            new[name] = torch.stack([torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"],
                                                tensors[f"{prefix}{e}.up_proj.weight"]]) for e in range(c.num_experts)])
        elif name.endswith("mlp.experts.down"):
            prefix = name[: -len("down")]
            new[name] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(c.num_experts)])
        else:
            new[name] = tensors[name]
    with torch.no_grad():
        for name, t in own.items():
            if tuple(new[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(new[name].shape)} != {tuple(t.shape)}")
            t.copy_(new[name].to(t.dtype))


def save_checkpoint(model: LLaDA2MoeModelLM, out_dir: str | Path, *, tokenizer_path: str | Path | None = None,
                    max_shard_bytes: int | None = 10 * 1024 * 1024, extra_files: dict[str, str | Path] | None = None
                    ) -> dict:
    """Write config.json, safetensors (sharded when larger than max_shard_bytes; None = one file) and the
    tokenizer. Returns {"files": [...], "total_size": bytes, "total_parameters": n}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / INDEX_NAME]:
        if old.exists():
            old.unlink()
    tensors = official_state_dict(model)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    total_params = sum(t.numel() for t in tensors.values())
    # Deterministic order: the official listing is sorted by name.
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if max_shard_bytes is not None and shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    files = []
    if len(shards) == 1:
        save_file({n: tensors[n] for n in shards[0]}, str(out / SINGLE_NAME), metadata={"format": "pt"})
        files.append(SINGLE_NAME)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update({n: fname for n in shard})
        index = {"metadata": {"total_parameters": total_params, "total_size": total_size},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_NAME)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    files.append("config.json")
    if tokenizer_path is not None:
        if Path(tokenizer_path).resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tokenizer_path, out / "tokenizer.json")
        write_tokenizer_config(out)
        files += ["tokenizer.json", "tokenizer_config.json"]
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, out / name)
        files.append(name)
    return {"files": files, "total_size": total_size, "total_parameters": total_params}


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or shards)."""
    d = Path(model_dir)
    if (d / INDEX_NAME).is_file():
        index = json.loads((d / INDEX_NAME).read_text())
        tensors = {}
        for fname in sorted(set(index["weight_map"].values())):
            tensors.update(load_file(str(d / fname)))
        return tensors
    return load_file(str(d / SINGLE_NAME))


def load_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> LLaDA2MoeModelLM:
    """The training module from a checkpoint directory; parameters in dtype, expert_bias fp32."""
    d = Path(model_dir)
    config = TinyConfig.from_hf_dict(json.loads((d / "config.json").read_text()))
    model = LLaDA2MoeModelLM(config)
    load_official_state_dict(model, read_tensors(d))
    return model.cast_params(dtype).to(device).eval()
