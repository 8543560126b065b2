"""Tiny-model trainer: data selection, objective mask, router, official checkpoint layout, a short CPU training."""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from oled.models.layers import block_causal_mask
from oled.synth import preset_config
from oled.models.router import sigmoid_group_route
from oled.train import tiny
from oled.train.checkpoint import load_checkpoint, official_state_dict, read_tensors, save_checkpoint
from oled.train.corpus import build_corpus, load_corpus_ids
from oled.train.diffusion import WindowSampler, noise_blocks, pad_after_eos
from oled.train.model import LLaDA2MoeModelLM, TinyConfig, bd_attention_mask

TEST_DATA = Path(__file__).resolve().parent / "data"   # the official index listing, copied from shared/models

SMALL = dict(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
             n_group=4, topk_group=2, num_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128)

SOURCES = {
    "alpha.py": "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
                "        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "beta.py": "import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n        for name in files:\n"
               "            yield os.path.join(root, name)\n",
    "pkg/gamma.py": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "pkg/delta.py": "def greet(name):\n    if not name:\n        raise ValueError('empty name')\n"
                    "    return f'hello {name}'\n",
}


def _official_index():
    return json.loads((TEST_DATA / "llada2-tiny-official.index.json").read_text())


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", name))


def _expected_names(c: TinyConfig) -> set[str]:
    names = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "attention.query_key_value.weight", "attention.query_layernorm.weight",
                                  "attention.key_layernorm.weight", "attention.dense.weight")}
        if i < c.first_k_dense_replace:
            names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        else:
            names |= {p + "mlp.gate.weight", p + "mlp.gate.expert_bias"}
            names |= {p + f"mlp.shared_experts.{m}_proj.weight" for m in ("gate", "up", "down")}
            names |= {p + f"mlp.experts.{e}.{m}_proj.weight" for e in range(c.num_experts)
                      for m in ("gate", "up", "down")}
    return names


def _expected_shape(c: TinyConfig, name: str) -> tuple:
    H, hd = c.hidden_size, c.head_dim
    last = name.split("model.layers.")[-1]
    table = [
        ("word_embeddings.weight", (c.vocab_size, H)), ("lm_head.weight", (c.vocab_size, H)),
        ("query_key_value.weight", ((c.num_attention_heads + 2 * c.num_key_value_heads) * hd, H)),
        ("query_layernorm.weight", (hd,)), ("key_layernorm.weight", (hd,)),
        ("attention.dense.weight", (H, c.num_attention_heads * hd)),
        ("mlp.gate.weight", (c.num_experts, H)), ("mlp.gate.expert_bias", (c.num_experts,)),
    ]
    for key, shape in table:
        if name.endswith(key):
            return shape
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return (H,)
    inter = c.moe_intermediate_size if (".experts." in last or "shared_experts" in last) else c.intermediate_size
    if "shared_experts" in last:
        inter = c.moe_intermediate_size * c.num_shared_experts
    return (H, inter) if name.endswith("down_proj.weight") else (inter, H)


# ------------------------------------------------------------------------------------------------------------------
def test_bd_attention_mask_entries():
    L, B = 64, 32
    m = bd_attention_mask(L, B)
    assert m.shape == (2 * L, 2 * L) and m.dtype == torch.bool
    n, c = (lambda i: i), (lambda i: L + i)                    # index of noisy / clean position i
    assert m[n(0), n(31)] and m[n(31), n(0)]                  # noisy block 0 is bidirectional
    assert not m[n(0), n(32)] and not m[n(32), n(31)]         # noisy blocks do not see other noisy blocks
    assert not m[n(0), c(0)] and not m[n(5), c(31)]           # noisy block 0 sees no clean block
    assert m[n(32), c(0)] and m[n(40), c(31)]                 # noisy block 1 sees clean block 0 ...
    assert not m[n(40), c(32)] and not m[n(40), c(63)]        # ... but not clean block 1
    assert m[c(0), c(31)] and m[c(32), c(0)] and m[c(63), c(40)]  # clean: block-causal, bidirectional inside
    assert not m[c(0), c(32)]
    assert not m[L:, :L].any()                                # clean never sees noisy
    # The clean half is exactly the inference block-causal mask.
    pos = torch.arange(L)
    assert torch.equal(m[L:, L:], block_causal_mask(pos, pos, B))


