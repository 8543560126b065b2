"""Host cost of each policy's step per MoE layer (`Residency.begin_layer`: the event, the policy's decision and its
checks), replayed from a trace on the CPU: the decisions the engine makes, without the engine.

    python benchmarks/policy_step_cost.py TRACE COST_MODEL_RESULTS.jsonl [--budget 0.4] [--requests 1]
        [--policies lru,oled-retain,oled] [--polling-workers] [--mapped [--capture-slots N]]

The cost model is the first one found in the results file (a bench run's result lines). Each policy's decisions are
printed too (per denoising iteration: layers with CPU work, CPU experts and pairs, loads). --polling-workers keeps the
CPU expert kernel's workers (the engine's default number, pinned as the engine pins them) polling through the
replays, as `--cpu-wake layer` does around a layer's host step: whether they slow the main thread's Python.
--mapped replays the mapped path (mapped misses with the default tiles, as the engine on CUDA) and times its whole
host step per layer behind the GPU (`Residency.decide_mapped`: the event, the decision, the loads' slots, with
--capture-slots the captured experts and the freed slots). Each policy's line also gives the host's steps once per
forward, µs a forward: the policy's iteration event (on_iteration: the reuse predictor's update for oled), the
forward's start (begin_forward) and, with --capture-slots, the capture table's arming (arm_capture).
"""
import argparse
import time

from oled.runtime import planner
from oled.runtime.cost_model import CostModel
from oled.kernels.triton_moe import mapped_rows
from oled.runtime.residency import Residency
from oled.trace import Trace
from oled.trace.replay import replay_manager


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("results")
    ap.add_argument("--budget", default="0.4")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--policies", default="lru,oled-retain,oled")
    ap.add_argument("--polling-workers", action="store_true")
    ap.add_argument("--mapped", action="store_true", help="the mapped path's host step (decide_mapped)")
    ap.add_argument("--capture-slots", type=int, default=0)
    args = ap.parse_args()
    kernel = None
    if args.polling_workers:
        from oled.runtime.cpu_kernel import CpuExpertKernel
        from oled.runtime.threads import plan_threads

        kernel = CpuExpertKernel(num_threads=plan_threads().kernel_threads)
        kernel.hold(3600.0)
        print(f"{kernel.num_threads} CPU expert workers ({kernel.name}) polling on cpus {sorted(kernel.cpus)}")
    costs = CostModel.from_file(args.results)
    trace = Trace.load(args.trace).first_requests(args.requests)
    step = "decide_mapped" if args.mapped else "begin_layer"
    inner = getattr(Residency, step)
    spent = [0.0, 0]

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return inner(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
    setattr(Residency, step, timed)
    plans = [0, 0]                         # layers the planner was asked about, and those it searched
    split, candidates = planner.split_misses, planner._candidates

    def counted_split(*a, **k):
        plans[0] += 1
        return split(*a, **k)

    def counted_candidates(*a, **k):
        plans[1] += 1
        return candidates(*a, **k)
    planner.split_misses, planner._candidates = counted_split, counted_candidates
    import oled.policies.base as policy_base
    policy_base.split_misses = counted_split
    for policy in args.policies.split(","):
        best, once = float("inf"), {}
        for _ in range(3):                 # the least of 3 replays: other work only adds time
            spent[:] = [0.0, 0]
            plans[:] = [0, 0]
            mgr = replay_manager(trace, policy, args.budget, costs, mapped_rows=mapped_rows(args.mapped),
                                 capture_slots=args.capture_slots)
            per_forward = {name: _timed(owner, name) for owner, name in (
                (mgr.policy, "on_iteration"), (mgr.residency, "begin_forward"), (mgr.residency, "arm_capture"))}
            mgr.replay()
            rows = [r for r in mgr.stats.records if r.kind == "iteration"]
            best = min(best, spent[0] / max(spent[1], 1))
            forwards = max(len({r.forward for r in mgr.stats.records}), 1)
            once = {name: min(once.get(name, float("inf")), t[0] / forwards) for name, t in per_forward.items()}
        its = max(len({r.forward for r in rows}), 1)
        per_it = {what: sum(map(count, rows)) / its for what, count in (
            ("CPU layers", lambda r: r.pairs_cpu > 0), ("CPU experts", lambda r: r.experts_cpu),
            ("CPU pairs", lambda r: r.pairs_cpu), ("loads", lambda r: r.loads))}
        print(f"{policy:12s} at {args.budget}: {best * 1e6:6.1f} µs per MoE layer's {step} ({spent[1]} layers); "
              "per iteration: "
              + ", ".join(f"{v:.2f} {what}" for what, v in per_it.items())
              + (f"; planner: {plans[0]} layers with misses, {plans[1]} searched" if plans[0] else "")
              + "; per forward: " + ", ".join(f"{name} {t * 1e6:.1f} µs" for name, t in once.items()))
    if kernel is not None:
        kernel.hold(0.0)


def _timed(owner, name: str) -> list[float]:
    """Time owner.name (an instance's method) from now on; returns the running total [seconds]."""
    inner, total = getattr(owner, name), [0.0]

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            total[0] += time.perf_counter() - t0
    setattr(owner, name, timed)
    return total


if __name__ == "__main__":
    main()
