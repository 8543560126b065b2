"""`fiddler`: static placement of the most popular experts, every miss computed on the CPU (Fiddler-style).

Popularity comes from a calibration run (`oled calibrate`), stored as data: a JSON file
  {"layers": {"<layer>": {"<expert>": tokens, ...}, ...}, "provenance": {"model": ..., "prompts": ..., ...}}
Each MoE layer gets its `capacity` most popular experts (ties: lower expert id) before the first forward; nothing is
ever loaded or evicted afterwards, and every miss runs on the CPU (only activations cross PCIe).
"""
from __future__ import annotations

from pathlib import Path

from .base import LayerDecision, Policy, read_json

CALIBRATE_HINT = ("run `oled calibrate --model DIR (or --random-weights PRESET) --prompt TEXT --out popularity.json` "
                  "and pass --popularity popularity.json")


def parse_popularity(data) -> dict[int, dict[int, int]]:
    """{"layers": {layer: {expert: tokens}}, ...} or a bare {layer: {expert: tokens}} (RunStats.popularity()) ->
    {int layer: {int expert: int tokens}}."""
    if not isinstance(data, dict):
        raise ValueError(f"expert popularity: expected a JSON object, got {type(data).__name__}")
    layers = data["layers"] if "layers" in data else data
    if not isinstance(layers, dict) or not layers:
        raise ValueError("expert popularity has no layers")
    out: dict[int, dict[int, int]] = {}
    try:
        for layer, experts in layers.items():
            if not isinstance(experts, dict):
                raise TypeError(f"layer {layer}: expected an object expert -> tokens")
            out[int(layer)] = {int(e): int(n) for e, n in experts.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"expert popularity: malformed data ({e})") from None
    return out


def load_popularity(source) -> tuple[dict[int, dict[int, int]], dict]:
    """A path to a popularity JSON file, or the data itself (a dict). Returns (popularity, provenance)."""
    if isinstance(source, (str, Path)):
        data = read_json(source, "expert popularity", f"; {CALIBRATE_HINT}")
    else:
        data = source
    pop = parse_popularity(data)
    provenance = data.get("provenance", {}) if isinstance(data, dict) and "layers" in data else {}
    return pop, provenance


def popularity_document(popularity: dict[int, dict[int, int]], provenance: dict) -> dict:
    """The JSON document `oled calibrate` writes (keys as strings, experts by decreasing tokens)."""
    layers = {str(layer): {str(e): int(n) for e, n in sorted(experts.items(), key=lambda kv: (-kv[1], kv[0]))}
              for layer, experts in sorted(popularity.items())}
    return {"layers": layers, "provenance": provenance}


class FiddlerPolicy(Policy):
    name = "fiddler"
    uses_cpu = True
    loads_misses = False
    options = ("popularity",)

    def __init__(self, popularity=None):
        if popularity is None:
            raise ValueError(f"policy 'fiddler' places the most popular experts and needs their popularity from a "
                             f"calibration run: {CALIBRATE_HINT}")
        self.popularity, self.provenance = load_popularity(popularity)

    def setup(self, ctx):
        super().setup(ctx)
        missing = [layer for layer in ctx.layers if layer not in self.popularity]
        if missing:
            raise ValueError(f"expert popularity has no data for MoE layer(s) {missing} (it has layers "
                             f"{sorted(self.popularity)}): it was calibrated on another model; {CALIBRATE_HINT}")
        bad = sorted({e for layer in ctx.layers for e in self.popularity[layer] if not 0 <= e < ctx.num_experts})
        if bad:
            raise ValueError(f"expert popularity names experts {bad[:8]} but the model has {ctx.num_experts} per "
                             f"layer: it was calibrated on another model; {CALIBRATE_HINT}")

    def ranking(self, layer: int) -> list[int]:
        """Every expert of the layer, most popular first (ties and never-seen experts: lower id first)."""
        pop = self.popularity[layer]
        return sorted(range(self.ctx.num_experts), key=lambda e: (-pop.get(e, 0), e))

    def initial_placement(self, layer):
        return self.ranking(layer)[: self.ctx.capacity]

    def decide(self, event):
        return LayerDecision(cpu=event.misses)      # nothing is ever loaded, so nothing is evicted
