"""Where the offloaded forward's time goes per MoE layer, against the all-resident forward (H200).

For each POLICY@BUDGET: one warm-up generate, a plain timed one (the wall figures), one with perf_counter around the
manager's host steps (reading the routing back, which includes waiting for its read-back; the residency's decisions;
the waves' copies and stream waits, the device slot map's rows, the pinned staging buffers, the layer events, a graph
segment's launch; nested: a step's time includes those inside it), then each one-segment graph it captured replayed
alone on an idle GPU (the host's launch time against the graph's work). Only once every run is timed, per run one
generate under torch.profiler for GPU kernel time, launches and the kernels that take the most GPU time: CUPTI stays
attached after a profiler session and slows every launch after it (up to 86af7c5 the runs after the first were timed
after the first one's profile). Each run's floor: the weight bytes its iterations touch (the unique experts the timed
generate routed to, plus every non-expert weight) over the measured device-copy bandwidth.

A run POLICY@BUDGET takes the engine's default path for a denoising iteration's misses (EngineConfig.mapped_misses
None: the mapped path where the fused MoE kernels run); POLICY@BUDGET+mapped forces the mapped path (misses read
from the pinned store inside the forward), POLICY@BUDGET+host the host round trip; a further +captureN sets
EngineConfig.capture_slots to N (default: the engine's). (Up to 0a1c7fd a run without a suffix took the host round
trip.)

    python benchmarks/offload_overhead.py [--runs full@1.0,lru@1.0,lru@0.4,lru@0.4+mapped]
        [--fused | --no-fused | --[no-]fused-router ...]
        [--workload code --gen-length 256] [--top 25] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from oled.bench.floor import measure_hbm_bandwidth, weight_bytes_per_iteration
from oled.cli.common import add_fused_args, fused_fields
from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostClock:
    """Seconds spent inside wrapped callables, by name (the wrapped object keeps working as before)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.wrapped: list[tuple] = []

    def restore(self) -> None:
        """Put back what wrap() replaced (a class's method stays wrapped otherwise, run after run)."""
        for obj, attr, inner in reversed(self.wrapped):
            if isinstance(obj, type):
                setattr(obj, attr, inner)
            else:
                delattr(obj, attr)          # the instance's attribute shadowed its class's
        self.wrapped.clear()

    def wrap(self, obj, attr: str, name: str):
        inner = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
        self.wrapped.append((obj, attr, inner))

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.calls[name] += 1
        setattr(obj, attr, timed)


def replay_alone(engine: Engine, repeats: int = 20) -> list[dict]:
    """Each one-segment graph the run captured (all-resident and mapped forwards), replayed on an idle GPU: the host's
    time in replay() and launch to done, medians. Its output is discarded (it rewrites its forward's K/V rows and
    routing buffers, and on the mapped path may capture into armed slots): the engine's state after this is not
    used again by this run."""
    if engine.graphs is None:
        return []
    out = []
    for key, fwd in engine.graphs.graphs.items():
        if len(fwd.segments) != 1:
            continue
        launch, done = [], []
        for i in range(repeats + 2):
            sync()
            t0 = time.perf_counter()
            fwd.segments[0].replay()
            t1 = time.perf_counter()
            sync()
            if i >= 2:
                launch.append((t1 - t0) * 1e6)
                done.append((time.perf_counter() - t0) * 1e6)
        out.append({"tokens": key[0], "mapped": bool(key[-1]), "launch_us": statistics.median(launch),
                    "launch_to_done_us": statistics.median(done)})
    return out


