"""Quick CUDA-path check: llada2-mini shapes with few layers; full vs offloaded policies agree, and they run."""
import sys
import time

import oled

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
t = time.time()
llm = oled.LLM(random_weights="llada2-mini", layers=layers, policy="full")
print(f"built in {time.time() - t:.1f}s: {llm.engine.describe()}", flush=True)
ref = None
for policy, budget in [("full", "1.0"), ("lru", "0.25"), ("prefetch", "0.25"), ("tide", "0.25"), ("fiddler", "0.25")]:
    try:
        if policy == "fiddler":
            llm.engine.set_runtime("fiddler", budget, popularity=llm.engine.manager.stats.popularity())
        else:
            llm.engine.set_runtime(policy, budget)
        outs = [llm.generate("def quicksort(items):", gen_length=128) for _ in range(2)]
        o = outs[-1]
        ref = ref or o.token_ids
        agree = sum(a == b for a, b in zip(o.token_ids, ref)) / max(len(ref), 1)
        print(f"{policy:9s} {budget:5s} TPOT {o.counters['tpot_s'] * 1e3:7.2f} ms  nfe {o.counters['nfe']:4d} "
              f"TPF {o.counters['tokens_per_forward']:.2f}  agree {agree:.3f}  stats {llm.stats().get('hit_rate_tokens')}",
              flush=True)
    except Exception as e:  # report and continue: this is a smoke check
        print(f"{policy} {budget} FAILED: {type(e).__name__}: {e}", flush=True)
