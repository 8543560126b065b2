"""`oled compare`: teacher-forced logits of a candidate configuration against a reference on the same canvases."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import oled
from oled.bench.teacher_forced import Teacher, TeacherForcingError, compare, compare_recordings, record
from oled.bench.workloads import Prompt
from oled.cli import main
from oled.config import EngineConfig
from oled.decoding.model_runner import ModelRunner
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from tests.test_hardening import no_loading  # noqa: F401  (fixture)

TINY = dict(random_weights="tiny", device="cpu", dtype="float32")
PROMPTS = [Prompt("p0", prompt="The quick brown fox"), Prompt("p1", prompt="def add(a, b):")]
PARAMS = dict(gen_length=20, block_length=8)
LIMITS = dict(max_forwards=1000, max_logit_bytes=2**30)


def run(candidate: dict, reference: dict | None = None):
    return compare(EngineConfig(**TINY, **(reference or {"policy": "full"})), EngineConfig(**{**TINY, **candidate}),
                   lambda tokenizer: PROMPTS, DecodeParams(**PARAMS), **LIMITS)


@pytest.fixture
def forwards(monkeypatch):
    """Every forward the model runners run, seen at the runner (not by the recorder): the runner, the canvas fed,
    its position, key end, logit rows and logits."""
    seen = []
    plain = ModelRunner.forward

    def spy(self, ids, start, kv, kv_end, rows, **kw):
        out = plain(self, ids, start, kv, kv_end, rows, **kw)
        seen.append((self, ids.cpu().numpy().copy(), start, kv_end, rows, None if out is None else out.clone()))
        return out

    monkeypatch.setattr(ModelRunner, "forward", spy)
    return seen


def test_same_configuration_is_exact_through_the_cli(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    rc = main(["compare", "--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--candidate",
               "policy=full", "--prompt", "The quick brown fox", "--gen-length", "20", "--block-length", "8",
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    total = result["total"]
    assert total["positions"] > 0 and total["forwards"] == len(result["prompts"][0]["forwards"])
    assert (total["max_abs"], total["mean_abs"], total["argmax_agreement"]) == (0.0, 0.0, 1.0)
    assert total["committed_positions"] > 0 and total["committed_agreement"] == 1.0
    assert total["free_token_agreement"] == 1.0 and total["free_tokens_equal"]
    assert result["reference"]["engine"]["policy"] == "full" and result["candidate"]["engine"]["policy"] == "full"
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[0] == "prompt" and table[-1].split()[0] == "all"


def test_gpu_only_offloading_changes_no_logit():
    result = run({"policy": "lru", "expert_budget": "0.25"})
    assert "4 of 16 experts per layer" in result.candidate_engine         # it did offload
    total = result.total()
    assert total["positions"] > 0
    assert (total["max_abs"], total["argmax_agreement"], total["free_tokens_equal"]) == (0.0, 1.0, True)


def test_perturbed_numerics_equal_a_direct_recomputation(forwards):
    result = run({"dtype": "bfloat16"})
    total = result.total()
    assert total["max_abs"] > 0 and total["argmax_agreement"] < 1.0        # bf16 against fp32 does differ
    reference = [f for f in forwards if f[0] is forwards[0][0]]
    candidate = [f for f in forwards if f[0] is not forwards[0][0]]
    forced, free = candidate[:len(reference)], candidate[len(reference):]
    # the candidate was fed the reference's canvases, forward by forward
    for a, b in zip(reference, forced, strict=True):
        assert np.array_equal(a[1], b[1]) and a[2:5] == b[2:5]
    # the metrics, recomputed from the runner's own logits at the masked positions of the rows read
    mask = forwards[0][0].config.mask_token_id
    pairs = [(a[5][torch.from_numpy(a[1][a[4]] == mask)], b[5][torch.from_numpy(b[1][b[4]] == mask)])
             for a, b in zip(reference, forced) if a[5] is not None]
    diff = torch.cat([(x.double() - y.double()).abs().flatten() for x, y in pairs])
    same = torch.cat([x.argmax(-1) == y.argmax(-1) for x, y in pairs])
    assert total["positions"] == len(same)
    assert total["max_abs"] == diff.max().item()
    assert total["mean_abs"] == pytest.approx(diff.mean().item(), rel=1e-12)
    assert total["argmax_agreement"] == same.double().mean().item()
    # the free run: the candidate's own decoding (as a fresh engine of its configuration decodes), position by position
    assert len(free) > len(forced) // 2
    llm = oled.LLM(**{**TINY, "dtype": "bfloat16"})
    for prompt, p in zip(PROMPTS, result.prompts):
        assert p.candidate_tokens == llm.generate(prompts=prompt.prompt, **PARAMS).token_ids
    same = sum(a == b for p in result.prompts for a, b in zip(p.reference_tokens, p.candidate_tokens))
    assert total["free_token_agreement"] == same / sum(len(p.reference_tokens) for p in result.prompts)


def test_teacher_forcing_replays_the_canvases_and_catches_a_divergence():
    engine = Engine(EngineConfig(**TINY, policy="full"))
    params = DecodeParams(**PARAMS)
    ids = PROMPTS[0].ids(engine.tokenizer)
    ref = record(engine, ids, params)
    plain = engine.generate_ids(ids, params)            # observed or not, the same decoding
    assert ref.token_ids == plain.token_ids and len(ref.forwards) == plain.nfe + plain.cache_forwards
    assert len(ref.iterations) == plain.nfe > 1
    assert all((f.logits is not None) == (f.kind == "iteration") for f in ref.forwards)
    assert all(len(f.logits) == (f.tokens[f.rows] == engine.config.mask_token_id).sum() for f in ref.forwards
               if f.logits is not None)
    forced = record(engine, ids, params, teacher=Teacher(ref))
    assert [f.tokens.tolist() for f in forced.forwards] == [f.tokens.tolist() for f in ref.forwards]
    diffs = compare_recordings(ref, forced)
    assert all(d.max_abs == 0.0 and d.argmax_equal == d.positions and d.committed_equal == d.committed for d in diffs)
    assert [d.committed for d in diffs] == [int(it.commit.sum()) for it in ref.iterations]
    assert sum(d.committed for d in diffs) == plain.committed
    # a candidate whose logits at one committed position prefer another token: one committed disagreement
    k = next(i for i, f in enumerate(forced.forwards) if f.logits is not None)
    it = ref.iterations[0]
    row = int(np.flatnonzero(it.commit[forced.forwards[k].masked])[0])
    forced.forwards[k].logits = forced.forwards[k].logits.copy()
    forced.forwards[k].logits[row, forced.forwards[k].logits[row].argmin()] = 1e9
    first = compare_recordings(ref, forced)[0]
    assert (first.committed - first.committed_equal, first.positions - first.argmax_equal) == (1, 1)
    forced.forwards[-1].tokens[-1] += 1
    with pytest.raises(TeacherForcingError, match="another canvas"):
        compare_recordings(ref, forced)
    ref.iterations[1].commit[:] = False           # a recorded iteration the run cannot follow: it must not finish
    with pytest.raises(TeacherForcingError):
        record(engine, ids, params, teacher=Teacher(ref))


@pytest.mark.parametrize("item, words", [
    ("polcy=full", "unknown engine setting 'polcy'"),
    ("policy", "expected KEY=VALUE"),
    ("cpu_share=maybe", "cpu_share is true or false"),
    ("cpu_wake=sometimes", "cpu_wake is one of"),
    ("capture_slots=many", "capture_slots takes a whole number"),
    ("random_weights=tiny", "the model is shared"),
    ("policy=mru", "unknown policy"),
    ("expert_budget=abc", "expert budget 'abc'"),
    ("dtype=float16", "dtype 'float16' is not supported"),
    ("device=tpu", "unknown device"),
    ("expert_dtype=fp16", "expert_dtype (--expert-dtype) must be one of bf16, fp8"),
])
def test_bad_candidate_is_one_line_and_exit_2_before_any_model(capsys, no_loading, item, words):
    assert main(["compare", "--random-weights", "tiny", "--device", "cpu", "--candidate", item]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_costs_are_capped_before_decoding(capsys):
    assert main(["compare", "--random-weights", "tiny", "--device", "cpu", "--prompts", "2",
                 "--max-forwards", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "above --max-forwards 5" in err[0], err
    assert main(["compare", "--prompt", "x", "--prompts", "2"]) == 2
