"""Quick CUDA-path check on a few-layer model with LLaDA2.0-mini shapes: CUDA-graph replays of `full` give the eager
forwards' tokens, every policy kind runs (GPU-only policies must agree with `full` token for token), and segmented
graphs of offloaded forwards give the tokens of the same policy run eagerly; with mapped misses (the fused MoE
kernels reading misses from the pinned store) every policy, eager and replayed, gives `full`'s tokens.

    python benchmarks/h200_smoke.py [LAYERS] [PRESET] [quick] [fused]
`fused`: with every Triton kernel (the engine's --fused).
Exit status: 0 all good; 2 graph replays of `full` changed tokens (run later stages with --no-cuda-graphs); 1 a policy
failed; 3 segmented graphs of offloaded forwards changed tokens (run with --no-offload-graphs); 4 a policy with
mapped misses changed tokens.
"""
import sys
import time
import traceback

import oled
from oled.config import FUSED_KERNELS

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
preset = sys.argv[2] if len(sys.argv) > 2 else "llada2-mini"
QUICK = "quick" in sys.argv[3:]             # graphs only: full, and lru with segmented graphs
# "fused": every Triton kernel asked for; "plain": torch's kernels; neither: the engine's default (on with CUDA)
FUSED = dict.fromkeys(FUSED_KERNELS, True if "fused" in sys.argv[3:] else False if "plain" in sys.argv[3:] else None)
PROMPT, GEN = "def quicksort(items):", 64 if QUICK else 128
t = time.time()
llm = oled.LLM(random_weights=preset, layers=layers, policy="full", **FUSED)
print(f"built in {time.time() - t:.1f}s: {llm.engine.describe()}", flush=True)


def failed(what, e) -> int:
    """Report a failed check and go on (this is a smoke check): its exit status."""
    print(f"{what} FAILED: {type(e).__name__}: {e}", flush=True)
    traceback.print_exc()
    return 1


def run(label):
    o = [llm.generate(PROMPT, gen_length=GEN) for _ in range(2)][-1]
    print(f"{label:18s} TPOT {o.counters['tpot_s'] * 1e3:7.2f} ms  nfe {o.counters['nfe']:4d} "
          f"TPF {o.counters['tokens_per_forward']:.2f}  hit rate {llm.stats().get('hit_rate_tokens')}", flush=True)
    return o.token_ids


llm.engine.cfg.mapped_misses = False     # the host round trip's paths first; the mapped path at the end
runner = llm.engine.runner
graphs, runner.graphs = runner.graphs, None        # the reference: every forward eager
eager = run("full (eager)")
runner.graphs = graphs
status = 0
if graphs is None:
    print("no CUDA graphs (not on CUDA, or disabled)")
else:
    ref = run("full (graphs)")
    print(f"graphs: {graphs.captures} captures, {graphs.replays} replays, enabled {graphs.enabled}; "
          f"tokens {'identical to' if ref == eager else 'DIFFERENT from'} eager", flush=True)
    status = 0 if ref == eager else 2
COOP = {"misses": "cooperative"}     # lru with the planner splitting misses between loads and the CPU
POLICIES = [] if QUICK else [("lru", "0.25", {}), ("prefetch", "0.25", {}), ("tide", "0.25", {}),
                             ("fiddler", "0.25", {}), ("lru", "0.25", COOP), ("oled-retain", "0.25", {}),
                             ("oled", "0.25", {}), ("oled-coop", "0.25", {})]
SEGMENTED = [("lru", "0.25", {})] + ([] if QUICK else [("prefetch", "0.25", {}), ("tide", "0.25", {}), ("lru", "0.25", COOP),
                                                        ("oled", "0.25", {})])
for policy, budget, options in POLICIES:
    try:
        if policy == "fiddler":
            llm.engine.set_runtime("fiddler", budget, popularity=llm.engine.manager.stats.popularity())
        else:
            costs, t0 = llm.engine.costs, time.time()
            llm.engine.set_runtime(policy, budget, **options)
            if llm.engine.costs is not costs:      # the first CPU policy measures (or reads back) the cost model
                print(f"cost model ready in {time.time() - t0:.1f} s: {llm.engine.costs.describe()}", flush=True)
        toks = run(f"{policy} {budget} {' '.join(options.values())}")
        agree = sum(a == b for a, b in zip(toks, eager)) / max(len(eager), 1)
        first = next((i for i, (a, b) in enumerate(zip(toks, eager)) if a != b), None)
        print(f"{'':18s} agreement with full {agree:.3f}, first differing token {first}", flush=True)
        if policy in ("lru", "prefetch", "oled-retain") and not options and toks != eager:
            print(f"{policy}: GPU-only policy changed tokens", flush=True)
            status = status or 1
    except Exception as e:
        status = status or failed(f"{policy} {budget}", e)