def test_noise_blocks_and_padding():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(5, 100, (4, 128), generator=g)
    xn, masked, t = noise_blocks(x0, 32, 1, generator=g)
    per_block = masked.view(4, 4, 32).sum(-1)
    assert (per_block >= 1).all()
    assert torch.allclose(t.view(4, 4, 32)[..., 0], per_block.float() / 32)
    assert torch.equal(xn[masked], torch.ones_like(xn[masked])) and torch.equal(xn[~masked], x0[~masked])
    _, m2, _ = noise_blocks(x0, 32, 1, ratio=0.5)
    assert (m2.view(4, 4, 32).sum(-1) == 16).all()
    x = torch.tensor([[5, 6, 0, 7, 8], [5, 6, 7, 8, 9]])
    assert pad_after_eos(x, 0).tolist() == [[5, 6, 0, 0, 0], [5, 6, 7, 8, 9]]
    stream = torch.tensor([5, 6, 7, 0, 8, 9, 10, 11, 0, 12, 13, 0] * 20)
    s = WindowSampler(stream, 8, 0, generator=torch.Generator().manual_seed(1))
    w = s.sample(64)
    after = (w == 0).cumsum(1) > 0
    assert (w[after] == 0).all()


def test_router_equals_sigmoid_group_route_and_moe_matches_reference():
    torch.manual_seed(0)
    c = TinyConfig(**SMALL)
    model = LLaDA2MoeModelLM(c)
    moe = model.moe_layers()[0]
    moe.gate.expert_bias.copy_(torch.randn(c.num_experts) * 0.1)
    x = torch.randn(50, c.hidden_size)
    ids, w = moe.route(x)
    ids2, w2 = sigmoid_group_route(x, moe.gate.weight, moe.gate.expert_bias, top_k=c.num_experts_per_tok,
                                   n_group=c.n_group, topk_group=c.topk_group,
                                   routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=True)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    assert torch.allclose(w.sum(-1), torch.full((50,), c.routed_scaling_factor))
    # The selected experts lie in at most topk_group groups.
    groups = ids // (c.num_experts // c.n_group)
    assert all(len(set(r)) <= c.topk_group for r in groups.tolist())
    # MoE forward equals the official per-expert computation (grouped and loop paths alike).
    sd = official_state_dict(model, torch.float32)
    p = "model.layers.1.mlp."
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(c.num_experts_per_tok):
            e = int(ids[t, j])
            g_, u_, d_ = (sd[f"{p}experts.{e}.{m}_proj.weight"] for m in ("gate", "up", "down"))
            ref[t] += w[t, j] * (F.silu(x[t] @ g_.t()) * (x[t] @ u_.t())) @ d_.t()
    ref += moe.shared_experts(x)
    with torch.no_grad():
        out = moe(x)
        moe.experts.grouped = False
        out_loop = moe(x)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(out_loop, ref, atol=1e-5)


