"""The real model's published figures a trace's statistics are judged against (`oled trace --report`), in one place.

Each entry: the statistic's key in oled/trace/realism.py, the published value (low, high) — equal for a point value,
high None for "above low" —, the model and setting it was measured at, and its source.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    key: str            # the statistic (realism.STATISTICS)
    low: float
    high: float | None  # None: "above low"
    model: str
    setting: str
    source: str

    def text(self, fmt: str = "{:.3g}") -> str:
        if self.high is None:
            return ">" + fmt.format(self.low)
        if self.high == self.low:
            return fmt.format(self.low)
        return f"{fmt.format(self.low)}-{fmt.format(self.high)}"


DMOE = "dMoE, arXiv 2605.30876"
CAP_CARD = "LLaDA2.0-mini-CAP model card"
TIDE = "TIDE, arXiv 2605.20179"

PUBLISHED = (
    Published("unique_experts", 69.5, 69.5, "LLaDA2.0-mini", "block 32, threshold 0.95; mean of MATH500 70.0, GSM8K "
              "71.5, ARC-C 65.9, MMLU 70.6 (official code)", DMOE),
    Published("unique_cv_layer10", 0.16, 0.18, "LLaDA2.0-mini", "layer 10, block 32, threshold 0.95: standard "
              "deviation about 12 step to step", DMOE),
    Published("tokens_per_forward", 2.55, 2.55, "LLaDA2.0-mini", "mean over 12 benchmarks", CAP_CARD),
    Published("tokens_per_forward", 3.19, 3.19, "LLaDA2.0-flash", "mean over 12 benchmarks", CAP_CARD),
    Published("cosine_1_all", 0.985, 0.985, "LLaDA2.0-mini", "over all recomputed rows, prefix included, no KV "
              "cache", TIDE),
    Published("cosine_5_all", 0.95, None, "LLaDA2.0-mini", "over all recomputed rows, prefix included, no KV cache",
              TIDE),
)


def published(key: str, model: str = "LLaDA2.0-mini") -> Published | None:
    """The published figure of `key` for `model`, or None."""
    return next((p for p in PUBLISHED if p.key == key and p.model == model), None)
