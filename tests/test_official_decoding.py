"""Decoding against the plain transcription of the official procedures (tests/reference.py), for both
architectures: block lengths, prompt lengths on and off the block grid, generations shorter than `steps` and ending
mid-block, every cache mode; the request's block length in the mask; the LLaDA-MoE checkpoint variants; the bf16
router rules; and the bounds that keep bad weights or parameters from hanging a request."""
from __future__ import annotations

import json
import time

import pytest
import torch

import oled
from oled.decoding.loop import NonFiniteError
from oled.decoding.kv_cache import KVCache
from oled.loader import load_checkpoint
from oled.models.config import ConfigError, config_from_dict
from oled.models.router import sigmoid_group_route, softmax_route
from oled.synth import preset_config, write_checkpoint

from .reference import RefModel

ARCHS = {"llada2": ("tiny", 3), "lladamoe": ("tiny-lladamoe", 5)}
# LLaDA-MoE variants the official code supports: a shared expert beside the MoE block, an expert bias on the softmax
LLADAMOE_VARIANT = {"shared_expert_intermediate_size": 48, "moe_router_enable_expert_bias": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (LLM, RefModel) on the same checkpoint."""
    out = {}
    for arch, (preset, seed) in ARCHS.items():
        ckpt = write_checkpoint(preset_config(preset), tmp_path_factory.mktemp(arch), seed=seed)
        out[arch] = (oled.LLM(str(ckpt), policy="full"), RefModel(ckpt))
    raw = dict(preset_config("tiny-lladamoe"), **LLADAMOE_VARIANT)
    ckpt = write_checkpoint(raw, tmp_path_factory.mktemp("variant"), seed=7)
    out["lladamoe-variant"] = (oled.LLM(str(ckpt), policy="full"), RefModel(ckpt))
    return out


def _rule(arch):
    # LLaDA2's threshold rule (multi-token commits); LLaDA's fixed-steps low-confidence remasking
    return dict(threshold=0.9, rule="threshold") if arch == "llada2" else dict(threshold=None, rule="low_confidence")


def _prompt(length, start=20):
    return [start + (7 * i) % 400 for i in range(length)]


# (prompt length, gen_length) per block length: prompts on the block grid and off it; a generation shorter than the
# default steps (= B) that ends inside its block, and one over several blocks that ends mid-block
CASES = [(B, p, g) for B in (8, 16, 32) for p in (B, B + 3) for g in (B // 2 + 1, 2 * B + 5)]


@pytest.mark.parametrize("arch", ["llada2", "lladamoe"])
@pytest.mark.parametrize("B,prompt_len,gen", CASES, ids=[f"B{b}-P{p}-G{g}" for b, p, g in CASES])
def test_every_cache_mode_against_the_official_procedure(models, arch, B, prompt_len, gen):
    llm, ref = models[arch]
    prompt, rule = _prompt(prompt_len), _rule(arch)
    expected = ref.generate(prompt, gen, B, rule["threshold"])
    outs = {mode: llm.generate(prompt_token_ids=prompt, gen_length=gen, block_length=B, cache=mode, **rule)
            for mode in ("none", "prefix", "dual")}
    mask, eos = llm.engine.config.mask_token_id, llm.engine.config.eos_token_id

    def complete(ids):      # every position decoded, up to gen_length or the first EOS
        return mask not in ids and (len(ids) == gen or ids[-1] == eos)

    assert outs["none"].token_ids == expected
    assert complete(expected)
    if arch == "llada2":          # block-causal: every cache is exact, so all agree with the reference
        assert outs["prefix"].token_ids == expected and outs["dual"].token_ids == expected
        assert all(n <= min(B, gen) for n in outs["prefix"].counters["iterations_per_block"])
    else:                         # bidirectional: the caches approximate; the blocks and their fixed steps do not
        for mode in ("prefix", "dual"):
            o = outs[mode]
            assert complete(o.token_ids)
            assert o.counters["iterations_per_block"] == outs["none"].counters["iterations_per_block"]
        # blocks start at the end of the prompt: ceil(gen / B) blocks, the last one shorter, one commit per step
        sizes = [min(B, gen - k) for k in range(0, gen, B)]
        assert outs["none"].counters["iterations_per_block"] == sizes


@pytest.mark.parametrize("B", [8, 16])
def test_lladamoe_caches_are_exact_when_each_block_is_one_refresh(models, B):
    """With one iteration per block every forward of the approximate caches is the block's refresh of the whole
    canvas, which is exact: prefix and dual then agree with the reference and with `none`."""
    llm, ref = models["lladamoe"]
    prompt = _prompt(B + 5)
    expected = ref.generate(prompt, 2 * B + 3, B, None, steps=1)
    for mode in ("none", "prefix", "dual"):
        out = llm.generate(prompt_token_ids=prompt, gen_length=2 * B + 3, block_length=B, steps=1,
                           rule="low_confidence", threshold=None, cache=mode)
        assert out.token_ids == expected, mode
        assert out.counters["iterations_per_block"] == [1, 1, 1]


def test_the_mask_uses_the_requests_block_length(models):
    llm, ref = models["llada2"]
    model = llm.engine.model
    ids = torch.tensor(_prompt(40))
    logits = {}
    for B in (8, 32):
        kv = KVCache(model.config, 40, torch.float32, "cpu")
        logits[B] = model(ids, 0, kv, 40, slice(None), block_length=B)
        llm.engine.manager.end_forward()        # hand the forward's routing log over, as the loop does
        torch.testing.assert_close(logits[B], ref.forward(ids, B), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[8], logits[32], atol=1e-3), "block length 8 must see fewer keys"


@pytest.mark.parametrize("minimal_topk", [1, 3])
def test_llada2_caps_steps_at_gen_length_over_minimal_topk(models, minimal_topk):
    llm, ref = models["llada2"]
    prompt = _prompt(32)                        # a whole block: the next one is all masks
    out = llm.generate(prompt_token_ids=prompt, gen_length=6, block_length=32, steps=32, rule="low_confidence",
                       threshold=None, minimal_topk=minimal_topk)
    assert out.token_ids == ref.generate(prompt, 6, 32, None, steps=32, minimal_topk=minimal_topk)
    # the cap spreads the block's 32 tokens over gen_length // minimal_topk iterations
    assert out.counters["iterations_per_block"] == [6 // minimal_topk]


def test_prompt_mask_tokens_are_decoded_as_the_official_code_does(models):
    """LLaDA2 decodes the prompt's masks that share the first block with the generation (earlier ones stay);
    LLaDA lets every mask before the block's end compete for the commits. Both terminate."""
    for arch in ("llada2", "lladamoe"):
        llm, ref = models[arch]
        mask = llm.engine.config.mask_token_id
        prompt = _prompt(19)
        prompt[3] = prompt[17] = mask              # with B 16: one in a prefilled block, one in the first block
        rule = _rule(arch)
        expected = ref.generate(prompt, 21, 16, rule["threshold"], steps=8)
        for mode in ("none", "prefix") if arch == "llada2" else ("none",):
            out = llm.generate(prompt_token_ids=prompt, gen_length=21, block_length=16, steps=8, cache=mode, **rule)
            assert out.token_ids == expected, (arch, mode)


def test_lladamoe_variants_load_in_the_official_layout_and_decode(models):
    llm, ref = models["lladamoe-variant"]
    names = set(ref.w)
    assert {"model.layers.1.shared_expert.down_proj.weight", "model.layers.1.mlp.expert_bias"} <= names
    assert not any(".mlp.shared_expert" in n for n in names)
    block = llm.engine.model.moe_blocks()[1]
    torch.testing.assert_close(block.expert_bias, ref.w["model.layers.1.mlp.expert_bias"])
    x = torch.randn(24, llm.engine.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(block(x), ref.moe(x, 1), rtol=1e-4, atol=1e-5)
    llm.engine.manager.end_forward()
    # the bias weights the experts too: the combine weights are the biased probabilities
    _, weights = block.route(x)
    probs = torch.softmax(x @ block.router_weight.t(), -1) + block.expert_bias
    torch.testing.assert_close(weights, probs.topk(llm.engine.config.top_k, -1).values)
    prompt = _prompt(13)
    out = llm.generate(prompt_token_ids=prompt, gen_length=19, block_length=8, rule="low_confidence",
                       threshold=None, cache="none")
    assert out.token_ids == ref.generate(prompt, 19, 8, None)


def test_lladamoe_config_keys_the_official_code_ignores_are_refused():
    raw = preset_config("tiny-lladamoe")
    assert config_from_dict(raw).head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    with pytest.raises(ConfigError, match="head_dim 32 differs from hidden_size / num_attention_heads = 16"):
        config_from_dict(dict(raw, head_dim=32))
    with pytest.raises(ConfigError, match="norm_topk_prob true"):
        config_from_dict(dict(raw, norm_topk_prob=True))


# --------------------------------------------------------------------------------------------- bf16 routing
def _flips(a_ids, b_ids) -> int:
    return int((a_ids.sort(-1).values != b_ids.sort(-1).values).any(-1).sum())


def test_bf16_router_follows_the_official_dtype_rules(tmp_path):
    """Loaded in bf16: LLaDA2 rounds its expert_bias to bf16 (fp32 logits and sigmoid), LLaDA-MoE computes its gate
    logits in bf16 (fp32 softmax). The engine's choices equal those rules, which differ from all-fp32 routing."""
    g = torch.Generator().manual_seed(0)
    # LLaDA2: a bias with bf16-visible digits, on scores close enough that its rounding decides some choices
    ckpt = write_checkpoint(preset_config("tiny"), tmp_path / "l2", seed=3)
    loaded = load_checkpoint(ckpt, torch.bfloat16, "cpu", pin=False)
    block = loaded.model.moe_blocks()[0]
    c = loaded.config
    assert block.expert_bias.dtype == torch.bfloat16
    bias32 = torch.randn(c.num_experts, generator=g) * 0.01 + 0.3
    block.expert_bias.data.copy_(bias32)
    h = (torch.randn(4096, c.hidden_size, generator=g) * 0.02).to(torch.bfloat16)
    kw = dict(top_k=c.top_k, n_group=c.n_group, topk_group=c.topk_group,
              routed_scaling_factor=c.routed_scaling_factor)
    ids, _ = block.route(h)
    official, _ = sigmoid_group_route(h, block.router_weight, bias32.to(torch.bfloat16), **kw)
    all_fp32, _ = sigmoid_group_route(h, block.router_weight, bias32, **kw)
    assert torch.equal(ids, official)
    assert _flips(ids, all_fp32) > 0, "the test needs tokens whose choice depends on the bias precision"
    # LLaDA-MoE: bf16 logits
    ckpt = write_checkpoint(preset_config("tiny-lladamoe"), tmp_path / "lm", seed=5)
    loaded = load_checkpoint(ckpt, torch.bfloat16, "cpu", pin=False)
    block = loaded.model.moe_blocks()[0]
    h = torch.randn(4096, loaded.config.hidden_size, generator=g).to(torch.bfloat16)
    ids, weights = block.route(h)
    logits16 = torch.nn.functional.linear(h, block.router_weight).float()     # the official gate: nn.Linear
    expected_w, expected_ids = torch.softmax(logits16, -1).topk(loaded.config.top_k, -1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_w.to(torch.bfloat16).float())
    fp32_ids, _ = softmax_route(h.float(), block.router_weight.float(), top_k=loaded.config.top_k)
    assert _flips(ids, fp32_ids) > 0, "the test needs tokens whose choice depends on the gate precision"


# --------------------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("arch", ["llada2", "lladamoe"])
@pytest.mark.parametrize("where", ["lm_head", "embed", "norm"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_weights_end_the_request(tmp_path, arch, where, temperature):
    preset, seed = ARCHS[arch]
    llm = oled.LLM(str(write_checkpoint(preset_config(preset), tmp_path, seed=seed)), policy="full")
    eng = llm.engine
    weight = {"lm_head": eng.model.lm_head.weight, "embed": eng.model.embed.weight, "norm": eng.model.norm.weight}
    weight[where].data[_prompt(9)[4] if where == "embed" else 7] = float("nan" if where == "lm_head" else "inf")
    t0 = time.perf_counter()
    with pytest.raises(NonFiniteError, match=r"non-finite prediction at position \d+ \(block \d+, iteration 0\)"):
        llm.generate(prompt_token_ids=_prompt(9), gen_length=16, temperature=temperature, seed=1)
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("arch", ["llada2", "lladamoe"])
def test_huge_steps_and_block_length_are_bounded(models, arch):
    llm, _ = models[arch]
    rule = _rule(arch)
    t0 = time.perf_counter()
    out = llm.generate(prompt_token_ids=_prompt(9), gen_length=20, block_length=16, steps=5 * 10**7, **rule)
    assert max(out.counters["iterations_per_block"]) <= 16
    # a block far longer than the generation: LLaDA2 decodes the whole padded block (its mask attends to the
    # padding) in at most gen_length iterations; LLaDA's canvas ends with the generation
    out = llm.generate(prompt_token_ids=_prompt(9), gen_length=4, block_length=1000, **rule)
    assert len(out.token_ids) == 4 and out.counters["nfe"] <= 4
    assert time.perf_counter() - t0 < 30
    with pytest.raises(ValueError, match="minimal_topk must be a positive integer, got 0"):
        llm.generate(prompt_token_ids=_prompt(9), gen_length=4, minimal_topk=0)
    with pytest.raises(ValueError, match=r"steps must be a positive integer, got 50000000\.0"):
        llm.generate(prompt_token_ids=_prompt(9), gen_length=4, steps=5e7)


def test_cli_reports_non_finite_weights_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from oled.cli import main

    ckpt = write_checkpoint(preset_config("tiny"), tmp_path, seed=3)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shard = ckpt / index["lm_head.weight"]
    tensors = load_file(str(shard))
    tensors["lm_head.weight"][5, 3] = float("nan")
    save_file(tensors, str(shard))
    assert main(["generate", "--model", str(ckpt), "--device", "cpu", "hello", "--gen-length", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "oled generate: error: the model produced a non-finite prediction" in err[0]


def test_server_answers_non_finite_weights_with_a_500_and_keeps_serving():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from oled.server import create_app

    llm = oled.LLM(random_weights="tiny", policy="full", device="cpu", dtype="float32")
    llm.engine.model.lm_head.weight.data[7, 0] = float("nan")
    with TestClient(create_app(llm.engine)) as client:
        body = {"model": llm.engine.model_name, "prompt": "hi", "max_tokens": 8}
        for _ in range(2):                      # the engine thread is free again after each
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["code"] == "non_finite_output" and "non-finite prediction" in err["message"]
        assert client.get("/health").status_code == 200