def measure(engine: Engine, prompt_ids, params, label: str, hbm_gbps: float) -> dict:
    """The run's times, with no profiler having run in the process (CUPTI stays attached after a torch.profiler
    session and slows every launch that follows, pytorch/pytorch#144455; profile() runs after every measure()): a
    warm-up generate (graph captures), a plain timed one (the wall figures), one with the host steps wrapped, then
    the captured graphs replayed alone."""
    engine.generate_ids(prompt_ids, params)                 # warm-up: graph captures
    sync()
    m = engine.manager
    m.stats.reset()
    t0 = time.perf_counter()
    res = engine.generate_ids(prompt_ids, params)
    sync()
    wall = time.perf_counter() - t0
    unique = m.stats.summary()["unique_experts_per_layer_iteration"]
    clock = HostClock()
    clock.wrap(m.round_trip, "decide", "decide_offloaded (host step one)")
    clock.wrap(m.round_trip, "finish", "end_offloaded (host step two)")
    if m.mapped_path is not None:
        clock.wrap(m.mapped_path, "decide", "decide_mapped (the mapped path's host step, behind the forward)")
        clock.wrap(m.mapped_path, "read_routing", "read_routing (waits for the read-back)")
    clock.wrap(m.slots, "settle", "settle_slots (mapped: copies waited, slot map rewritten)")
    clock.wrap(m.round_trip, "read_routing", "read_routing (waits for the read-back)")
    clock.wrap(m.residency, "begin_layer", "residency.begin_layer (policy)")
    # between forwards: what the host does before a launch (the GPU may wait on it) and behind it
    clock.wrap(m, "begin_forward", "begin_forward (before the launch: slots settled, path, capture table)")
    clock.wrap(m, "launched", "launched (the bookkeeping deferred behind the launch)")
    clock.wrap(m.residency, "arm_capture", "residency.arm_capture")
    clock.wrap(m.policy, "on_iteration", "policy.on_iteration")
    clock.wrap(m.round_trip, "issue_wave", "issue_wave")
    # inside the two host steps: what is left of them beside the read-back, the policy and the waves
    clock.wrap(m.slots, "copy", "copy (H2D copies issued)")
    clock.wrap(m.slots, "wait_copies", "wait_copies (stream waits on copy events)")
    clock.wrap(m.slots, "sync", "sync_slot_map (device slot map rows)")
    clock.wrap(m.slots, "mark_layer_done", "mark_layer_done (layer events)")
    clock.wrap(m.residency, "prefetch", "residency.prefetch")
    clock.wrap(m.residency, "end_layer", "residency.end_layer")
    clock.wrap(m.staging, "host", "staging (pinned host buffers)")
    if engine.graphs is not None:       # a segment's replay: one launch, so this is the host's cost of launching it
        from oled.decoding.graphs import _CudaSegment
        clock.wrap(_CudaSegment, "replay", "graph segment replay (launch)")
    t0 = time.perf_counter()
    wrapped = engine.generate_ids(prompt_ids, params)
    sync()
    wrapped_wall = time.perf_counter() - t0
    clock.restore()
    nfe = res.nfe
    floor_ms = weight_bytes_per_iteration(engine, unique, params.block_length) / (hbm_gbps * 1e9) * 1e3
    out = {"run": label, "nfe": nfe, "cache_forwards": res.cache_forwards, "tokens": len(res.token_ids),
           "token_ids": res.token_ids,
           "wall_ms_per_forward": wall / nfe * 1e3,
           # the denoising forwards alone (the figures around it divide the whole generate, prefill included)
           "decode_wall_ms_per_forward": res.decode_s / nfe * 1e3, "prefill_ms": res.prefill_s * 1e3,
           "unique_experts_per_layer_iteration": unique, "floor_ms_per_forward": floor_ms,
           "wall_over_floor": wall / nfe * 1e3 / floor_ms if floor_ms == floor_ms else None,
           # the generate with the host steps wrapped (its wall beside the plain one: the timers' own cost)
           "wrapped_wall_ms_per_forward": wrapped_wall / wrapped.nfe * 1e3,
           "wrapped_same_tokens": wrapped.token_ids == res.token_ids, "wrapped_nfe": wrapped.nfe,
           "host_ms_per_forward": {k: v / wrapped.nfe * 1e3 for k, v in clock.total.items()},
           "calls_per_forward": {k: v / wrapped.nfe for k, v in clock.calls.items()},
           # last: it leaves the engine's K/V and slots as no forward would (replay_alone)
           "graph_replay_alone": replay_alone(engine)}
    return out


def profile_kernels(engine: Engine, prompt_ids, params, nfe: int, top: int) -> dict:
    """One warm-up generate and one under torch.profiler: GPU kernel time, launches, copies, the kernels that take
    the most GPU time, over the run's denoising forwards (its kernels: prefill and cache fills too)."""
    kernels = []
    if torch.cuda.is_available():
        engine.generate_ids(prompt_ids, params)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate_ids(prompt_ids, params)
            sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    computed = [e for e in kernels if "Memcpy" not in e.name and "Memset" not in e.name]
    gpu_us = sum(e.device_time for e in computed)
    copies_us = sum(e.device_time for e in kernels if "Memcpy" in e.name)   # read-backs, slot-map rows, loads
    by_name = defaultdict(lambda: [0.0, 0])
    for e in computed:
        by_name[e.name][0] += e.device_time
        by_name[e.name][1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_kernel_ms_per_forward": gpu_us / nfe / 1e3, "kernels_per_forward": len(kernels) / nfe,
            "memcpy_ms_per_forward": copies_us / nfe / 1e3,
            "top_kernels_us_per_forward": [{"kernel": name[:90], "us": us / nfe, "launches": n / nfe}
                                           for name, (us, n) in ranked]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="full@1.0,lru@1.0,lru@0.4,oled@0.4")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--layers", type=int, default=None)
    add_fused_args(ap)                        # the engine's --[no-]fused flags, its default where none is given
    ap.add_argument("--workload", default=None,
                    help="decode the first prompt of this workload (the default grid's is code, with "
                         "--gen-length 256); default: one short prompt")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by GPU time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(random_weights=args.preset, layers=args.layers, policy="full", expert_budget="1.0",
                                 **fused_fields(args)))
    hbm_gbps = measure_hbm_bandwidth(engine.device)
    params = DecodeParams(gen_length=args.gen_length, block_length=32, threshold=0.95)
    if args.workload:
        from oled.bench.workloads import load
        prompt_ids = load(args.workload, engine.tokenizer, limit=1).prompts[0].ids(engine.tokenizer)
    else:
        prompt_ids = engine.tokenizer.encode("def quicksort(items):")
    runs = []
    for run in args.runs.split(","):
        spec, *suffixes = run.split("+")
        paths = [x for x in suffixes if x in ("mapped", "host")]
        captures = [x for x in suffixes if re.fullmatch(r"capture\d+", x)]
        if len(paths) > 1 or len(captures) > 1 or len(paths) + len(captures) != len(suffixes) or "@" not in spec:
            ap.error(f"--runs: {run!r}: a run is POLICY@BUDGET, optionally +mapped or +host, optionally +captureN")
        policy, budget = spec.split("@")
        runs.append((run, policy, budget, {"mapped": True, "host": False}.get(paths[0]) if paths else None,
                     int(captures[0][len("capture"):]) if captures else EngineConfig.capture_slots))

    def set_run(policy, budget, mapped, capture):
        engine.cfg.mapped_misses, engine.cfg.capture_slots = mapped, capture
        engine.set_runtime(policy, budget)

    results = []
    for run, *setting in runs:                  # every timed run before the first profiler session
        set_run(*setting)
        results.append(measure(engine, prompt_ids, params, run, hbm_gbps))
    for (run, *setting), out in zip(runs, results):
        set_run(*setting)
        out.update(profile_kernels(engine, prompt_ids, params, out["nfe"], args.top))
        print(json.dumps(out, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
