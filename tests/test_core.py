"""Engine core: router, MoE, loader and decoding against plain references (CPU, fp32, tiny checkpoints)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import oled
from oled.loader import CheckpointError, load_checkpoint, official_tensors
from oled.models.config import ConfigError, config_from_dict
from oled.models.router import sigmoid_group_route, softmax_route
from oled.synth import preset_config, write_checkpoint
from oled.tokenizer import TokenizerError

from .reference import RefModel


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="session")
def tiny_moe_ckpt(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-lladamoe"), tmp_path_factory.mktemp("tiny_moe"), seed=5)


@pytest.fixture(scope="session")
def tiny_ref(tiny_ckpt):
    return RefModel(tiny_ckpt)


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(ckpt, dst)
    return dst


# ------------------------------------------------------------------------------------------------ router
def _naive_group_route(h, w, bias, k, n_group, topk_group, scale):
    ids, weights = [], []
    for t in range(h.shape[0]):
        s = torch.sigmoid(h[t].double() @ w.double().t())
        b = (s + bias.double()).tolist()
        per = len(b) // n_group
        gs = [sum(sorted(b[g * per:(g + 1) * per])[-2:]) for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: -gs[g])[:topk_group]
        cand = sorted((e for g in keep for e in range(g * per, (g + 1) * per)), key=lambda e: -b[e])[:k]
        ws = s[cand] / s[cand].sum() * scale
        ids.append(cand)
        weights.append(ws.tolist())
    return torch.tensor(ids), torch.tensor(weights)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigmoid_group_router_matches_transcription(seed):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(24, 32, generator=g), torch.randn(64, 32, generator=g) / 4
    bias = torch.randn(64, generator=g)   # large bias: selection must differ from the unbiased ranking
    ids, weights = sigmoid_group_route(h, w, bias, top_k=6, n_group=8, topk_group=3, routed_scaling_factor=2.5)
    ref_ids, ref_w = _naive_group_route(h, w, bias, 6, 8, 3, 2.5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.float(), rtol=1e-5, atol=1e-6)
    # the bias selects but does not weight: weights come from the unbiased sigmoid scores
    s = torch.sigmoid(h @ w.t()).gather(1, ids)
    torch.testing.assert_close(weights, s / s.sum(-1, keepdim=True) * 2.5)
    # group limiting: every chosen expert lies in at most topk_group groups
    assert all(len(set((row // 8).tolist())) <= 3 for row in ids)
    unbiased = sigmoid_group_route(h, w, None, top_k=6, n_group=8, topk_group=3, routed_scaling_factor=2.5)[0]
    assert not torch.equal(ids, unbiased)


def test_softmax_router_no_renormalisation():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(10, 16, generator=g), torch.randn(8, 16, generator=g)
    ids, weights = softmax_route(h, w, top_k=3)
    p = torch.softmax(h @ w.t(), -1)
    torch.testing.assert_close(weights, p.gather(1, ids))
    assert (weights.sum(-1) < 1).all()
    assert torch.equal(ids, p.topk(3, -1).indices)


# ------------------------------------------------------------------------------------------- MoE, forward
@pytest.mark.parametrize("budget,policy", [("1.0", "full"), ("1.0", "lru"), ("0.25", "lru")])
def test_moe_layer_matches_naive(tiny_ckpt, tiny_ref, budget, policy):
    llm = oled.LLM(str(tiny_ckpt), expert_budget=budget, policy=policy)
    model = llm.engine.model
    layer = model.config.moe_layers[0]
    x = torch.randn(20, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ours = model.layers[layer].mlp(x)
    torch.testing.assert_close(ours, tiny_ref.moe(x, layer), rtol=1e-4, atol=1e-5)


def test_forward_matches_reference(tiny_ckpt, tiny_ref):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    model = llm.engine.model
    ids = torch.randint(0, 500, (70,), generator=torch.Generator().manual_seed(0))
    from oled.decoding.kv_cache import KVCache
    kv = KVCache(model.config, 70, torch.float32, "cpu")
    ours = model(ids, 0, kv, 70, slice(None))
    torch.testing.assert_close(ours, tiny_ref.forward(ids), rtol=1e-4, atol=1e-4)


def test_experts_live_in_host_store_not_model(tiny_ckpt):
    llm = oled.LLM(str(tiny_ckpt), expert_budget="0.25")
    eng = llm.engine
    names = [n for n, _ in eng.model.named_parameters()]
    assert not any("experts" in n for n in names)
    c = eng.config
    assert eng.store.host_bytes == len(c.moe_layers) * c.num_experts * c.expert_numel * 4
    w = load_file(str(next(tiny_ckpt.glob("model-*.safetensors"))))
    layer = c.moe_layers[-1]
    torch.testing.assert_close(eng.store.part(layer, 7, "down_proj"),
                               w[f"model.layers.{layer}.mlp.experts.7.down_proj.weight"].float())


# ------------------------------------------------------------------------------------------------ decoding
PROMPTS = [list(range(3, 35)), list(range(10, 17)), list(range(40, 90))]   # 32 (a multiple of the block), 7, 50


@pytest.mark.parametrize("prompt", PROMPTS, ids=["len32", "len7", "len50"])
@pytest.mark.parametrize("threshold", [0.9, 0.5])
def test_kv_cached_decode_equals_reference(tiny_ckpt, tiny_ref, prompt, threshold):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    out = llm.generate(prompt_token_ids=prompt, gen_length=64, block_length=32, threshold=threshold, cache="prefix")
    ref = tiny_ref.generate(prompt, 64, 32, threshold)
    assert out.token_ids == ref
    assert out.counters["tokens_per_forward"] > 1.0, "the test must exercise multi-token commits"
    nocache = llm.generate(prompt_token_ids=prompt, gen_length=64, block_length=32, threshold=threshold,
                           cache="none")
    assert nocache.token_ids == ref


def test_block_length_and_steps(tiny_ckpt, tiny_ref):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    out = llm.generate(prompt_token_ids=PROMPTS[1], gen_length=40, block_length=16, steps=4, threshold=0.9)
    assert out.token_ids == tiny_ref.generate(PROMPTS[1], 40, 16, 0.9, steps=4)
    assert all(n <= 4 for n in out.counters["iterations_per_block"])


def test_lladamoe_low_confidence_rule_matches_reference(tiny_moe_ckpt):
    ref = RefModel(tiny_moe_ckpt)
    llm = oled.LLM(str(tiny_moe_ckpt), policy="full")
    prompt = list(range(20, 31))
    out = llm.generate(prompt_token_ids=prompt, gen_length=32, block_length=16, steps=8, rule="low_confidence",
                       cache="none")
    assert out.token_ids == ref.generate(prompt, 32, 16, None, steps=8)
    # blocks start at the end of the prompt (LLaDA's generate()): two blocks of 16 masks, the fixed 8 steps each
    assert out.counters["iterations_per_block"] == [8, 8]
    for mode in ("prefix", "dual"):   # approximate caches: they run and decode every position
        o = llm.generate(prompt_token_ids=prompt, gen_length=32, block_length=16, steps=8, rule="low_confidence",
                         cache=mode)
        assert len(o.token_ids) > 0 and 511 not in o.token_ids


def test_eos_stops_and_truncates(tiny_ckpt):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    prompt = PROMPTS[1]
    eos = llm.engine.config.eos_token_id
    base = llm.generate(prompt_token_ids=prompt, gen_length=96, block_length=32, threshold=0.9)
    # make the model emit EOS: bias the LM head's EOS row towards the hidden directions
    head = llm.engine.model.lm_head.weight
    head.data[eos] = head.data[base.token_ids[5]] * 3
    out = llm.generate(prompt_token_ids=prompt, gen_length=96, block_length=32, threshold=0.9)
    assert eos in out.token_ids and out.token_ids[-1] == eos
    assert out.finish_reason == "stop"
    assert len(out.counters["iterations_per_block"]) == (prompt.__len__() + out.token_ids.index(eos)) // 32 + 1


def test_sampling_is_seeded(tiny_ckpt):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    # the random LM head is sharply peaked; a high temperature makes the samples depend on the seed
    a = llm.generate(prompt_token_ids=PROMPTS[1], gen_length=32, temperature=50.0, seed=7)
    b = llm.generate(prompt_token_ids=PROMPTS[1], gen_length=32, temperature=50.0, seed=7)
    c = llm.generate(prompt_token_ids=PROMPTS[1], gen_length=32, temperature=50.0, seed=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_counters(tiny_ckpt):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    out = llm.generate(prompt_token_ids=PROMPTS[0], gen_length=64, threshold=0.9)
    c = out.counters
    assert c["nfe"] == sum(c["iterations_per_block"])
    # the prompt's prefill only: a finished block's final K/V ride on the next block's first forward
    assert c["cache_forwards"] == 1
    assert c["tpot_s"] == pytest.approx(c["decode_s"] / c["generated_tokens"])


def test_context_too_long(tiny_ckpt):
    llm = oled.LLM(str(tiny_ckpt))
    with pytest.raises(ValueError, match="supports 1024"):
        llm.generate(prompt_token_ids=list(range(10, 400)) * 3, gen_length=64)


# ------------------------------------------------------------------------------------------------ loader
def test_checkpoint_layout_matches_official_names(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    names = set(index)
    assert {n for n, _, _ in official_tensors(oled.models.config.load_config(tiny_ckpt))} == names
    assert "model.layers.1.mlp.gate.expert_bias" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names


def test_official_index_names_are_all_mapped():
    """Every tensor name of the real tiny official checkpoint index maps onto our model."""
    from pathlib import Path

    idx = Path(__file__).parent / "data" / "llada2-tiny-official.index.json"   # copied from shared/models
    names = set(json.loads(idx.read_text())["weight_map"])
    layers = 1 + max(int(n.split(".")[2]) for n in names if n.startswith("model.layers."))
    experts = 1 + max(int(n.split(".")[5]) for n in names if ".experts." in n)
    raw = preset_config("tiny")
    raw.update(num_hidden_layers=layers, num_experts=experts, n_group=1, topk_group=1)
    ours = {n for n, _, _ in official_tensors(config_from_dict(raw))}
    assert ours == names


def test_missing_tensor_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    shard = next(ck.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"], tensors["model.layers.1.attention.dense.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.attention\.dense\.weight.*"
                                              r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        load_checkpoint(ck, torch.float32, "cpu", pin=False)


def test_misshaped_tensor_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    shard = next(ck.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.1.mlp.gate.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor model\.layers\.1\.mlp\.gate\.weight has "
                                              r"shape \(3, 3\), expected \(16, 64\)"):
        load_checkpoint(ck, torch.float32, "cpu", pin=False)
    tensors["model.layers.1.mlp.gate.weight"] = torch.zeros(16, 64)
    tensors["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.weight: expected shape \(64, 32\)"):
        load_checkpoint(ck, torch.float32, "cpu", pin=False)


def test_unexpected_tensor_and_ignored_extra_layers(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    shard = next(ck.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.3.attention.dense.weight"] = torch.zeros(2, 2)   # layer >= num_hidden_layers: ignored
    save_file(tensors, str(shard))
    load_checkpoint(ck, torch.float32, "cpu", pin=False)
    tensors["model.extra_thing.weight"] = torch.zeros(2)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match="unexpected tensor model.extra_thing.weight"):
        load_checkpoint(ck, torch.float32, "cpu", pin=False)


def test_unsupported_architecture_and_missing_files(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(dict(cfg, model_type="mixtral")))
    with pytest.raises(ConfigError, match="unsupported model_type 'mixtral'"):
        load_checkpoint(ck, torch.float32, "cpu", pin=False)
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        oled.LLM(str(ck))
    next(ck.glob("model-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard listed in the index is missing"):
        load_checkpoint(ck, torch.float32, "cpu", pin=False)


def test_single_file_checkpoint(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    (ck / "model.safetensors.index.json").unlink()
    next(ck.glob("model-*.safetensors")).rename(ck / "model.safetensors")
    a = oled.LLM(str(ck), policy="full").generate(prompt_token_ids=PROMPTS[1], gen_length=32)
    b = oled.LLM(str(tiny_ckpt), policy="full").generate(prompt_token_ids=PROMPTS[1], gen_length=32)
    assert a.token_ids == b.token_ids


def test_synth_tokenizer_special_ids(tiny_ckpt):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert tok.token_to_id("<|mask|>") == cfg["mask_token_id"]
    assert tok.token_to_id("<|endoftext|>") == cfg["eos_token_id"]
    assert tok.get_vocab_size() == cfg["vocab_size"]


def test_random_weights_preset_equals_written_checkpoint(tiny_ckpt):
    a = oled.LLM(random_weights="tiny", seed=3, policy="full").generate(prompt_token_ids=PROMPTS[1], gen_length=32)
    b = oled.LLM(str(tiny_ckpt), policy="full").generate(prompt_token_ids=PROMPTS[1], gen_length=32)
    assert a.token_ids == b.token_ids


def test_grouped_compute_sees_one_layers_slots(tiny_ckpt, monkeypatch):
    """CUDA's grouped GEMM takes at most 1024 groups: each call must get one layer's slots, never the whole pool
    (the full pool of LLaDA2.0-mini is 19 x 256 slots; this failed on the H200 before the fix)."""
    import oled.runtime.compute as manager_mod

    seen = []
    real = manager_mod.grouped_swiglu

    def spy(x, pair_tokens, pair_slots, pool, *args, **kwargs):
        seen.append(pool.shape[0])
        return real(x, pair_tokens, pair_slots, pool, *args, **kwargs)

    monkeypatch.setattr(manager_mod, "grouped_swiglu", spy)
    for policy, budget in (("full", "1.0"), ("lru", "0.5")):
        llm = oled.LLM(str(tiny_ckpt), policy=policy, expert_budget=budget)
        llm.generate(prompt_token_ids=PROMPTS[1], gen_length=32)
        assert seen and set(seen) == {llm.engine.manager.cache.capacity}
        seen.clear()


def test_moe_layer_op_count_does_not_grow_with_active_experts(tiny_ckpt):
    """The routed experts of a layer run as one grouped computation: the same number of tensor operations (kernel
    launches on a GPU) whether 1 or 16 experts are active."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    llm = oled.LLM(str(tiny_ckpt), policy="full")
    manager, layer = llm.engine.manager, llm.engine.config.moe_layers[0]
    x = torch.randn(32, llm.engine.config.hidden_size)
    counts = {}
    for n_active in (1, 4, 16):
        ids = (torch.arange(32 * 4) % n_active).view(32, 4) if n_active >= 4 else torch.zeros(32, 4, dtype=torch.long)
        weights = torch.full((32, 4), 0.25)
        with CountOps() as c:
            manager.run(layer, x, ids, weights)
        counts[n_active] = c.n
    assert len(set(counts.values())) == 1 and counts[1] > 5, counts


def test_api_cancellation(tiny_ckpt):
    llm = oled.LLM(str(tiny_ckpt), policy="full")
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) > 3          # let three iterations run, then stop

    out = llm.generate(prompt_token_ids=PROMPTS[1], gen_length=128, threshold=1.0, cancelled=cancelled)
    assert out.finish_reason == "cancelled" and out.counters["nfe"] == 3


def test_a_vanishing_temperature_samples_the_argmax():
    from oled.decoding.rules import predict
    logits = torch.tensor([[3.0, 50.0, -2.0], [0.5, 0.1, 0.4]])
    x0, conf = predict(logits, 1e-38, torch.Generator().manual_seed(0))
    assert x0.tolist() == [1, 0] and torch.isfinite(conf).all() and conf.tolist() == [1.0, 1.0]