def _reference_logits(sd: dict, c: TinyConfig, ids: torch.Tensor) -> torch.Tensor:
    """Independent fp32 forward written from the official modeling code, on official tensor names."""
    def rms(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(x.dtype)

    def rot_half(x):
        return torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], dim=-1)

    T = ids.shape[0]
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rd = int(hd * c.partial_rotary_factor)
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rd, 2).float() / rd))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[None], emb.sin()[None]                       # [1, T, rd]
    blk = torch.arange(T) // c.block_length
    bias = torch.where(blk[None, :] <= blk[:, None], 0.0, float("-inf"))
    h = sd["model.word_embeddings.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        qkv = (x @ sd[p + "attention.query_key_value.weight"].t()).view(T, nh + 2 * nkv, hd)
        q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
        q = rms(q, sd[p + "attention.query_layernorm.weight"]).transpose(0, 1)
        k = rms(k, sd[p + "attention.key_layernorm.weight"]).transpose(0, 1)
        v = v.transpose(0, 1)
        q = torch.cat([q[..., :rd] * cos + rot_half(q[..., :rd]) * sin, q[..., rd:]], -1)
        k = torch.cat([k[..., :rd] * cos + rot_half(k[..., :rd]) * sin, k[..., rd:]], -1)
        k = k[:, None].expand(nkv, nh // nkv, T, hd).reshape(nh, T, hd)
        v = v[:, None].expand(nkv, nh // nkv, T, hd).reshape(nh, T, hd)
        att = torch.softmax((q @ k.transpose(1, 2)) * hd ** -0.5 + bias, dim=-1, dtype=torch.float32)
        o = (att @ v).transpose(0, 1).reshape(T, nh * hd)
        h = h + o @ sd[p + "attention.dense.weight"].t()
        x = rms(h, sd[p + "post_attention_layernorm.weight"])

        def mlp(x, pre):
            return (F.silu(x @ sd[pre + "gate_proj.weight"].t()) * (x @ sd[pre + "up_proj.weight"].t())) \
                @ sd[pre + "down_proj.weight"].t()

        if i < c.first_k_dense_replace:
            h = h + mlp(x, p + "mlp.")
            continue
        scores = torch.sigmoid(x.float() @ sd[p + "mlp.gate.weight"].float().t())
        biased = scores + sd[p + "mlp.gate.expert_bias"]
        gs = biased.view(T, c.n_group, -1).topk(2, dim=-1)[0].sum(-1)
        gidx = gs.topk(c.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
        smask = gmask[..., None].expand(T, c.n_group, c.num_experts // c.n_group).reshape(T, -1)
        top = biased.masked_fill(~smask.bool(), float("-inf")).topk(c.num_experts_per_tok, dim=-1)[1]
        wts = scores.gather(1, top)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        y = torch.zeros_like(x)
        for t in range(T):
            for j in range(c.num_experts_per_tok):
                y[t] += wts[t, j] * mlp(x[t:t + 1], f"{p}mlp.experts.{int(top[t, j])}.")[0]
        h = h + y + mlp(x, p + "mlp.shared_experts.")
    return rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].t()


def test_training_module_matches_official_reference_math():
    torch.manual_seed(1)
    c = TinyConfig(**SMALL)
    model = LLaDA2MoeModelLM(c).eval()
    for m in model.moe_layers():
        m.gate.expert_bias.copy_(torch.randn(c.num_experts) * 0.05)
    ids = torch.randint(0, c.vocab_size, (70,))                       # 3 blocks, the last one partial
    with torch.no_grad():
        got = model(ids)[0]
        ref = _reference_logits(official_state_dict(model, torch.float32), c, ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    # The [noisy ; clean] forward gives the clean half exactly the block-causal (inference) hidden states.
    with torch.no_grad():
        x = ids[:64][None]
        h = model.hidden_states(torch.cat([x, x], 1), torch.arange(64).repeat(2), bd_attention_mask(64, 32))
        plain = model.hidden_states(x, torch.arange(64), block_causal_mask(torch.arange(64), torch.arange(64), 32))
    assert torch.allclose(h[:, 64:], plain, atol=1e-5)


def test_checkpoint_layout_matches_official(tmp_path):
    official = _official_index()
    c = TinyConfig(**SMALL)
    model = LLaDA2MoeModelLM(c)
    for m in model.moe_layers():
        m.gate.expert_bias.copy_(torch.randn(c.num_experts) * 0.05)
    saved = save_checkpoint(model, tmp_path, max_shard_bytes=60_000)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(saved["files"]) > 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    tensors = read_tensors(tmp_path)
    assert set(index["weight_map"]) == set(tensors) == _expected_names(c)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Same name patterns as the official listing (which has layers 0 (dense), 1, 2 (MoE)).
    assert {_pattern(n) for n in tensors} == {_pattern(n) for n in official["weight_map"]}
    for name, t in tensors.items():
        assert tuple(t.shape) == _expected_shape(c, name), name
        assert t.dtype == (torch.float32 if name.endswith("expert_bias") else torch.bfloat16), name
    cfg = json.loads((tmp_path / "config.json").read_text())
    mini = preset_config("llada2-mini")
    assert set(mini) - {"transformers_version"} <= set(cfg)
    assert cfg["model_type"] == "llada2_moe" and cfg["architectures"] == ["LLaDA2MoeModelLM"]
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "bfloat16"
    assert cfg["rotary_dim"] == int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    assert cfg["n_group"] > 1 and cfg["topk_group"] < cfg["n_group"]
    # Round trip: loading gives the bf16-rounded model.
    back = load_checkpoint(tmp_path, dtype=torch.float32)
    ref = official_state_dict(model, torch.bfloat16)
    for name, t in official_state_dict(back, torch.bfloat16).items():
        assert torch.equal(t, ref[name]), name
    assert back.moe_layers()[0].gate.expert_bias.dtype == torch.float32


def test_quick_training_honours_minutes(tmp_path):
    """No --steps: training stops early enough that evaluation and saving end within --minutes (it planned a
    negative deadline and overran before)."""
    corpus = tiny_corpus(tmp_path)
    minutes = 0.2
    args = tiny.build_parser().parse_args(["--corpus", str(corpus), "--out", str(tmp_path / "ckpt"), "--device",
                                           "cpu", "--quick", "--minutes", str(minutes), "--max-shard-mb", "0"])
    t0 = time.time()
    log = tiny.train(args, t0)
    assert time.time() - t0 <= minutes * 60
    assert log["steps"] > 0 and log["wall_time_s"] <= minutes * 60


def tiny_corpus(tmp_path):
    src = tmp_path / "stdlib"
    for rel, text in SOURCES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text * 6)
    corpus = tmp_path / "corpus"
    add_heldout_if_missing(corpus, src, build_corpus(corpus, vocab_size=300, root=src, heldout_percent=50,
                                                     verbose=False))
    return corpus


def add_heldout_if_missing(corpus, src, manifest):
    if not any(e["split"] == "heldout" for e in manifest["files"]):    # the tiny corpus needs a held-out file
        (corpus / "heldout.txt").write_text((src / "alpha.py").read_text() + "<|endoftext|>")
        (corpus / "heldout_ids.npy").unlink(missing_ok=True)


def test_gzipped_corpus_with_a_given_tokenizer_loads_the_same_ids(tmp_path):
    """The routing proxy's corpus travels as gzipped text with the bundled model's tokenizer (no ids): loading it
    tokenizes the text with that tokenizer, to the ids a plain, tokenized corpus holds."""
    plain = tiny_corpus(tmp_path)
    src = tmp_path / "stdlib"
    small = tmp_path / "small"
    build_corpus(small, root=src, heldout_percent=50, tokenize=False, compress=True,
                 tokenizer=plain / "tokenizer.json", verbose=False)
    assert {p.name for p in small.iterdir()} >= {"train.txt.gz", "tokenizer.json", "manifest.json"}
    assert not (small / "train.txt").exists() and not (small / "train_ids.npy").exists()
    _, train_small, _ = load_corpus_ids(small)
    _, train_plain, _ = load_corpus_ids(plain)
    assert train_small.size > 0 and (train_small == train_plain).all()


def test_quick_training_end_to_end(tmp_path):
    src = tmp_path / "stdlib"
    for rel, text in SOURCES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text * 6)
    (src / "tests").mkdir()
    (src / "tests" / "test_x.py").write_text("assert True\n")          # excluded directory
    (src / "latin.py").write_bytes("x = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8
    corpus = tmp_path / "corpus"
    manifest = build_corpus(corpus, vocab_size=300, root=src, heldout_percent=50, verbose=False)
    paths = {e["path"] for e in manifest["files"]}
    assert paths == set(SOURCES)
    assert {e["split"] for e in manifest["files"]} <= {"train", "heldout"}
    for e in manifest["files"]:
        assert len(e["sha256"]) == 64 and e["bytes"] == len((src / e["path"]).read_bytes())
    add_heldout_if_missing(corpus, src, manifest)
    out = tmp_path / "ckpt"
    args = tiny.build_parser().parse_args([
        "--corpus", str(corpus), "--out", str(out), "--device", "cpu", "--quick", "--steps", "40",
        "--seed", "0", "--batch-size", "8", "--seq-len", "64", "--lr", "5e-3", "--log-every", "10",
        "--max-shard-mb", "0.2",
        "--model", "hidden_size=32", "--model", "head_dim=16", "--model", "intermediate_size=64",
        "--model", "moe_intermediate_size=16", "--model", "num_experts=8", "--model", "n_group=4",
        "--model", "topk_group=2", "--model", "num_experts_per_tok=3"])
    log = tiny.train(args)
    first, last = log["history"][0]["loss"], log["history"][-1]["loss"]
    assert math.isfinite(last) and last < 0.8 * first, (first, last)
    assert log["steps"] == 40 and log["tokens_seen"] == 40 * 8 * 64
    assert set(log["heldout"]) == {"0.15", "0.5", "0.9", "1.0"}
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["steps"] == 40 and "final_train_loss" in saved
    # Expert bias moved (aux-loss-free balancing) and stays fp32 in the checkpoint.
    tensors = read_tensors(out)
    assert any(float(t.abs().max()) > 0 for n, t in tensors.items() if n.endswith("expert_bias"))
    # Config token ids point at the special tokens of tokenizer.json.
    cfg = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert cfg["mask_token_id"] == added["<|mask|>"]
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == added["<|endoftext|>"]
    assert {"<role>", "</role>", "<|role_end|>"} <= set(added)
    assert all(t["special"] for t in tok["added_tokens"])
    assert cfg["vocab_size"] == tensors["lm_head.weight"].shape[0]
    assert set(tensors) == _expected_names(TinyConfig.from_hf_dict(cfg))
    assert (out / "corpus_manifest.json").is_file()
