"""The metrics a benchmark line reports (docs/DESIGN.md, Metrics), their definitions, and the aggregation over repeats."""
from __future__ import annotations

import statistics

# key: (short label, unit, definition). Every result line has every key (None where a mode cannot measure it).
METRICS: dict[str, tuple[str, str, str]] = {
    "tpot_ms": ("TPOT", "ms", "decode wall time (prefill excluded) / generated tokens up to and including EOS, "
                              "summed over the workload's prompts"),
    "tokens_per_s": ("tokens/s", "tok/s", "generated tokens / decode wall time"),
    "prefill_ms": ("prefill", "ms", "prompt prefill wall time, mean per prompt"),
    "ms_per_forward": ("ms/forward", "ms", "decode wall time / denoising forwards: the cost of a forward, comparable "
                                          "between runs that decode different sequences (another NFE)"),
    "nfe": ("NFE", "", "denoising forwards (network function evaluations) over the workload"),
    "tpf": ("TPF", "tok/fwd", "tokens committed per denoising forward"),
    "iterations_per_block": ("iters/block", "", "denoising iterations per block, mean"),
    "generated_tokens": ("tokens", "", "generated tokens over the workload (EOS included)"),
    "hit_rate_tokens": ("hit rate (tokens)", "", "token-expert pairs served by experts already resident when the "
                                                 "layer ran / all pairs (denoising iterations)"),
    "hit_rate_experts": ("hit rate (experts)", "", "needed experts already resident when the layer ran / needed "
                                                   "experts"),
    "cache_utilization": ("cache utilisation", "", "resident experts used by at least one token in the iteration / "
                                                   "resident experts, averaged over layers and iterations"),
    "misses_per_iteration": ("misses/iter", "", "needed experts not resident when their MoE layer ran, summed over the "
                                                "MoE layers, per denoising iteration (expert-weighted misses); bound "
                                                "rows: their schedule's"),
    "used_before_evicted": ("used before evicted", "", "experts loaded (demand loads + prefetches) that a later "
                                                       "layer run found resident and needed before their slot was "
                                                       "given up / experts loaded (bytes alike: every expert has "
                                                       "the same size)"),
    "hits_per_loaded_expert": ("hits per loaded expert", "", "token-expert pairs served by resident experts / "
                                                             "experts copied to the GPU (demand loads + prefetches)"),
    "h2d_gb_per_iteration": ("H2D GB/iter", "GB", "bytes of experts copied host-to-device per denoising iteration"),
    "cpu_pairs_per_iteration": ("CPU pairs/iter", "", "token-expert pairs computed on the CPU per iteration"),
    "cpu_ms_per_iteration": ("CPU ms/iter", "ms", "wall time of the CPU expert jobs per denoising iteration"),
    "mapped_pairs_per_iteration": ("mapped pairs/iter", "", "token-expert pairs the GPU computed from the expert's "
                                                           "blob in host memory (mapped misses) per iteration"),
    "mapped_gb_per_iteration": ("mapped GB/iter", "GB", "bytes of experts the GPU read from host memory over PCIe "
                                                       "per denoising iteration (mapped misses)"),
    "captured_experts_per_iteration": ("captured/iter", "", "mapped misses the kernels wrote into a slot as they "
                                                            "read them (resident with no copy) per iteration"),
    "cpu_cost_model_ratio": ("CPU cost model / measured", "", "the CPU jobs' time as the runtime's cost model "
                                                              "predicts it (calibrated at start-up per tokens per "
                                                              "expert, slowed while copies run) / their measured "
                                                              "time"),
    "cpu_path_cost_model_ratio": ("CPU cost model / CPU path", "", "the CPU jobs' time as the start-up cost model "
                                                                  "predicts it / their time from submission to "
                                                                  "result (the workers' wake-up included); "
                                                                  "the planner's CPU terms follow its inverse "
                                                                  "(--cpu-cost-feedback)"),
    "loads_per_iteration": ("loads/iter", "", "experts copied to the GPU on demand per iteration (all layers)"),
    "prefetches_per_iteration": ("prefetches/iter", "", "speculative expert copies per iteration (all layers)"),
    "unique_experts_per_layer_iteration": ("unique experts/layer/iter", "", "distinct experts a layer needs in one "
                                                                            "iteration, mean"),
    "token_agreement": ("token agreement", "", "fraction of output positions equal to the reference (`full`) run's "
                                               "tokens for the same prompt (length differences count as mismatches)"),
    "identical_outputs": ("identical outputs", "", "fraction of prompts whose output equals the reference exactly"),
}


def aggregate(values: list) -> dict:
    """Median and spread (min, max, max - min) over repeats; None when the metric was not measured."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "spread": None, "values": list(values)}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "spread": max(vals) - min(vals),
            "values": list(values)}


def agreement(outputs: list[list[int]], reference: list[list[int]] | None) -> tuple[float | None, float | None]:
    if reference is None:
        return None, None
    equal = total = same = 0
    for out, ref in zip(outputs, reference):
        n = max(len(out), len(ref))
        equal += sum(1 for a, b in zip(out, ref) if a == b)
        total += n
        same += out == ref
    return (equal / total if total else 1.0), same / max(len(outputs), 1)


def repeat_metrics(results, summary: dict, reference) -> dict:
    """One repeat over a workload: results are the GenerationResults of its prompts, summary RunStats.summary()."""
    gen = sum(len(r.token_ids) for r in results)
    dec = sum(r.decode_s for r in results)
    nfe = sum(r.nfe for r in results)
    blocks = [n for r in results for n in r.iterations_per_block]
    agree, identical = agreement([r.token_ids for r in results], reference)
    m = {
        "tpot_ms": dec / max(gen, 1) * 1e3,
        "tokens_per_s": gen / dec if dec > 0 else None,
        "prefill_ms": sum(r.prefill_s for r in results) / max(len(results), 1) * 1e3,
        "nfe": nfe,
        "ms_per_forward": dec / nfe * 1e3 if nfe else None,
        "tpf": sum(r.committed for r in results) / max(nfe, 1),
        "iterations_per_block": sum(blocks) / len(blocks) if blocks else None,
        "generated_tokens": gen,
        "token_agreement": agree,
        "identical_outputs": identical,
    }
    m.update(stats_metrics(summary))
    return m


# run-statistics summary values a result line carries as they are (stats.Aggregate.summary)
SUMMARY_METRICS = ("hit_rate_tokens", "hit_rate_experts", "cache_utilization", "h2d_gb_per_iteration",
                   "cpu_pairs_per_iteration", "cpu_ms_per_iteration", "mapped_pairs_per_iteration",
                   "mapped_gb_per_iteration", "captured_experts_per_iteration", "cpu_cost_model_ratio",
                   "cpu_path_cost_model_ratio", "loads_per_iteration", "unique_experts_per_layer_iteration",
                   "misses_per_iteration", "used_before_evicted")


def stats_metrics(summary: dict) -> dict:
    tot = summary.get("totals", {})
    forwards = max(summary.get("forwards", 0), 1)
    metrics = {k: summary.get(k) for k in SUMMARY_METRICS}
    metrics["hits_per_loaded_expert"] = (summary.get("hits_per_loaded_expert")      # undefined without any load
                                         if tot.get("loads", 0) + tot.get("prefetches", 0) else None)
    metrics["prefetches_per_iteration"] = tot.get("prefetches", 0) / forwards if tot else None
    return metrics
