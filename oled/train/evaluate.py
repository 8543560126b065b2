"""Held-out quality of a block-diffusion LM: masked-token loss and accuracy at fixed mask ratios.

Setting (block diffusion, as the block-by-block decoder with a prefix KV cache sees it): every held-out file is
tiled from its start into windows of L tokens (the last one padded with EOS after the file's EOS); in each window
EVERY block gets exactly ceil(ratio * block_length) masked positions (fixed seed), and the model predicts them from
the masked block itself plus the clean preceding blocks ([x_noisy ; x_clean] input, ``bd_attention_mask``).
Reported per ratio: ``loss`` (mean cross-entropy over masked positions, nats), ``acc`` (argmax accuracy over masked
positions), and ``loss_text`` / ``acc_text`` restricted to positions up to and including each file's EOS (the EOS
padding after it is easy and would inflate the numbers). ratio 1.0 = a fully masked block given clean context.

CLI: ``python -m oled.train.evaluate --model DIR --corpus DIR [--device cuda]``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import load_checkpoint
from .corpus import load_corpus_ids
from .diffusion import noise_blocks, pad_after_eos
from .model import bd_attention_mask

RATIOS = (0.15, 0.5, 0.9, 1.0)


def heldout_windows(ids: np.ndarray | torch.Tensor, seq_len: int, eos_id: int,
                    max_windows: int | None = None) -> torch.Tensor:
    """[W, L] windows tiling each EOS-terminated document from its start (EOS-padded after the document end)."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    ends = (ids == eos_id).nonzero().flatten().tolist()
    if not ends or ends[-1] != ids.numel() - 1:
        ends.append(ids.numel() - 1)
    padded = torch.cat([ids, torch.full((seq_len,), eos_id, dtype=torch.long)])
    rows, s = [], 0
    for e in ends:
        for off in range(s, e + 1, seq_len):
            rows.append(padded[off:off + seq_len])
        s = e + 1
    w = pad_after_eos(torch.stack(rows), eos_id)
    return w[:max_windows] if max_windows else w


@torch.no_grad()
def heldout_metrics(model, windows: torch.Tensor, *, mask_id: int, eos_id: int, block_length: int,
                    ratios=RATIOS, batch_size: int = 64, device="cpu", seed: int = 1234,
                    autocast_dtype: torch.dtype | None = None) -> dict:
    """{str(ratio): {loss, acc, loss_text, acc_text, masked, masked_text}} over the windows."""
    model_was_training = model.training
    model.eval()
    device = torch.device(device)
    L = windows.shape[1]
    attn = bd_attention_mask(L, block_length, device)
    ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    out = {}
    for r in ratios:
        g = torch.Generator(device=device).manual_seed(seed)
        sums = dict(ce=0.0, ok=0.0, n=0.0, ce_t=0.0, ok_t=0.0, n_t=0.0)
        for i in range(0, windows.shape[0], batch_size):
            x0 = windows[i:i + batch_size].to(device)
            is_eos = x0 == eos_id
            text = (is_eos.cumsum(1) - is_eos.long()) == 0                   # up to and including first EOS
            x_noisy, masked, _ = noise_blocks(x0, block_length, mask_id, ratio=r, generator=g)
            with ctx:
                logits = model.lm_head(model.bd_hidden(x_noisy, x0, attn))
            ce = F.cross_entropy(logits.float().flatten(0, 1), x0.flatten(), reduction="none").view_as(x0)
            ok = (logits.argmax(-1) == x0).float()
            m, mt = masked.float(), (masked & text).float()
            sums["ce"] += float((ce * m).sum()); sums["ok"] += float((ok * m).sum()); sums["n"] += float(m.sum())
            sums["ce_t"] += float((ce * mt).sum()); sums["ok_t"] += float((ok * mt).sum())
            sums["n_t"] += float(mt.sum())
        out[str(r)] = {
            "loss": sums["ce"] / max(sums["n"], 1), "acc": sums["ok"] / max(sums["n"], 1),
            "loss_text": sums["ce_t"] / max(sums["n_t"], 1), "acc_text": sums["ok_t"] / max(sums["n_t"], 1),
            "masked": int(sums["n"]), "masked_text": int(sums["n_t"]),
        }
    model.train(model_was_training)
    return out


def format_metrics(metrics: dict) -> str:
    lines = ["ratio   loss   acc    loss_text acc_text  masked"]
    for r, m in metrics.items():
        lines.append(f"{float(r):5.2f}  {m['loss']:6.3f} {m['acc']:6.3f}  {m['loss_text']:6.3f}   "
                     f"{m['acc_text']:6.3f}   {m['masked']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="held-out masked-token metrics of a checkpoint")
    p.add_argument("--model", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's max_position_embeddings")
    p.add_argument("--max-windows", type=int, default=None)
    a = p.parse_args(argv)
    model = load_checkpoint(a.model, dtype=torch.float32, device=a.device)
    c = model.config
    _, _, held = load_corpus_ids(a.corpus)
    L = a.seq_len or c.max_position_embeddings
    w = heldout_windows(held, L, c.eos_token_id, a.max_windows)
    m = heldout_metrics(model, w, mask_id=c.mask_token_id, eos_id=c.eos_token_id, block_length=c.block_length,
                        device=a.device, autocast_dtype=torch.bfloat16 if a.device.startswith("cuda") else None)
    print(format_metrics(m))
    print(json.dumps(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
