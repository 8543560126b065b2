"""The learned retention score (oled/policies/retention_model.py): its features, its fit, the policy that ranks by
it, and `oled trace --fit-retention`."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import oled
from oled.cli import main
from oled.policies.retention_model import (FEATURES, RECENCY_CAP, STEP_CAP, RetentionFeatures, RetentionModel, fit,
                                           trace_samples)
from oled.trace import Trace

TINY_TRACE = Path(__file__).parent / "data" / "tiny-code.trace"


def feature(matrix, expert, name):
    return matrix[expert, FEATURES.index(name)]


def test_the_features_follow_the_layers_history_by_hand():
    f = RetentionFeatures([7], 6)
    f.observe(7, np.array([1, 2]), np.array([3, 1]), "A")
    f.observe(7, np.array([2, 4]), np.array([2, 2]), "A")
    f.observe(7, np.array([5]), np.array([4]), "B")
    m = f.matrix(7)
    assert m.shape == (6, len(FEATURES)) and (m[:, 0] == 1).all()
    # expert 2: used one and two runs ago, twice in the request, in block A's first run (now the previous block's)
    assert feature(m, 2, "tokens_0") == 0 and feature(m, 2, "tokens_1") == np.log1p(2)
    assert feature(m, 2, "tokens_2") == np.log1p(1) and feature(m, 2, "used_1") == 1 == feature(m, 2, "used_2")
    assert feature(m, 2, "recency") == 1 / RECENCY_CAP and feature(m, 2, "request_uses") == np.log1p(2)
    assert feature(m, 2, "block_first") == 0 and feature(m, 2, "previous_block_first") == 1
    # expert 5: this run, the first of block B; expert 0: never used
    assert feature(m, 5, "used_0") == 1 == feature(m, 5, "block_first") and feature(m, 5, "block_step") == 0
    assert feature(m, 0, "recency") == 1 and feature(m, 0, "request_uses") == 0
    f.observe(7, np.array([5]), np.array([1]), "B")            # block B's second run
    m = f.matrix(7)
    assert feature(m, 5, "block_step") == 1 / STEP_CAP == feature(m, 5, "used_now_step")
    f.reset()
    assert (f.matrix(7)[:, 1:] == np.eye(1, len(FEATURES) - 1, FEATURES.index("recency") - 1)).all()


def test_the_samples_pair_each_run_with_the_next_use_on_its_layer():
    trace = Trace.load(TINY_TRACE)
    X, D = trace_samples(trace)
    E = int(trace.header["model"]["num_experts"])
    runs = [(int(layer), set(trace.run_ids(i).reshape(-1).tolist())) for i, layer in enumerate(trace.run_layer)]
    assert X.shape == (len(runs) * E, len(FEATURES)) and D.shape == (len(runs) * E,)
    for r in (0, 5, len(runs) // 2):                  # runs of the layer until each expert's next use, by hand
        layer = runs[r][0]
        later = [experts for lay, experts in runs[r + 1:] if lay == layer]
        for e in range(E):
            want = next((k + 1 for k, experts in enumerate(later) if e in experts), math.inf)
            assert D[r * E + e] == want


def test_the_fit_scores_recent_experts_above_unused_ones_and_round_trips(tmp_path):
    model = fit([Trace.load(TINY_TRACE)], ["tiny"])
    assert np.isfinite(model.w).all() and model.provenance["samples"] > 0
    f = RetentionFeatures([0], 4)
    for _ in range(4):
        f.observe(0, np.array([1]), np.array([2]), "A")
    score = model.score(f.matrix(0))
    assert score[1] > score[0]
    path = tmp_path / "r.json"
    path.write_text(model.to_json())
    assert RetentionModel.load(str(path)).weights == model.weights
    assert RetentionModel.load().features == list(FEATURES)              # the shipped one loads
    path.write_text('{"weights": [1.0], "features": ["bias"]}')
    with pytest.raises(ValueError, match="malformed retention model"):
        RetentionModel.load(str(path))


def test_learned_retention_gives_the_tokens_of_full_on_the_bundled_model():
    want = oled.LLM(device="cpu", dtype="float32", policy="full").generate("def fibonacci(n):", gen_length=48)
    llm = oled.LLM(device="cpu", dtype="float32", policy="oled-retain:retention=learned", expert_budget="0.25")
    assert llm.generate("def fibonacci(n):", gen_length=48).token_ids == want.token_ids
    assert llm.stats()["hit_rate_tokens"] < 1.0 and llm.stats()["totals"]["loads"] > 0


def test_fit_retention_cli(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert main(["trace", "--report", str(TINY_TRACE), str(TINY_TRACE), "--fit-retention", str(out)]) == 0
    assert RetentionModel.load(str(out)).provenance["traces"] == [str(TINY_TRACE)] * 2
    capsys.readouterr()
    assert main(["trace", "--fit-retention", str(out), "--out", str(tmp_path / "t.trace")]) == 2
    assert main(["trace", "--report", str(TINY_TRACE), "--fit-retention", str(out), "--markdown"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "--fit-retention" in err
