"""The bundled tiny model (trained by oled/train/tiny.py on the H200) loads and decodes deterministically."""
from __future__ import annotations

import json
from pathlib import Path

import oled
from oled.engine import default_model_dir

PROMPT = 'def add(a, b):\n    """Return the sum of a and b."""\n'
# Recorded from this checkpoint on the CPU in fp32 (greedy, block 32, threshold 0.95).
RECORDED = [203, 486, 276, 1485, 944, 12, 69, 16, 314, 308, 267, 382, 712, 301, 2512, 395, 275, 311, 316, 275, 447,
            314, 625, 267, 343, 334, 77, 1485, 944, 12, 69, 16]


def test_bundled_checkpoint_is_default_and_small():
    d = default_model_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe" and cfg["num_experts"] >= 32 and cfg["num_experts_per_tok"] >= 4
    assert sum(p.stat().st_size for p in Path(d).iterdir()) <= 32 * 10**6


def test_bundled_model_decodes_recorded_output():
    llm = oled.LLM(policy="full")
    out = llm.generate(PROMPT, gen_length=32)
    assert out.token_ids == RECORDED
    assert out.text.startswith("\ndef ")
    # offloading does not change tokens: a quarter of the experts on the "GPU" (CPU tensors here)
    small = oled.LLM(policy="lru", expert_budget="0.25").generate(PROMPT, gen_length=32)
    assert small.token_ids == RECORDED


def test_generation_report_checks():
    from oled.train.generation_report import adds_body, function_prompts, is_valid

    src = 'import os\n\ndef f(a):\n    """Doc."""\n    return a\n\nclass C:\n    pass\n\ndef g(b):\n    return b\n'
    assert function_prompts(src + "<|endoftext|>" + "def h(:\n", "<|endoftext|>", 5) == [
        'def f(a):\n    """Doc."""\n', "def g(b):\n"]
    assert is_valid("def g(b):\n", "    if b:\n        return 1\n    ret")       # open block gets a `pass`
    assert not is_valid("def g(b):\n", "    return (b\n")
    assert adds_body("    x = 1\n") and not adds_body("\n# comment\ndef k():\n") and not adds_body("    y = 2")


def test_generation_report_shows_progress(tmp_path, capsys):
    from oled.train.generation_report import generation_report

    heldout = tmp_path / "heldout.txt"
    heldout.write_text('def one():\n    """One."""\n    return 1\n<|endoftext|>def two():\n    return 2\n')
    rep = generation_report(None, str(heldout), n=2, gen_length=8, progress=True)
    assert rep["prompts"] == 2
    err = capsys.readouterr().err
    assert "generation report: 100%" in err and "2/2" in err, err
