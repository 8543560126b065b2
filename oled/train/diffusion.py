"""Block-diffusion objective (BD3-LM / LLaDA2 style) and the data sampler.

A training sequence x0 has L tokens (L a multiple of block_length). Each block is noised independently: a mask
ratio t ~ U(eps, 1) is drawn per block and exactly n = ceil(t * block_length) of its positions (uniformly chosen)
become ``<|mask|>``, so every block has at least one masked position and the realised ratio is t_b = n / B.
The model sees [x_noisy ; x_clean] (2L tokens, same positions 0..L-1 in both halves) under
``model.bd_attention_mask``; the loss is the cross-entropy at the masked noisy positions.

Loss weighting (``loss="inv_t"``, the default): each masked token is weighted 1 / t_b (the ELBO weight of the
linear schedule, with the realised ratio of its block) and the sum is divided by the number of noisy tokens.
Since a block has n = t_b * B masked tokens, this equals the mean over blocks of each block's mean masked-token
cross-entropy: an unbiased-in-expectation, low-variance form of the LLaDA 1/t objective. ``loss="mean"`` is the
plain mean over all masked tokens.

Sampler: windows of L tokens from the EOS-separated token stream; inside a window everything after the first EOS
becomes EOS (pad), so the model learns that a finished document is followed by EOS only (the decoder stops after a
block containing EOS). A fraction of windows is forced to contain a document end (random offset), another fraction
starts at a document start.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_after_eos(x: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Every position after the first EOS of each row becomes EOS."""
    return torch.where((x == eos_id).cumsum(dim=1) > 0, torch.full_like(x, eos_id), x)


class WindowSampler:
    """Samples [B, L] windows from a 1-D token stream living on the training device."""

    def __init__(self, ids: torch.Tensor, seq_len: int, eos_id: int, *, p_doc_end: float = 0.15,
                 p_doc_start: float = 0.15, generator: torch.Generator | None = None):
        if ids.numel() <= seq_len:
            raise ValueError(f"token stream of {ids.numel()} tokens is not longer than seq_len={seq_len}")
        self.ids, self.L, self.eos = ids.long(), seq_len, eos_id
        self.p_end, self.p_start = p_doc_end, p_doc_start
        self.g = generator
        ends = (self.ids == eos_id).nonzero().flatten()
        self.doc_ends = ends if ends.numel() else torch.tensor([ids.numel() - 1], device=ids.device)
        self.doc_starts = torch.cat([torch.zeros(1, dtype=torch.long, device=ids.device), self.doc_ends[:-1] + 1])
        self.arange = torch.arange(seq_len, device=ids.device)

    def _randint(self, high, n):
        return torch.randint(0, high, (n,), device=self.ids.device, generator=self.g)

    def sample(self, batch: int) -> torch.Tensor:
        N, L, dev = self.ids.numel(), self.L, self.ids.device
        u = torch.rand(batch, device=dev, generator=self.g)
        start = self._randint(N - L + 1, batch)
        s_doc = self.doc_starts[self._randint(self.doc_starts.numel(), batch)]
        e = self.doc_ends[self._randint(self.doc_ends.numel(), batch)]
        s_end = e - self._randint(L, batch)              # the document's EOS lands at offset 0..L-1
        start = torch.where(u < self.p_end, s_end, torch.where(u < self.p_end + self.p_start, s_doc, start))
        start = start.clamp(0, N - L)
        return pad_after_eos(self.ids[start[:, None] + self.arange], self.eos)


def noise_blocks(x0: torch.Tensor, block_length: int, mask_id: int, *, eps: float = 1e-3,
                 ratio: float | None = None, generator: torch.Generator | None = None):
    """Mask each block of x0 [B, L] independently. ratio=None: t ~ U(eps, 1) per block; else the fixed ratio.

    Returns (x_noisy, masked bool [B, L], t_realised [B, L] = masked count of the token's block / block_length).
    """
    B, L = x0.shape
    nb = L // block_length
    dev = x0.device
    if ratio is None:
        t = eps + (1 - eps) * torch.rand(B, nb, device=dev, generator=generator)
    else:
        t = torch.full((B, nb), float(ratio), device=dev)
    n = torch.ceil(t * block_length - 1e-6).clamp(1, block_length)           # masked positions per block
    ranks = torch.rand(B, nb, block_length, device=dev, generator=generator).argsort(-1).argsort(-1)
    masked = (ranks < n[..., None]).view(B, L)
    x_noisy = torch.where(masked, torch.full_like(x0, mask_id), x0)
    t_real = (n / block_length)[..., None].expand(B, nb, block_length).reshape(B, L)
    return x_noisy, masked, t_real


def bd_loss(model, x0: torch.Tensor, *, mask_id: int, block_length: int, attn_mask: torch.Tensor,
            loss: str = "inv_t", eps: float = 1e-3, generator: torch.Generator | None = None):
    """One block-diffusion loss evaluation. Returns (loss, stats dict of detached tensors)."""
    x_noisy, masked, t_real = noise_blocks(x0, block_length, mask_id, eps=eps, generator=generator)
    h = model.bd_hidden(x_noisy, x0, attn_mask)                                # [B, L, H] noisy half
    logits = model.lm_head(h)
    ce = F.cross_entropy(logits.float().flatten(0, 1), x0.flatten(), reduction="none").view_as(x0)
    m = masked.float()
    if loss == "inv_t":
        value = (ce * m / t_real).sum() / x0.numel()
    elif loss == "mean":
        value = (ce * m).sum() / m.sum()
    else:
        raise ValueError(f"unknown loss weighting {loss!r}")
    with torch.no_grad():
        acc = ((logits.argmax(-1) == x0).float() * m).sum() / m.sum()
        plain = (ce * m).sum() / m.sum()
    return value, {"masked_ce": plain.detach(), "masked_acc": acc.detach()}
