"""The settings schema: EngineConfig's groups, the CLI flags generated from them, and `--policy name:key=value` in
every entry point that builds an engine (generate, chat, serve, the Python API)."""
from __future__ import annotations

import argparse
from dataclasses import fields, replace

import pytest

import oled
from oled.bench.runner import BenchConfig
from oled.cli import build_parser, main
from oled.cli.common import engine_config
from oled.config import SECTIONS, SETTING_NAMES, EngineConfig, OffloadConfig, setting_fields
from oled.engine import Engine
from tests.test_cli_inputs import one_error_line
from tests.test_hardening import no_loading  # noqa: F401  (fixture)

TINY = ["--random-weights", "tiny", "--device", "cpu"]
ENGINE_COMMANDS = ("generate", "chat", "serve", "trace", "calibrate", "bench")
BENCH_SETS_PER_RUN = {"expert_budget", "policy", "misses", "waves", "torch_threads"}


def _dests(parser, command) -> dict[str, argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_setting_has_its_flag_with_the_schemas_default(command):
    parser, _ = build_parser()
    dests = _dests(parser, command)
    for f in setting_fields():
        if not f.metadata["cli"] or (command == "bench" and f.name in BENCH_SETS_PER_RUN):
            assert f.name not in dests or f.name == "profile", (command, f.name)
            continue
        action = dests[f.name]
        if command == "calibrate" and f.name == "policy":
            continue                                  # calibrate runs full (or lru)
        assert action.default == f.default, (command, f.name, action.default)
        assert action.choices in (None, f.metadata["choices"]), (command, f.name)


def test_flags_reach_their_group():
    parser, _ = build_parser()
    args = parser.parse_args(["generate", "hi", "--capture-slots", "3", "--no-pin", "--cpu-isa", "portable",
                              "--no-fused", "--fused-moe", "--cpu-share", "--layers", "2"])
    cfg = engine_config(args)
    assert (cfg.offload.capture_slots, cfg.offload.pin_memory, cfg.offload.cpu_share) == (3, False, True)
    assert cfg.cpu.cpu_isa == "portable" and cfg.layers == 2
    assert cfg.kernels.fused_moe is True and cfg.kernels.fused_router is False      # --no-fused, then one asked for
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--layers", "0"])                         # the field's minimum


def test_flat_names_and_groups_are_one_setting():
    cfg = EngineConfig(random_weights="tiny", capture_slots=3, offload=OffloadConfig(cpu_share=True))
    assert cfg.offload.capture_slots == 3 and cfg.capture_slots == 3 and cfg.offload.cpu_share is True
    copy = replace(cfg, policy="lru")
    copy.capture_slots = 5                               # a copy's group is its own
    assert (cfg.capture_slots, copy.offload.capture_slots, copy.policy) == (3, 5, "lru")
    assert EngineConfig.capture_slots == 16              # the class gives the default
    assert list(cfg.to_dict()) == list(SETTING_NAMES) and cfg.to_dict()["capture_slots"] == 3
    assert set(SETTING_NAMES) == {f.name for cls in SECTIONS.values() for f in fields(cls)} | {
        f.name for f in fields(EngineConfig) if f.name not in SECTIONS}
    with pytest.raises(TypeError, match="unknown engine setting"):
        EngineConfig(capture_slot=3)


def test_bench_hands_its_engine_settings_on():
    parser, _ = build_parser()
    args = parser.parse_args(["bench", *TINY, "--capture-slots", "2", "--no-shared-stream", "--tide-tau", "3"])
    cfg = engine_config(args)
    assert cfg.offload.capture_slots == 2 and cfg.kernels.shared_stream is False and cfg.tide_tau == 3
    assert BenchConfig(engine=cfg).engine is cfg and BenchConfig().engine == EngineConfig()


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_policy_options_in_the_cli(command):
    parser, _ = build_parser()
    argv = [command, *(["hi"] if command == "generate" else []), *TINY, "--policy", "tide:tau=2"]
    engine = Engine(engine_config(parser.parse_args(argv)))
    assert engine.policy.name == "tide" and engine.policy.tau == 2
    engine.manager.close()


def test_policy_options_in_the_api():
    llm = oled.LLM(random_weights="tiny", device="cpu", policy="oled:decay=0.5", expert_budget="0.5")
    assert llm.engine.policy.name == "oled" and llm.engine.policy.decay == 0.5
    assert llm.generate("def f(", gen_length=8).token_ids
    llm.engine.manager.close()


def test_generate_runs_with_policy_options(capsys):
    assert main(["generate", "def f(", *TINY, "--gen-length", "8", "--policy", "lru:misses=load",
                 "--expert-budget", "0.5", "--no-stream"]) == 0


BAD_POLICIES = [("oled:nope=1", "policy 'oled' has no option 'nope' (options: misses, retention, decay"),
                ("oled:decay", "options are written name:key=value"),
                ("belady", "policy 'belady' needs the future routing: it runs in replays only"),
                ("nope:tau=2", "unknown policy 'nope'; choose from oled,")]


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("policy, words", BAD_POLICIES)
def test_bad_policy_options_are_one_line_before_loading(capsys, no_loading, command, policy, words):  # noqa: F811
    argv = [command, *(["hi"] if command == "generate" else []), *TINY, "--policy", policy,
            *(["--port", "0"] if command == "serve" else [])]
    assert words in one_error_line(capsys, argv)


def test_an_option_given_twice_is_refused(capsys, no_loading):  # noqa: F811
    line = one_error_line(capsys, ["generate", "hi", *TINY, "--policy", "tide:tau=2", "--tide-tau", "3"])
    assert "sets 'tau', and so does its own flag: give it once" in line


@pytest.mark.parametrize("policy, words", BAD_POLICIES)
def test_bad_policy_options_in_the_api(no_loading, policy, words):  # noqa: F811
    with pytest.raises(ValueError, match=words.split("(")[0].replace("'", ".")):
        oled.LLM(random_weights="tiny", device="cpu", policy=policy)
