"""Time to first token per expert budget and prompt length, against the PCIe floor (issue: prefill under a budget).

For each budget and prompt length N: one warm-up request, then `--repeats` requests, each with another prompt of N
random ids of the vocabulary (seeded), on the cache the requests before it left, as a server's next request finds
it. Per request:
  - prefill: the prompt's forwards (GenerationResult.prefill_s);
  - TTFT: from the request's start to its first block of tokens (the first on_block call);
  - the first block's iterations and their mean time (what TTFT adds to the prefill: compute, and their own misses);
  - floor: the expert bytes that had to cross PCIe until then (each layer-forward's needed experts that were not
    resident when it ran, the stats' experts - experts_hit) over the measured pinned H2D bandwidth, for the prefill
    and for the TTFT separately.
Medians over the repeats; one JSON line per (budget, prompt length) on stdout and in --out. A PCIe floor is no
bound where little must cross (at 100 % nothing does): each line also compares with the larger of its floor and the
all-resident time for the same prompt length (the 100 % run, when --budgets starts with 1.0), `*_over_bound`, and
TTFT with the bound in series, `ttft_over_serial_bound`: the prefill's PCIe floor plus the 100 % run's first block
(TTFT - prefill), as the first block's iterations cannot start before the prefill's last layer has its experts.

    python benchmarks/ttft.py --random-weights llada2-mini --budgets 1.0,0.6,0.4,0.25 --prompt-tokens 32,512,2048
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from oled.cli.common import add_fused_args, fused_fields
from oled.config import EngineConfig
from oled.decoding.params import DecodeParams
from oled.engine import Engine
from oled.runtime.cost_model import h2d_gbps


def prompt_ids(engine: Engine, tokens: int, seed: int) -> list[int]:
    """`tokens` random ids of the vocabulary, none of them a special token."""
    c = engine.config
    special = {c.mask_token_id, c.eos_token_id}
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, c.vocab_size, size=2 * tokens + 8) if int(i) not in special]
    return ids[:tokens]


def missed_bytes(records, expert_bytes: int) -> int:
    """Bytes of the experts that had to cross: per layer-forward, the needed experts not resident when it ran."""
    return sum((r.experts - r.experts_hit) * expert_bytes for r in records)


def one_request(engine: Engine, ids: list[int], params: DecodeParams, gbps: float) -> dict:
    stats = engine.manager.stats
    stats.reset()
    first = {}
    t0 = time.perf_counter()

    def on_block(new, finished):
        if not first:
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            first["s"], first["records"] = time.perf_counter() - t0, len(stats.records)

    res = engine.generate_ids(ids, params, on_block=on_block)
    prefill = [r for r in stats.records if r.kind == "prefill"]
    upto_first = stats.records[:first.get("records", len(stats.records))]
    eb = engine.store.expert_bytes
    floor = lambda records: missed_bytes(records, eb) / (gbps * 1e9) if gbps == gbps else float("nan")  # noqa: E731
    return {"prefill_s": res.prefill_s, "ttft_s": first.get("s", float("nan")),
            # the first block's denoising iterations and their mean wall time (TTFT - prefill over them)
            "first_block_iterations": res.iterations_per_block[0] if res.iterations_per_block else 0,
            "first_block_ms_per_iteration": ((first.get("s", float("nan")) - res.prefill_s) * 1e3
                                             / max(res.iterations_per_block[0] if res.iterations_per_block else 1, 1)),
            "prefill_floor_s": floor(prefill), "ttft_floor_s": floor(upto_first),
            "prefill_missed_bytes": missed_bytes(prefill, eb), "ttft_missed_bytes": missed_bytes(upto_first, eb)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-weights", default="llada2-mini")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--device")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--budgets", default="1.0,0.6,0.4,0.25")
    ap.add_argument("--prompt-tokens", default="32,512,2048")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--expert-dtype", default="bf16", help="bf16 or fp8 (the engine's --expert-dtype)")
    add_fused_args(ap)                        # the engine's --[no-]fused flags, its default where none is given
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    kernels = fused_fields(args)
    engine = Engine(EngineConfig(random_weights=args.random_weights, layers=args.layers, device=args.device,
                                 policy="full", expert_dtype=args.expert_dtype, **kernels))
    gbps = h2d_gbps(engine.store, engine.device) if engine.device.type == "cuda" else float("nan")
    params = DecodeParams(gen_length=args.block_length, block_length=args.block_length)
    out = open(args.out, "w") if args.out else None
    resident: dict[int, dict] = {}          # prompt tokens -> the 100 % run's medians
    try:
        for budget in args.budgets.split(","):
            engine.set_runtime(args.policy, budget)
            for tokens in (int(t) for t in args.prompt_tokens.split(",")):
                runs = []
                for i in range(args.repeats + 1):              # the first is the warm-up
                    ids = prompt_ids(engine, tokens, seed=1000 * tokens + i)
                    run = one_request(engine, ids, params, gbps)
                    if i:
                        runs.append(run)
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                if float(budget) == 1.0:
                    resident[tokens] = med
                over_bound = {}
                if tokens in resident:
                    floors = {part: med[f"{part}_floor_s"] if med[f"{part}_floor_s"] == med[f"{part}_floor_s"]
                              else 0.0 for part in ("prefill", "ttft")}         # NaN without a GPU: no floor
                    for part in ("prefill", "ttft"):
                        bound = max(floors[part], resident[tokens][f"{part}_s"])
                        over_bound[f"{part}_bound_s"] = bound
                        over_bound[f"{part}_over_bound"] = med[f"{part}_s"] / bound
                    # the first block cannot start before the prefill ends, nor that before the prefill's bytes
                    # crossed, nor run faster than with every expert resident: a bound on TTFT in series
                    first_block = resident[tokens]["ttft_s"] - resident[tokens]["prefill_s"]
                    serial = max(over_bound["ttft_bound_s"], floors["prefill"] + first_block)
                    over_bound["ttft_serial_bound_s"] = serial
                    over_bound["ttft_over_serial_bound"] = med["ttft_s"] / serial
                record = {"bench": "ttft", "model": engine.model_name, "policy": args.policy, "budget": budget,
                          "prompt_tokens": len(ids), "h2d_gbps": gbps, "repeats": args.repeats,
                          "expert_dtype": args.expert_dtype,
                          "kernels": [k for k, on in engine.kernels.items() if on], **med,
                          "prefill_over_floor": med["prefill_s"] / med["prefill_floor_s"]
                          if med["prefill_floor_s"] > 0 else None,
                          "ttft_over_floor": med["ttft_s"] / med["ttft_floor_s"] if med["ttft_floor_s"] > 0 else None,
                          **over_bound}
                line = json.dumps(record)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
    finally:
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
