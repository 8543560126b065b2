"""Model configuration: the fields the engine needs, read from a Hugging Face ``config.json``.

Each supported ``model_type`` has one entry in ``ARCHITECTURES`` that maps its config keys onto ``ModelConfig`` and
supplies the defaults the published configs leave out (token ids, block length). Nothing else in the engine knows
about architecture names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A checkpoint's config cannot be used (unsupported architecture, missing key)."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    qk_norm: bool
    fused_qkv: bool                 # LLaDA2: one query_key_value matrix; LLaDA-MoE: q/k/v/o projections
    num_dense_layers: int           # the first layers use a dense MLP instead of MoE
    dense_intermediate_size: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int
    shared_intermediate_size: int
    router: str                     # "sigmoid_group" (LLaDA2) or "softmax" (LLaDA-MoE)
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    use_expert_bias: bool
    block_causal: bool              # LLaDA2: block-causal attention, so a prefix KV cache is exact
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    block_length: int
    max_position_embeddings: int
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.num_dense_layers, self.num_layers))

    @property
    def expert_numel(self) -> int:
        """Parameters of one routed expert (gate, up and down)."""
        return 3 * self.hidden_size * self.expert_intermediate_size


def _get(raw: dict, *keys: str, default: Any = ConfigError):
    for key in keys:
        if key in raw and raw[key] is not None:
            return raw[key]
    if default is ConfigError:
        raise ConfigError(f"config.json lacks required key {keys[0]!r}")
    return default


def _llada2(raw: dict) -> dict:
    hidden = _get(raw, "hidden_size")
    heads = _get(raw, "num_attention_heads")
    head_dim = _get(raw, "head_dim", default=hidden // heads)
    rotary_dim = _get(raw, "rotary_dim", default=int(head_dim * _get(raw, "partial_rotary_factor", default=1.0)))
    expert_inter = _get(raw, "moe_intermediate_size")
    return dict(
        hidden_size=hidden, num_heads=heads, num_kv_heads=_get(raw, "num_key_value_heads", default=heads),
        head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=float(_get(raw, "rope_theta", default=600000.0)),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        qk_norm=True,  # the official class applies QK-norm although config.json does not say so
        fused_qkv=True,
        num_dense_layers=_get(raw, "first_k_dense_replace", default=0),
        dense_intermediate_size=_get(raw, "intermediate_size"),
        num_experts=_get(raw, "num_experts"), top_k=_get(raw, "num_experts_per_tok"),
        expert_intermediate_size=expert_inter,
        num_shared_experts=_get(raw, "num_shared_experts", default=0),
        shared_intermediate_size=expert_inter * _get(raw, "num_shared_experts", default=0),
        router="sigmoid_group", n_group=_get(raw, "n_group", default=1), topk_group=_get(raw, "topk_group", default=1),
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
        norm_topk_prob=bool(_get(raw, "norm_topk_prob", default=True)),
        use_expert_bias=bool(_get(raw, "moe_router_enable_expert_bias", default=True)),
        block_causal=True,
    )


def _lladamoe(raw: dict) -> dict:
    """The official LLaDA-MoE code (modeling_lladamoe.py) derives the head size from hidden_size / heads and fixes
    norm_topk_prob to False, whatever config.json says; a config that asks otherwise describes a model that code
    does not run, so it is refused rather than silently reinterpreted (the published config agrees with both). Its
    router is always a softmax (the block stores moe_router_score_function but never reads it), and so is ours."""
    hidden = _get(raw, "hidden_size")
    heads = _get(raw, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    head_dim = hidden // heads
    if _get(raw, "head_dim", default=head_dim) != head_dim:
        raise ConfigError(f"head_dim {raw['head_dim']} differs from hidden_size / num_attention_heads = {head_dim}, "
                          f"the head size the official LLaDA-MoE attention uses")
    if _get(raw, "norm_topk_prob", default=False):
        raise ConfigError("norm_topk_prob true: the official LLaDA-MoE MoE block never renormalises the top-k "
                          "weights (it ignores this key)")
    for key in ("attention_bias", "clip_qkv"):
        if _get(raw, key, default=None):
            raise ConfigError(f"{key} {raw[key]!r} is not supported")
    shared = _get(raw, "shared_expert_intermediate_size", default=0) or 0
    return dict(
        hidden_size=hidden, num_heads=heads, num_kv_heads=_get(raw, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        rotary_dim=int(head_dim * _get(raw, "partial_rotary_factor", default=1.0)),
        rope_theta=float(_get(raw, "rope_theta", default=10000.0)),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-5)),
        qk_norm=bool(_get(raw, "qk_layernorm", default=True)), fused_qkv=False,
        num_dense_layers=0, dense_intermediate_size=_get(raw, "dense_intermediate_size", default=0),
        num_experts=_get(raw, "num_experts"), top_k=_get(raw, "num_experts_per_tok"),
        expert_intermediate_size=_get(raw, "expert_intermediate_size", "moe_intermediate_size", "intermediate_size"),
        # the shared expert is a sibling of the MoE block in the official layer (model.layers.N.shared_expert)
        num_shared_experts=1 if shared else 0, shared_intermediate_size=shared,
        router="softmax", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        use_expert_bias=bool(_get(raw, "moe_router_enable_expert_bias", default=False)),
        block_causal=False,
    )


@dataclass(frozen=True)
class Architecture:
    parse: Any
    mask_token_id: int
    eos_token_id: int
    block_length: int


# One row per architecture: how to read its config and the defaults the published config.json omits.
ARCHITECTURES: dict[str, Architecture] = {
    "llada2_moe": Architecture(_llada2, mask_token_id=156895, eos_token_id=156892, block_length=32),
    "lladamoe": Architecture(_lladamoe, mask_token_id=156895, eos_token_id=156892, block_length=32),
    "llada": Architecture(_lladamoe, mask_token_id=156895, eos_token_id=156892, block_length=32),
}


# Published config keys whose values must be whole numbers (eos_token_id may also be a list of them).
INTEGER_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rotary_dim", "intermediate_size", "moe_intermediate_size", "expert_intermediate_size",
                "dense_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace", "num_experts",
                "num_experts_per_tok", "num_shared_experts", "n_group", "topk_group", "mask_token_id",
                "eos_token_id", "pad_token_id", "block_length", "max_position_embeddings")
NUMBER_KEYS = ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "partial_rotary_factor")
# ModelConfig field -> the published key it comes from, so an error names what the user can find in config.json.
CONFIG_KEY = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads", "top_k": "num_experts_per_tok",
              "expert_intermediate_size": "moe_intermediate_size", "num_dense_layers": "first_k_dense_replace"}
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                   "num_experts", "top_k", "expert_intermediate_size", "n_group", "topk_group", "block_length",
                   "max_position_embeddings")
TOKEN_ID_FIELDS = ("mask_token_id", "eos_token_id", "pad_token_id")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(raw: dict) -> None:
    for key in INTEGER_KEYS:
        v = raw.get(key)
        if v is None or _is_int(v) or (key == "eos_token_id" and isinstance(v, list) and v and all(map(_is_int, v))):
            continue
        raise ConfigError(f"{key!r} must be an integer, got {v!r}")
    if raw.get("num_attention_heads", 1) < 1:      # the parsers divide by it
        raise ConfigError(f"'num_attention_heads' must be at least 1, got {raw['num_attention_heads']}")
    for key in NUMBER_KEYS:
        v = raw.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise ConfigError(f"{key!r} must be a number, got {v!r}")


def _check_values(c: ModelConfig, raw: dict) -> None:
    """Values that would crash or silently corrupt decoding later (an EOS that can never be generated, a group
    router with no group) are refused here, naming the config key; a value config.json does not hold is said to come
    from the architecture's defaults (or, for pad_token_id, from eos_token_id)."""
    def fail(field_name, why):
        raise ConfigError(f"{CONFIG_KEY.get(field_name, field_name)!r} {why}")

    for name in POSITIVE_FIELDS:
        if getattr(c, name) < 1:
            fail(name, f"must be at least 1, got {getattr(c, name)}")
    for name in TOKEN_ID_FIELDS:
        value = getattr(c, name)
        if 0 <= value < c.vocab_size:
            continue
        if raw.get(name) is not None:
            fail(name, f"{value} is outside the vocabulary (vocab_size {c.vocab_size})")
        source = "eos_token_id" if name == "pad_token_id" else f"the {c.model_type} default (the architecture table)"
        fail(name, f"is missing from config.json, and the value taken from {source}, {value}, is outside the "
                   f"vocabulary (vocab_size {c.vocab_size}): add {name} to config.json")
    if c.top_k > c.num_experts:
        fail("top_k", f"{c.top_k} is larger than num_experts {c.num_experts}")
    if c.num_experts % c.n_group:
        fail("n_group", f"{c.n_group} does not divide num_experts {c.num_experts}")
    if c.topk_group > c.n_group:
        fail("topk_group", f"{c.topk_group} is larger than n_group {c.n_group}")
    if c.top_k > c.topk_group * (c.num_experts // c.n_group):
        fail("top_k", f"{c.top_k} is more than the {c.topk_group} kept groups of "
                      f"{c.num_experts // c.n_group} experts hold")
    if c.num_heads % c.num_kv_heads:
        fail("num_kv_heads", f"{c.num_kv_heads} does not divide num_attention_heads {c.num_heads}")
    if not 0 <= c.rotary_dim <= c.head_dim or c.rotary_dim % 2:
        fail("rotary_dim", f"{c.rotary_dim} must be even and at most head_dim {c.head_dim}")
    if not 0 <= c.num_dense_layers <= c.num_layers:
        fail("num_dense_layers", f"{c.num_dense_layers} must be between 0 and num_hidden_layers {c.num_layers}")


def config_from_dict(raw: dict) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a JSON object of config keys, got a {type(raw).__name__}")
    _check_types(raw)
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[model_type]
    fields = arch.parse(raw)
    eos = _get(raw, "eos_token_id", default=arch.eos_token_id)
    if isinstance(eos, list):
        eos = eos[0]
    config = ModelConfig(
        model_type=model_type, vocab_size=_get(raw, "vocab_size"), num_layers=_get(raw, "num_hidden_layers"),
        mask_token_id=_get(raw, "mask_token_id", default=arch.mask_token_id), eos_token_id=eos,
        pad_token_id=_get(raw, "pad_token_id", default=eos),
        block_length=_get(raw, "block_length", default=arch.block_length),
        max_position_embeddings=_get(raw, "max_position_embeddings", default=4096),
        torch_dtype=str(_get(raw, "dtype", "torch_dtype", default="bfloat16")),
        extra=raw, **fields,
    )
    _check_values(config, raw)
    return config


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          f"config.json must be a JSON object") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
