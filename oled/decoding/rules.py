"""Decoding rules: given a block's predictions, choose the positions to commit. The loop owns iteration."""
from __future__ import annotations

import numpy as np
import torch


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Minimum tokens to commit at each iteration of a block: block_length spread evenly over steps."""
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def predict(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """x0 and its probability per position (logits [B, V] fp32), still on the device. A row with a NaN or Inf
    gives a non-finite probability, which the loop reports (no host sync here to check it)."""
    if temperature > 0:
        # shifted by the row's maximum first: a tiny temperature then sharpens to the argmax instead of overflowing
        probs = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
        # multinomial refuses a non-finite row: draw that row from anything valid; its probability stays NaN
        finite = torch.isfinite(probs).all(dim=-1, keepdim=True)
        x0 = torch.multinomial(torch.where(finite, probs, 1.0), 1, generator=generator).squeeze(-1)
    else:
        probs = torch.softmax(logits, dim=-1)
        x0 = probs.argmax(dim=-1)
    return x0, probs.gather(-1, x0[:, None]).squeeze(-1)


class CommitRule:
    """Commit every masked position whose confidence exceeds the threshold if there are at least n_min of them,
    otherwise the n_min most confident (LLaDA2). Without a threshold this is LLaDA's fixed-steps low-confidence
    remasking: the top n_min by confidence."""

    def __init__(self, threshold: float | None):
        self.threshold = threshold

    def select(self, confidence: np.ndarray, n_min: int) -> np.ndarray:
        """confidence [B] (-inf at positions not masked) -> boolean commit mask [B]."""
        masked = np.isfinite(confidence)
        n_min = min(n_min, int(masked.sum()))
        if self.threshold is not None:
            above = masked & (confidence > self.threshold)
            if int(above.sum()) >= n_min:
                return above
        commit = np.zeros(confidence.shape, dtype=bool)
        # stable order: ties go to the leftmost position, like torch.topk on CPU and the reference
        commit[np.argsort(-confidence, kind="stable")[:n_min]] = True
        return commit


def make_rule(name: str, threshold: float | None) -> CommitRule:
    return CommitRule(threshold if name == "threshold" else None)


def with_greedy(greedy):
    """A predict with the reference's signature over a greedy kernel (logits -> (x0, confidence)): the kernel at
    temperature 0, the reference's sampling above (sampling is not the kernel's job)."""
    def predict_greedy(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
        if temperature > 0:
            return predict(logits, temperature, generator)
        return greedy(logits)
    return predict_greedy

