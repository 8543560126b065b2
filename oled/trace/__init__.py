"""Routing traces: record (oled trace), analyse locality, replay through any policy on the CPU (oled bench --replay).

    from oled.trace import record_trace, Trace, replay, locality
    trace, results = record_trace(engine, [("p0", ids)], DecodeParams(gen_length=64))
    trace.save("run.trace"); trace = Trace.load("run.trace")
    print(format_locality(locality(trace)))
    stats = replay(trace, "lru", "0.5").stats.summary()
"""
from __future__ import annotations

from ..env import environment, now
from .format import KINDS, Trace
from .locality import format_locality, locality
from .recorder import TraceRecorder, record
from .replay import ReplayManager, replay


def trace_header(engine, params, workload: dict | None = None) -> dict:
    """Model shapes, engine and decoding settings, environment: the header of a trace recorded on `engine`."""
    config = engine.config
    decode = {k: v for k, v in vars(params).items() if k != "stop"}
    decode["block_length"] = params.block_length or config.block_length
    return {
        "model": {"name": engine.model_name, "model_type": config.model_type, "num_layers": config.num_layers,
                  "moe_layers": list(config.moe_layers), "num_experts": config.num_experts, "top_k": config.top_k,
                  "vocab_size": config.vocab_size, "mask_token_id": config.mask_token_id,
                  "eos_token_id": config.eos_token_id, "block_causal": config.block_causal,
                  "expert_bytes": engine.store.expert_bytes, "random_weights": engine.cfg.random_weights,
                  "seed": engine.cfg.seed if engine.cfg.random_weights else None,
                  "dtype": str(engine.dtype).replace("torch.", "")},
        "engine": engine.cfg.to_dict(),
        "decode": decode,
        "workload": workload,
        "env": environment(engine.device),
        "date": now(),
    }


def record_trace(engine, prompts, params, *, workload: dict | None = None, predictions: bool = True,
                 on_prompt=None):
    """Record prompts [(id, token ids)] on `engine` (its current policy and budget). The live run's statistics go
    into the header ("live") so a replay through the same policy and budget can be checked against them."""
    engine.manager.stats.reset()
    rec, results = record(engine, prompts, params, predictions=predictions, on_prompt=on_prompt)
    header = trace_header(engine, params, workload)
    stats = engine.manager.stats
    if engine.manager.costs is not None:    # a replay plans CPU misses on the recording machine's costs
        header["costs"] = engine.manager.costs.to_dict()
    header["live"] = {"policy": engine.policy.name, "misses": getattr(engine.policy, "misses", None),
                      "expert_budget": f"{engine.budget.bytes}b",
                      "budget_fraction": engine.budget.fraction, "slots_per_layer": engine.budget.slots_per_layer,
                      # mapped misses: the kernels' block of pairs (Residency.mapped_rows); 0: off
                      "mapped_rows": engine.manager.residency.mapped_rows if engine.manager.mapped else 0,
                      # and the free slots a layer keeps for captured misses (Residency.capture_slots)
                      "capture_slots": engine.manager.residency.capture_slots if engine.manager.mapped else 0,
                      # and whether its layers gave the CPU a share of those misses (runtime/cpu_share.py)
                      "cpu_share": engine.manager.cpu_share,
                      "totals": stats.summary(kinds=KINDS).get("totals", {}),
                      "summary": {k: v for k, v in stats.summary().items() if k != "totals"}}
    return rec.to_trace(header), results


__all__ = ["Trace", "TraceRecorder", "ReplayManager", "record", "record_trace", "replay", "locality",
           "format_locality", "trace_header", "KINDS"]
