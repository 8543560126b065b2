"""Bad flags and files on an ordinary machine: one clear line and exit code 2, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import oled
from oled.cli import main
from oled import host_memory
from oled.runtime.threads import plan_threads

TINY = ["--random-weights", "tiny", "--device", "cpu", "--gen-length", "4"]


def one_error_line(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"oled {argv[0]}: error: "), err
    return err[0]


def test_cuda_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = one_error_line(capsys, ["generate", "hi", *TINY, "--device", "cuda"])
    assert "device 'cuda': CUDA is not available here" in line and "--device cpu" in line


def test_unknown_device(capsys):
    assert "unknown device 'tpu'" in one_error_line(capsys, ["generate", "hi", *TINY, "--device", "tpu"])


def test_truncated_trace_for_replay(capsys, tmp_path):
    trace = tmp_path / "t.trace"
    assert main(["trace", *TINY, "--prompt", "hi", "--out", str(trace)]) == 0
    trace.write_bytes(trace.read_bytes()[:-100])
    capsys.readouterr()
    line = one_error_line(capsys, ["bench", "--replay", str(trace), "--policies", "lru", "--budgets", "0.5",
                                   "--out", str(tmp_path / "b")])
    assert f"{trace}: not an oled trace, or truncated" in line


def test_bench_refuses_a_bad_budget_before_running(capsys, tmp_path):
    line = one_error_line(capsys, ["bench", *TINY, "--budgets", "1.0,abc", "--out", str(tmp_path / "b")])
    assert "expert budget 'abc': expected a fraction" in line
    assert not (tmp_path / "b").exists()                 # nothing ran


@pytest.mark.parametrize("spec, words", [("150%", "at most 100%"), ("999GiB", "more than all the routed experts"),
                                         ("2.0", "at most 1")])
def test_budgets_above_everything_refused_alike(capsys, spec, words):
    assert words in one_error_line(capsys, ["generate", "hi", *TINY, "--expert-budget", spec])


def test_binary_prompts_file(capsys, tmp_path):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    line = one_error_line(capsys, ["calibrate", *TINY, "--prompts-file", str(binary), "--out", str(tmp_path / "p")])
    assert f"--prompts-file '{binary}' is not UTF-8 text (byte 0x89 at offset 0)" in line


def test_directory_given_for_a_file(capsys, tmp_path):
    line = one_error_line(capsys, ["calibrate", *TINY, "--prompts-file", str(tmp_path), "--out", str(tmp_path / "p")])
    assert f"--prompts-file '{tmp_path}' is a directory; give a file" in line
    line = one_error_line(capsys, ["generate", "hi", *TINY, "--policy", "fiddler", "--expert-budget", "0.5",
                                   "--popularity", str(tmp_path)])
    assert f"expert popularity file '{tmp_path}' is a directory" in line


def test_cpu_threads_zero_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", *TINY, "--cpu-threads", "0"])
    assert e.value.code == 2 and "argument --cpu-threads: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="CPU expert threads must be at least 1, got 0"):
        oled.LLM(random_weights="tiny", device="cpu", cpu_threads=0)


def test_closed_pipe_is_one_line():
    """`oled generate ... | head -c 1`: the reader leaves; the command stops with one line, no traceback."""
    cli = "import sys; from oled.cli import main; sys.exit(main(sys.argv[1:]))"
    gen = subprocess.Popen([sys.executable, "-c", cli, "generate", "def f():", *TINY, "--gen-length", "64",
                            "--stats"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    gen.stdout.close()                                  # the reader is gone before the first write
    _, err = gen.communicate(timeout=120)
    lines = err.decode().strip().splitlines()
    assert gen.returncode == 141 and lines == ["oled generate: output closed by the reader; stopped"], lines


def test_version_and_help_show_defaults_and_policies(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"oled {oled.__version__}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--policy NAME[:KEY=VALUE]" in text
    assert "expert residency policy, with options as name:key=value (oled:decay=0.5); one of oled," in text
    assert "fiddler, tide (default: oled)" in text and "belady" not in text and "(default: 0.95)" in text


def test_random_weights_larger_than_host_memory(capsys, monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 24 * 2**30)
    line = one_error_line(capsys, ["generate", "hi", "--random-weights", "llada2-mini", "--device", "cpu"])
    # llada2-mini: 19 MoE layers x 256 experts x 3 x 2048 x 512 = 15.3 B routed parameters, 57.0 GiB in fp32.
    assert "preset llada2-mini needs 60.6 GiB of host memory in float32 (routed experts 57.0 GiB + other " \
           "weights 3.6 GiB); 24.0 GiB is available" in line


def test_thread_plan_fills_the_cores_once():
    assert plan_threads(cores=2) == plan_threads(1, 1, cores=2)
    assert (plan_threads(cores=16).torch_threads, plan_threads(cores=16).kernel_threads) == (1, 15)
    assert plan_threads(cores=1).kernel_threads == 1                # the kernel always has a worker
    assert plan_threads(torch_threads=4, cores=16).kernel_threads == 12
    assert plan_threads(kernel_threads=3, cores=16).kernel_threads == 3


def test_engine_applies_the_thread_plan(monkeypatch):
    before = torch.get_num_threads()
    try:
        llm = oled.LLM(random_weights="tiny", device="cpu", policy="tide", expert_budget="0.5", torch_threads=2)
        assert torch.get_num_threads() == 2
        assert llm.engine.manager.cpu_kernel.num_threads == llm.engine.threads.kernel_threads
        oled.LLM(random_weights="tiny", device="cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_stats_per_request_and_bounded(monkeypatch):
    monkeypatch.setattr(oled.llm, "STATS_HISTORY", 2)
    llm = oled.LLM(random_weights="tiny", device="cpu", policy="lru", expert_budget="0.5")
    prompts = ["hello", "def f(x):", "import os"]
    outs = [llm.generate(p, gen_length=8) for p in prompts]
    s = llm.stats()
    assert len(s["requests"]) == 2                                    # the oldest fell out of the list ...
    assert [r["generated_tokens"] for r in s["requests"]] == [len(o.token_ids) for o in outs[1:]]
    # ... but not out of the total, and the manager holds only the last request's records
    assert s["totals"]["pairs"] > sum(r["totals"]["pairs"] for r in s["requests"]) > 0
    assert s["forwards"] == sum(o.counters["nfe"] for o in outs)
    assert {r.forward for r in llm.engine.manager.stats.records} <= set(range(outs[-1].counters["nfe"] + 2))


def test_synth_progress_bar_has_a_total(capsys, tmp_path):
    from oled.loader import official_tensors
    from oled.models.config import config_from_dict
    from oled.synth import preset_config

    assert main(["synth", "--preset", "tiny", str(tmp_path / "ck")]) == 0
    total = len(official_tensors(config_from_dict(preset_config("tiny"))))
    err = capsys.readouterr().err
    assert "writing: 100%" in err and f" {total}/{total} " in err, err      # without a total: no % and no /N


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout"])
@pytest.mark.parametrize("value", ["0", "inf", "-1"])
def test_serve_timeouts_must_be_positive_and_finite(capsys, flag, value):
    pytest.importorskip("uvicorn")
    line = one_error_line(capsys, ["serve", *TINY[:4], flag, value])
    assert f"{flag} must be a positive number of seconds" in line


def test_waves_only_for_the_cooperative_oled_policies(capsys):
    for policy in ("lru", "oled-retain", "tide"):
        line = one_error_line(capsys, ["generate", "hi", *TINY, "--policy", policy, "--waves"])
        assert "--waves applies to oled and oled-coop" in line
    assert main(["generate", "def f(", *TINY, "--policy", "oled", "--waves", "--expert-budget", "0.25"]) == 0


@pytest.mark.parametrize("flag", ["--fused-router", "--fused-moe", "--fused-linear"])
def test_triton_flags_without_cuda_are_one_line(flag):
    """On a CPU-only machine (no TRITON_INTERPRET) the Triton kernels' flags are refused before any work (its own
    process: a test that switched Triton's interpreter on keeps it on for the rest of the process)."""
    cli = "import sys; from oled.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", cli, "generate", "hi", *TINY, flag],
                         capture_output=True, text=True, timeout=120, env=env)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and f"{flag} needs" in lines[0], lines