# Segmented graphs of offloaded forwards (the default on CUDA): the same tokens as the same policy run eagerly.
for policy, budget, options in SEGMENTED if graphs is not None else []:
    try:
        label = f"{policy} {budget} {' '.join(options.values())}"
        llm.engine.cfg.offload_graphs = False
        llm.engine.set_runtime(policy, budget, **options)
        plain = run(f"{label} eager")
        llm.engine.cfg.offload_graphs = True
        llm.engine.set_runtime(policy, budget, **options)
        seg = run(f"{label} graphs")
        g = llm.engine.graphs
        same = seg == plain
        print(f"{'':18s} segmented graphs: {g.captures} captures, {g.replays} replays, enabled {g.enabled}; tokens "
              f"{'identical to' if same else 'DIFFERENT from'} eager", flush=True)
        if not same:
            status = status or 3
    except Exception as e:
        status = status or failed(f"{policy} {budget} with segmented graphs", e)
    finally:
        llm.engine.cfg.offload_graphs = False
# Mapped misses: no policy computes on the CPU, and a pair's bits do not depend on where its expert's weights are
# read from, so every policy gives full's tokens, eager and with graphs (one segment a forward); with capture slots
# too (the kernels write the misses into free slots as they read them: resident with no copy).
# With a CPU share (--cpu-share) the CPU computes part of each layer's misses inside the forward: its kernel rounds
# bf16 its own way, so its tokens are reported against full's, not required equal (an exception still fails).
MAPPED = [] if not llm.engine.kernels["fused_moe"] else (
    [("lru", "0.25", 0, {}, False), ("lru", "0.25", 4, {}, False)]
    + ([] if QUICK else [("oled", "0.25", 0, {}, False), ("oled", "0.25", 4, {}, False),
                         ("oled-coop", "0.4", 0, {}, False), ("oled", "0.25", 16, {}, True),
                         ("oled-coop", "0.4", 16, {}, True), ("lru", "0.4", 16, COOP, True)]))
for policy, budget, capture, options, share in MAPPED:
    try:
        llm.engine.cfg.mapped_misses, llm.engine.cfg.capture_slots = True, capture
        llm.engine.cfg.cpu_share = share
        for offload_graphs in (False, True) if graphs is not None else (False,):
            llm.engine.cfg.offload_graphs = offload_graphs
            llm.engine.set_runtime(policy, budget, **options)
            label = (f"{policy} {budget} {' '.join(options.values())} mapped{f' capture {capture}' if capture else ''}"
                     f"{' cpu-share' if share else ''}")
            toks = run(f"{label} {'graphs' if offload_graphs else 'eager'}")
            s, g = llm.stats(), llm.engine.graphs
            print(f"{'':18s} mapped pairs/iter {s.get('mapped_pairs_per_iteration', 0):.1f}, CPU pairs/iter "
                  f"{s.get('cpu_pairs_per_iteration', 0):.1f}, captured/iter "
                  f"{s.get('captured_experts_per_iteration', 0):.1f}, H2D GB/iter "
                  f"{s.get('h2d_gb_per_iteration', 0):.3f}; graphs {g.captures if g else 0} captures, "
                  f"{g.replays if g else 0} replays; tokens {'identical to' if toks == eager else 'DIFFERENT from'} "
                  f"full (agreement {sum(a == b for a, b in zip(toks, eager)) / max(len(eager), 1):.3f})", flush=True)
            if toks != eager and not share:
                status = status or 4
    except Exception as e:
        status = status or failed(f"{policy} {budget} with mapped misses (capture {capture})", e)
    finally:
        llm.engine.cfg.mapped_misses = llm.engine.cfg.offload_graphs = llm.engine.cfg.cpu_share = False
        llm.engine.cfg.capture_slots = 0
sys.exit(status)
