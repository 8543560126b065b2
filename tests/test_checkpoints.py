"""Malformed checkpoints through the CLI: each gets one line naming the file and the key, and exit code 2.

Every case starts from a tiny random checkpoint in the published layout (`oled synth`'s writer) and breaks one
thing in it.
"""
from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from oled.cli import main
from oled.synth import preset_config, write_checkpoint

SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("pristine"), seed=1)


@pytest.fixture
def ck(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ck")


def generate(ck, capsys, *extra):
    rc = main(["generate", "def f():", "--model", str(ck), "--device", "cpu", "--gen-length", "4", *extra])
    return rc, capsys.readouterr().err.strip().splitlines()


def edit_json(path, change):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(change(doc)))


def header_only_shard(path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand: 8-byte little-endian header length, JSON header, data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def with_extra_token(path):
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<|beyond|>"])     # gets id 512 = vocab_size: no embedding row for it
    tok.save(str(path))


def without_mask_token(path):
    doc = json.loads(path.read_text())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] != "<|mask|>"]
    del doc["model"]["vocab"]["<|mask|>"]
    path.write_text(json.dumps(doc))


def edit_tensors(change):
    """Break the shard's tensors: change(tensors) edits the name -> tensor dict in place."""
    def breaks(path):
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))
    return breaks


ROUTER_BIAS, ROUTER_WEIGHT = "model.layers.1.mlp.gate.expert_bias", "model.layers.2.mlp.gate.weight"
NORM = "model.norm.weight"


def poke(name, index, value):
    """One element of tensor `name` set to `value` (index None: every element)."""
    def change(tensors):
        flat = tensors[name].view(-1)
        flat[slice(None) if index is None else index] = value
    return edit_tensors(change)


def recast(name, dtype):
    def change(tensors):
        tensors[name] = tensors[name].to(dtype)
    return edit_tensors(change)


