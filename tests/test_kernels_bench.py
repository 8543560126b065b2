"""benchmarks/kernels_bench.py without a GPU: it refuses to run (exit 2), and its checks, counting and arithmetic
judge right. Its cases run end to end under Triton's interpreter in tests/test_triton_kernels.py."""
from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oled.decoding.rules import predict as predict_reference
from oled.models.router import sigmoid_group_route as route_reference

from .scripts import benchmark_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_bench.py"


def load_bench():
    return benchmark_script("kernels_bench")


bench = load_bench()
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")


@needs_no_cuda
def test_exits_2_without_cuda(tmp_path):
    out = tmp_path / "k.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert "needs a CUDA device" in run.stderr and run.stdout == ""
    assert not out.exists()


@needs_no_cuda
def test_main_returns_2_in_process():
    assert bench.main(["--repeats", "20"]) == 2


def test_too_few_repeats_is_an_error():
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "5"])


def routing(tokens=6, experts=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(tokens, 8, generator=g), torch.randn(experts, 8, generator=g)
    b = 0.1 * torch.randn(experts, generator=g)
    out = route_reference(x, w, b, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    return out, x @ w.t(), b


def test_compare_routing():
    (ids, weights), logits, b = routing()
    assert bench.compare_routing((ids, weights), (ids.clone(), weights.clone()), logits, b)["ok"]
    swapped = ids.clone()
    swapped[2, [0, 1]] = swapped[2, [1, 0]]                       # same experts, another order: not a tie
    verdict = bench.compare_routing((ids, weights), (swapped, weights), logits, b)
    assert not verdict["ok"] and verdict["mismatched_rows"] == 1 and verdict["tie_rows"] == 0
    off = weights.clone()
    off[0, 0] *= 1 + 1e-4
    verdict = bench.compare_routing((ids, weights), (ids, off), logits, b)
    assert not verdict["ok"] and verdict["max_weight_rel_err"] > bench.WEIGHT_RTOL


def test_compare_routing_excuses_exact_ties_only():
    logits = torch.zeros(1, 8)                                    # every expert scores the same
    want = (torch.tensor([[3, 5]]), torch.tensor([[1.0, 1.0]]))
    got = (torch.tensor([[0, 1]]), torch.tensor([[1.0, 1.0]]))
    verdict = bench.compare_routing(want, got, logits, None)
    assert verdict["ok"] and verdict["tie_rows"] == 1 and verdict["mismatched_rows"] == 0
    logits[0, 1] = 1e-3                                           # now expert 1 is not tied with 5
    assert not bench.compare_routing(want, got, logits, None)["ok"]


def test_compare_routing_excuses_near_ties_given_the_routing():
    """The fused gate sums in its own order: a row whose deciding scores lie within NEAR_TIE may pick the other
    expert; one whose pick was clear may not."""
    logits = torch.zeros(2, 8)
    logits[:, 0] = 2.0                                            # expert 0 first, then 1 against 2
    logits[0, 1], logits[0, 2] = 1.0, 1.0 - 1e-6                  # row 0: a near-tie for the second place
    logits[1, 1], logits[1, 2] = 1.0, 0.5                         # row 1: clear
    want = (torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2))
    got = (torch.tensor([[0, 2], [0, 2]]), torch.ones(2, 2))
    routing = dict(top_k=2, n_group=1, topk_group=1)
    verdict = bench.compare_routing(want, got, logits, None, routing=routing)
    assert verdict["near_tie_rows"] == 1 and verdict["mismatched_rows"] == 1 and not verdict["ok"]
    verdict = bench.compare_routing((want[0][:1], want[1][:1]), (got[0][:1], got[1][:1]), logits[:1], None,
                                    routing=routing)
    assert verdict["ok"] and verdict["near_tie_rows"] == 1
    assert not bench.compare_routing((want[0][:1], want[1][:1]), (got[0][:1], got[1][:1]), logits[:1], None)["ok"]


def test_compare_confidence():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 3
    x0, p = predict_reference(logits, 0.0, None)
    assert bench.compare_confidence((x0, p), (x0.clone(), p.clone()), logits)["ok"]
    wrong = x0.clone()
    wrong[1] = (wrong[1] + 1) % 300
    verdict = bench.compare_confidence((x0, p), (wrong, p), logits)
    assert not verdict["ok"] and verdict["mismatched_rows"] == 1
    verdict = bench.compare_confidence((x0, p), (x0, p * (1 + 1e-4)), logits)
    assert not verdict["ok"] and verdict["max_prob_rel_err"] > 1e-5
    nan = p.clone()
    nan[0] = math.nan
    assert not bench.compare_confidence((x0, p), (x0, nan), logits)["finiteness_agrees"]


def test_compare_confidence_excuses_probability_ties():
    """Logits 1e-8 apart have one probability: the reference says 0, an argmax of the logits says 1."""
    logits = torch.tensor([[0.0, 1e-8, -3.0]])
    want = predict_reference(logits, 0.0, None)
    verdict = bench.compare_confidence(want, (torch.tensor([1]), want[1]), logits)
    assert verdict["ok"] and verdict["tie_rows"] == 1


def test_non_finite_rows_are_non_finite_in_the_reference():
    odd = bench.with_non_finite_rows(torch.randn(9, 50))
    x0, p = predict_reference(odd, 0.0, None)
    assert odd.shape == (7, 50) and not torch.isfinite(p[:6]).any() and torch.isfinite(p[6])
    assert bench.compare_non_finite((x0, p), (x0, p))["ok"]
    hidden = p.clone()
    hidden[:6] = 0.5                                              # a kernel that would hide broken rows
    assert not bench.compare_non_finite((x0, p), (x0, hidden))["ok"]


def test_per_call_counts():
    kernels = Counter({"triton_scan": 10, "triton_combine": 10, "odd": 3})
    counts = bench.per_call(kernels, Counter({"Memset (Device)": 5}), calls=5)
    assert counts["kernels"] == {"odd": 0.6, "triton_combine": 2, "triton_scan": 2}
    assert counts["launches"] == pytest.approx(4.6) and counts["memsets_copies"] == 1


def test_device_event_kinds():
    from torch.autograd import DeviceType

    def event(name, device=DeviceType.CUDA, activity=None):
        return SimpleNamespace(name=name, device_type=device, activity_type=activity)

    assert bench.device_event_kind(event("gemm", activity="kernel")) == "kernel"
    assert bench.device_event_kind(event("Memset (Device)", activity="gpu_memset")) == "other"
    assert bench.device_event_kind(event("cudaLaunchKernel", DeviceType.CPU, "cuda_runtime")) is None
    assert bench.device_event_kind(event("Stream Sync", activity="cuda_sync")) is None
    assert bench.device_event_kind(event("softmax")) == "kernel"                  # no activity type: by device
    assert bench.device_event_kind(event("Memcpy DtoD")) == "other"
    assert bench.device_event_kind(event("aten::add", DeviceType.CPU)) is None


def test_device_event_kind_on_real_profiler_events():
    """The attributes read above exist on torch.profiler's real events (host-only here, so none is a kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(3).add_(1)
    events = list(prof.events())
    assert events and all(bench.device_event_kind(e) is None for e in events)


@needs_no_cuda
def test_launch_count_failure_is_reported_not_raised():
    counts = bench.cuda_launches(lambda: None, ())
    assert counts["launches"] is None and counts["error"]


def test_bandwidth_and_l2_copies():
    assert bench.gbps(4_300_000, 1.0) == pytest.approx(4300.0)
    assert bench.copies_beyond_l2(20 * 2**20, 50 * 2**20) == 5
    assert bench.copies_beyond_l2(200 * 2**20, 50 * 2**20) == 1


def test_compare_moe():
    want = torch.randn(6, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    verdict = bench.compare_moe(want, want.clone())
    assert verdict["ok"] and verdict["equal_fraction"] == 1.0 and verdict["all_written"]
    unwritten = want.clone()
    unwritten[3] = math.nan                                       # a row the kernels did not write
    verdict = bench.compare_moe(want, unwritten)
    assert not verdict["ok"] and not verdict["all_written"]
    off = want.clone()
    off[1, 5] += 0.1 * float(want.abs().max())                    # one element far past an ulp or two
    assert not bench.compare_moe(want, off)["ok"]


def test_moe_routing_has_exactly_the_unique_experts_asked_for():
    g = torch.Generator().manual_seed(0)
    for tokens, unique, slots in ((32, 32, 256), (32, 47, 103), (64, 47, 256), (2, 8, 8)):
        pair_slots = bench.moe_routing(tokens, unique, slots, 8, g)
        per_token = pair_slots.view(tokens, 8)
        assert pair_slots.shape == (tokens * 8,) and int(pair_slots.unique().numel()) == unique
        assert all(int(row.unique().numel()) == 8 for row in per_token)       # k distinct experts a token
        assert 0 <= int(pair_slots.min()) and int(pair_slots.max()) < slots
    with pytest.raises(ValueError):
        bench.moe_routing(2, 17, 256, 8, g)                                    # more experts than pairs


def test_cases_and_moe_tiles_arguments():
    args = bench.parse_args(["--cases", "moe", "--moe-tiles", "down_n=128,num_warps=8", "--moe-tiles", ""])
    assert args.cases == ["moe"]
    assert [(t.down_n, t.num_warps) for t in args.moe_tiles] == [(128, 8), (64, 4)]
    assert len(bench.parse_args([]).moe_tiles) == 1 and bench.parse_args([]).cases == list(bench.CASES)
    for bad in (["--cases", "gemm"], ["--moe-tiles", "down_n=48"], ["--moe-tiles", "rows=16"], ["--moe-tiles", "x"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_linear_tiles_arguments():
    """--linear-tiles adds configurations to the defaults (None), each field checked before any case runs."""
    assert bench.parse_args([]).linear_tiles == [None] and "linear" in bench.CASES
    args = bench.parse_args(["--cases", "linear", "--linear-tiles", "block_n=32,stages=3", "--linear-tiles",
                             "block_k=128"])
    assert args.linear_tiles == [None, {"block_n": 32, "stages": 3}, {"block_k": 128}]
    tiles = bench.linear_tiles(args.linear_tiles[1], 32, 2048, 2048)
    assert (tiles.block_n, tiles.stages) == (32, 3) and tiles.block_k == 256 and tiles.warps == 4
    assert bench.linear_tiles(None, 32, 2048, 2048) is None
    for bad in (["--linear-tiles", "rows=16"], ["--linear-tiles", "block_n=8"], ["--linear-tiles", "block_k"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_linear_errors_count_elements_beyond_one_ulp():
    want = torch.tensor([1.0, 3.0, -0.75, 100.0])
    assert bench.ulps(want, torch.bfloat16).tolist() == [2**-7, 2**-6, 2**-8, 2**-1]
    assert bench.ulps(torch.zeros(1), torch.bfloat16).item() == 2.0**-133          # bf16's smallest subnormal
    rounded = want.to(torch.bfloat16)
    assert bench.linear_errors(want, rounded) == {"max_abs_err": 0.0, "max_err_of_max": 0.0, "beyond_one_ulp": 0.0}
    off = rounded.clone()
    off[2] += 2 * 2**-8                                       # two ulps at 0.75
    verdict = bench.linear_errors(want, off)
    assert verdict["beyond_one_ulp"] == 0.25 and verdict["max_abs_err"] == 2**-7
    assert verdict["max_err_of_max"] == pytest.approx(2**-7 / 100)