@pytest.mark.parametrize("flags, words", [(["--cpu-chunks", "0"], "cpu_chunks must be an integer >= 1"),
                                          (["--cpu-spin-us", "-1"], "cpu_spin_us must be a number"),
                                          (["--cpu-amx-min-tokens", "-2"], "cpu_amx_min_tokens must be an integer")])
def test_cpu_kernel_knobs_out_of_range(capsys, flags, words):
    assert words in one_error_line(capsys, ["generate", "hi", *TINY, *flags])


def test_cpu_kernel_knobs_reach_the_kernel():
    """The CPU kernel's knobs are EngineConfig fields (no environment variables): a CPU policy's kernel is built
    with them, and the cost model's cache key tells kernels with other knobs apart."""
    from oled.runtime.cost_model import cache_key

    llm = oled.LLM(random_weights="tiny", device="cpu", dtype="float32", policy="tide", expert_budget="0.5",
                   cpu_isa="portable", cpu_chunks=2, cpu_spin_us=10.0, cpu_pin=False, cpu_wake="off")
    kernel, manager = llm.engine.manager.cpu_kernel, llm.engine.manager
    assert kernel.name == "portable" and manager.cpu_wake == "off"
    assert kernel.knobs == dict(isa="portable", amx_min_tokens=4, pin=False, spin_us=10.0, chunks=2, prefetch=True,
                                prefetch_distance=4)
    assert kernel.cpus == [-1] * kernel.num_threads                      # not pinned
    other = oled.runtime.cpu_kernel.CpuExpertKernel(num_threads=kernel.num_threads, isa="portable")
    store, device = llm.engine.store, llm.engine.device
    assert cache_key(store, kernel, device) != cache_key(store, other, device)
    other.close()


@pytest.mark.parametrize("flag,field", [("--no-shared-stream", "shared_stream"),
                                        ("--no-shared-in-moe", "shared_in_moe")])
def test_the_shared_expert_flags_reach_the_engine_config(flag, field):
    """--no-shared-stream and --no-shared-in-moe turn their EngineConfig field off (on by default) for every command
    that builds an engine, `oled bench` included."""
    from oled.bench.runner import BenchConfig
    from oled.cli import build_parser
    from oled.cli.common import engine_config

    parser, _ = build_parser()
    assert getattr(engine_config(parser.parse_args(["generate", "hi"])), field) is True
    assert getattr(engine_config(parser.parse_args(["generate", flag, "hi"])), field) is False
    assert getattr(parser.parse_args(["bench", flag]), field) is False
    assert getattr(BenchConfig().engine.kernels, field) is True     # what `oled bench` hands each engine it builds