CASES = {
    # name: (file to break, how, words the one line must hold besides the file name)
    # non-finite router weights change the routing without a non-finite output: refused at load (issue 53)
    "router bias all NaN": (SHARD, poke(ROUTER_BIAS, None, float("nan")), f"tensor {ROUTER_BIAS} holds NaN or Inf"),
    "router bias one NaN": (SHARD, poke(ROUTER_BIAS, 3, float("nan")), f"tensor {ROUTER_BIAS} holds NaN or Inf"),
    "router weight one Inf": (SHARD, poke(ROUTER_WEIGHT, 5, float("inf")), f"tensor {ROUTER_WEIGHT} holds NaN or Inf"),
    "router weight one -Inf": (SHARD, poke(ROUTER_WEIGHT, 0, -float("inf")),
                               f"tensor {ROUTER_WEIGHT} holds NaN or Inf"),
    # a dtype the config does not declare: not silently rounded
    "float64 tensor": (SHARD, recast(NORM, torch.float64),
                       f"tensor {NORM} has dtype float64; config.json declares bfloat16"),
    "fp8 tensor": (SHARD, recast(ROUTER_WEIGHT, torch.float8_e4m3fn),
                   f"tensor {ROUTER_WEIGHT} has dtype float8_e4m3fn; config.json declares bfloat16"),
    "fp16 tensor in a bf16 checkpoint": (SHARD, recast(NORM, torch.float16), "has dtype float16"),
    "binary config": ("config.json", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\0\0"),
                      "not UTF-8 text (byte 0x89 at offset 0)"),
    "mask id missing": ("config.json", lambda p: edit_json(p, lambda d: {k: v for k, v in d.items()
                                                                          if k != "mask_token_id"}),
                        "'mask_token_id' is missing from config.json, and the value taken from the llada2_moe "
                        "default (the architecture table), 156895, is outside the vocabulary (vocab_size 512)"),
    "shard path escapes the directory": (INDEX, lambda p: edit_json(p, lambda d: dict(
        d, weight_map={k: "../../../etc/passwd" for k in d["weight_map"]})), "outside the model directory"),
    "absolute shard path": (INDEX, lambda p: edit_json(p, lambda d: dict(
        d, weight_map={k: "/etc/passwd" for k in d["weight_map"]})), "'/etc/passwd', outside the model directory"),
    "truncated shard": (SHARD, truncate, "not a readable safetensors file"),
    "empty shard": (SHARD, lambda p: p.write_bytes(b""), "not a readable safetensors file"),
    "garbage header": (SHARD, lambda p: p.write_bytes(struct.pack("<Q", 40) + b"{not json at all" + b"x" * 40),
                       "not a readable safetensors file"),
    "huge header": (SHARD, lambda p: p.write_bytes(struct.pack("<Q", 2**60) + b"{}"),
                    "not a readable safetensors file"),
    "offsets beyond the file": (SHARD, lambda p: header_only_shard(
        p, {"model.norm.weight": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, b"\0" * 16),
        "not a readable safetensors file"),
    "index without weight_map": (INDEX, lambda p: edit_json(p, lambda d: {"metadata": d["metadata"]}),
                                 "key 'weight_map' must be an object"),
    "index weight_map a list": (INDEX, lambda p: edit_json(p, lambda d: dict(d, weight_map=list(d["weight_map"]))),
                                "key 'weight_map' must be an object"),
    "index as a list": (INDEX, lambda p: edit_json(p, lambda d: [d]), "key 'weight_map' must be an object"),
    "index entry not a file": (INDEX, lambda p: edit_json(p, lambda d: dict(d, weight_map={"lm_head.weight": 3})),
                               "weight_map['lm_head.weight'] must be a shard file name, got 3"),
    "hidden_size a string": ("config.json", lambda p: edit_json(p, lambda d: dict(d, hidden_size="64")),
                             "'hidden_size' must be an integer, got '64'"),
    "config a list": ("config.json", lambda p: edit_json(p, lambda d: [d]), "expected a JSON object"),
    "garbage tokenizer": ("tokenizer.json", lambda p: p.write_text('{"version": "1.0", "model": 7}'),
                          "not a valid tokenizer.json"),
    "mask id beyond vocab": ("config.json", lambda p: edit_json(p, lambda d: dict(d, mask_token_id=100000)),
                             "'mask_token_id' 100000 is outside the vocabulary (vocab_size 512)"),
    "mask id negative": ("config.json", lambda p: edit_json(p, lambda d: dict(d, mask_token_id=-1)),
                         "'mask_token_id' -1 is outside the vocabulary"),
    "eos id beyond vocab": ("config.json", lambda p: edit_json(p, lambda d: dict(d, eos_token_id=[512])),
                            "'eos_token_id' 512 is outside the vocabulary"),
    "tokenizer id beyond vocab": ("tokenizer.json", with_extra_token,
                                  "token '<|beyond|>' has id 512, beyond the model's vocab_size 512"),
    "tokenizer without mask": ("tokenizer.json", without_mask_token, "no token has the config's mask_token_id 511"),
    "block_length 0": ("config.json", lambda p: edit_json(p, lambda d: dict(d, block_length=0)),
                       "'block_length' must be at least 1, got 0"),
    "n_group 0": ("config.json", lambda p: edit_json(p, lambda d: dict(d, n_group=0)),
                  "'n_group' must be at least 1, got 0"),
    "top_k above experts": ("config.json", lambda p: edit_json(p, lambda d: dict(d, num_experts_per_tok=17)),
                            "'num_experts_per_tok' 17 is larger than num_experts 16"),
    "no layers": ("config.json", lambda p: edit_json(p, lambda d: dict(d, num_hidden_layers=0)),
                  "'num_hidden_layers' must be at least 1, got 0"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_one_line_exit_2(ck, capsys, case):
    file, breaks, words = CASES[case]
    breaks(ck / file)
    rc, err = generate(ck, capsys)
    assert rc == 2 and len(err) == 1, err
    assert file in err[0] and words in err[0], err[0]


def test_extra_layers_are_reported_not_fatal(ck, capsys, caplog):
    """The published LLaDA2 layout carries a layer beyond num_hidden_layers (multi-token prediction): it is
    dropped, and the terminal says so."""
    tensors = load_file(str(ck / SHARD))
    tensors["model.layers.3.attention.dense.weight"] = tensors["model.layers.2.attention.dense.weight"].clone()
    save_file(tensors, str(ck / SHARD))
    with caplog.at_level(logging.WARNING, logger="oled"):
        rc, _ = generate(ck, capsys)
    assert rc == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint holds layer(s) 3 beyond num_hidden_layers 3 (in {SHARD}): ignored"]


@pytest.mark.parametrize("command", [["generate", "hi", "--random-weights", "tiny", "--layers", "0"],
                                     ["synth", "--preset", "tiny", "--layers", "0"]])
def test_zero_layers_refused_by_the_cli(command, capsys, tmp_path):
    if command[0] == "synth":
        command = [*command, str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        main(command)
    assert e.value.code == 2
    assert "argument --layers: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
