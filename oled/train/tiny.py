"""Train the tiny LLaDA2-architecture MoE diffusion LM (the engine's default model), time-bounded.

    python -m oled.train.tiny --corpus DIR --out DIR [--minutes 8] [--device cuda] [--steps N] [--seed S]

``--corpus`` is a directory made by ``python -m oled.train.corpus`` (tokenizer.json + token ids; a directory with
only train.txt / heldout.txt also works: the tokenizer is trained and the text tokenized first). The run stops
training early enough that the held-out evaluation and the checkpoint save finish within ``--minutes`` of wall time
(measured from the start of ``main``). It writes into ``--out`` the checkpoint in the official LLaDA2 layout
(config.json, safetensors shards + index, tokenizer.json), ``corpus_manifest.json`` (the exact data selection)
and ``train_log.json`` (wall time, steps, tokens seen, final train loss, held-out metrics, loss history).

Recipe: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10 % driven by
the fraction of the time (or step) budget used, gradient clipping at 1.0, bf16 autocast on CUDA, block-diffusion
loss (``diffusion.bd_loss``), aux-loss-free expert balancing via ``expert_bias`` (rate ``--bias-rate``).
A small held-out subset is evaluated every ``--eval-every-s`` seconds; the parameters with the best such loss are
the ones saved (noted in the log as ``selected``). ``--quick`` shrinks everything for a CPU smoke run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .checkpoint import save_checkpoint
from .corpus import MANIFEST_NAME, load_corpus_ids
from .diffusion import WindowSampler, bd_loss
from .evaluate import RATIOS, format_metrics, heldout_metrics, heldout_windows
from .model import LLaDA2MoeModelLM, TinyConfig, bd_attention_mask, update_expert_bias
from .tokenizer_train import special_token_ids

# The default model: ~14.6 M parameters (about 29 MB in bf16): hidden 256, 1 dense + 6 MoE layers, each with 64
# routed experts of intermediate 32 and LLaDA2.0-mini's routing geometry (8 groups, best 4 groups kept, top-8),
# one shared expert; 4 query heads / 2 KV heads of head_dim 64.
DEFAULT_MODEL = dict(hidden_size=256, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     intermediate_size=512, moe_intermediate_size=32, num_experts=64, num_experts_per_tok=8,
                     n_group=8, topk_group=4, num_shared_experts=1, first_k_dense_replace=1)
# The wall-time budget (--minutes) covers set-up, training, the final evaluation and saving.
FINAL_EVAL_SHARE = 0.25     # at most this share of the budget for the final held-out evaluation
EVAL_TIME_SAFETY = 1.5      # evaluation time is estimated from one periodic check; allow this much more
SAVE_MARGIN_SHARE = 0.1     # kept free for saving the checkpoint and the log ...
SAVE_MARGIN_MAX_S = 15.0    # ... up to this many seconds (the default model saves in a few)
QUICK_MODEL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   n_group=2, topk_group=1, num_shared_experts=1, first_k_dense_replace=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oled train-tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus directory (python -m oled.train.corpus --out DIR)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-time budget including evaluation and saving")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps (also sets the schedule; default: when --minutes runs out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny dimensions and batch for a CPU smoke run")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 64; quick 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; quick 64)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; quick 3e-3)")
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 150; quick 5)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--loss", choices=("inv_t", "mean"), default="inv_t")
    p.add_argument("--eps", type=float, default=1e-3, help="smallest mask ratio")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="expert_bias update speed u")
    p.add_argument("--log-every", type=int, default=None, help="steps between log lines (default 50; quick 5)")
    p.add_argument("--eval-every-s", type=float, default=None, help="seconds between held-out checks (default 45)")
    p.add_argument("--val-windows", type=int, default=None,
                   help="held-out windows of the periodic check (default 96; quick 8)")
    p.add_argument("--eval-max-windows", type=int, default=None,
                   help="cap on held-out windows of the final eval (default: all)")
    p.add_argument("--max-shard-mb", type=float, default=10.0, help="safetensors shard size (0 = one file)")
    p.add_argument("--vocab-size", type=int, default=6144, help="only used if the corpus has no tokenizer yet")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TinyConfig field, e.g. --model num_experts=64")
    return p


def _override(spec: list[str]) -> dict:
    out = {}
    for item in spec:
        k, _, v = item.partition("=")
        f = TinyConfig.__dataclass_fields__.get(k)
        if f is None:
            raise SystemExit(f"unknown model field {k!r}")
        typ = {"int": int, "float": float, "bool": lambda s: s.lower() in ("1", "true", "yes")}.get(str(f.type), int)
        out[k] = typ(v)
    return out


def _lr_at(frac: float, step: int, warmup: int, peak: float, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(max(frac, 0.0), 1.0)
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(args: argparse.Namespace, t_start: float | None = None) -> dict:
    t_start = time.time() if t_start is None else t_start
    budget_s = args.minutes * 60.0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    q = args.quick
    batch = args.batch_size or (8 if q else 64)
    seq_len = args.seq_len or (64 if q else 1024)
    peak_lr = args.lr or (3e-3 if q else 2e-3)
    warmup = args.warmup if args.warmup is not None else (5 if q else 150)
    log_every = args.log_every or (5 if q else 50)
    eval_every = args.eval_every_s if args.eval_every_s is not None else (1e9 if q else 45.0)
    val_windows = args.val_windows or (8 if q else 96)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    tok, train_ids, held_ids = load_corpus_ids(args.corpus, vocab_size=args.vocab_size)
    ids = special_token_ids(tok)
    dims = dict(QUICK_MODEL if q else DEFAULT_MODEL)
    dims.update(_override(args.model))
    config = TinyConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=seq_len, **ids, **dims)
    if seq_len % config.block_length:
        raise SystemExit(f"--seq-len must be a multiple of block_length={config.block_length}")
    model = LLaDA2MoeModelLM(config)
    model.reset_parameters(seed=args.seed)
    model.to(device).train()
    nparams = model.num_parameters()
    print(f"[train-tiny] device={device} params={nparams['total'] / 1e6:.2f}M "
          f"(active/token {nparams['active_per_token'] / 1e6:.2f}M, routed experts "
          f"{nparams['routed_experts'] / 1e6:.2f}M) batch={batch}x{seq_len} train_tokens={train_ids.size} "
          f"heldout_tokens={held_ids.size} budget={budget_s:.0f}s", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "word_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "word_embeddings" not in n)]
    opt_kw = dict(lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    if cuda:
        opt_kw["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kw)

    g = torch.Generator(device=device).manual_seed(args.seed)
    sampler = WindowSampler(torch.as_tensor(train_ids.astype(np.int64)).to(device), seq_len, config.eos_token_id,
                            generator=g)
    attn_mask = bd_attention_mask(seq_len, config.block_length, device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    amp_dtype = torch.bfloat16 if cuda else None

    all_windows = heldout_windows(held_ids, seq_len, config.eos_token_id, args.eval_max_windows)
    # Periodic check: an evenly spread fixed subset of the held-out windows.
    sel = torch.linspace(0, all_windows.shape[0] - 1, min(val_windows, all_windows.shape[0])).long()
    val_w = all_windows[sel]
    eval_kw = dict(mask_id=config.mask_token_id, eos_id=config.eos_token_id, block_length=config.block_length,
                   device=device, autocast_dtype=amp_dtype, batch_size=batch)

    def val_loss() -> tuple[float, float]:
        t = time.time()
        m = heldout_metrics(model, val_w, ratios=RATIOS, **eval_kw)
        return float(np.mean([v["loss_text"] for v in m.values()])), time.time() - t

    v0, v_time = val_loss()
    # The end must fit in the budget: the last periodic check, the final evaluation (both timed from the check
    # just run) and saving. The final evaluation gets at most FINAL_EVAL_SHARE of the budget, on an evenly spread
    # subset of the held-out windows if all of them would take longer.
    per_window = v_time / max(val_w.shape[0], 1) * EVAL_TIME_SAFETY
    fit = max(val_w.shape[0], int(FINAL_EVAL_SHARE * budget_s / max(per_window, 1e-9)))
    if fit < all_windows.shape[0]:
        print(f"[train-tiny] final evaluation on {fit} of {all_windows.shape[0]} held-out windows to fit "
              f"--minutes {args.minutes:g}", flush=True)
        all_windows = all_windows[torch.linspace(0, all_windows.shape[0] - 1, fit).long()]
    save_margin = min(SAVE_MARGIN_MAX_S, SAVE_MARGIN_SHARE * budget_s)
    reserve = per_window * (val_w.shape[0] + all_windows.shape[0]) + save_margin
    train_deadline = t_start + budget_s - reserve
    t_train0 = time.time()
    if train_deadline <= t_train0:
        print(f"[train-tiny] --minutes {args.minutes:g} leaves no time to train after {t_train0 - t_start:.0f}s of "
              f"set-up and {reserve:.0f}s reserved for evaluation and saving: 0 steps", flush=True)
    else:
        print(f"[train-tiny] held-out check at init: {v0:.3f} ({v_time:.1f}s); training until "
              f"{train_deadline - t_start:.0f}s of {budget_s:.0f}s, reserve {reserve:.0f}s", flush=True)

    history, val_history = [], [{"step": 0, "time_s": round(time.time() - t_start, 1), "val_loss": v0}]
    best = {"val": v0, "step": 0, "state": None}
    moe = model.moe_layers()
    load_acc = [torch.zeros(config.num_experts, device=device) for _ in moe]
    run_loss = torch.zeros((), device=device)
    run_ce = torch.zeros((), device=device)
    run_acc = torch.zeros((), device=device)
    n_run = 0
    step, last_eval, last_log_t, last_log_step = 0, time.time(), time.time(), 0
    train_span = max(train_deadline - t_train0, 1e-6)
    while True:
        now = time.time()
        if args.steps is not None and step >= args.steps:
            break
        if now >= train_deadline:
            break
        frac = (now - t_train0) / train_span
        if args.steps is not None:
            frac = max(frac, step / args.steps)
        lr = _lr_at(frac, step, warmup, peak_lr, args.min_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        x0 = sampler.sample(batch)
        with autocast():
            loss, st = bd_loss(model, x0, mask_id=config.mask_token_id, block_length=config.block_length,
                               attn_mask=attn_mask, loss=args.loss, eps=args.eps, generator=g)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts = [m.last_counts for m in moe]
        update_expert_bias(model, counts, args.bias_rate)
        for acc, c in zip(load_acc, counts):
            acc += c
        run_loss += loss.detach()
        run_ce += st["masked_ce"]
        run_acc += st["masked_acc"]
        n_run += 1
        step += 1
        if step % log_every == 0 or step == 1:
            t = time.time()
            imb = max(float(a.max() / a.mean().clamp_min(1)) for a in load_acc) if load_acc else 1.0
            rec = {"step": step, "time_s": round(t - t_start, 1), "lr": lr, "loss": float(run_loss / n_run),
                   "masked_ce": float(run_ce / n_run), "masked_acc": float(run_acc / n_run),
                   "grad_norm": float(gnorm), "max_load_over_mean": imb,
                   "tokens_per_s": (step - last_log_step) * batch * seq_len / max(t - last_log_t, 1e-9)}
            history.append(rec)
            print(f"step {step:5d} | loss {rec['loss']:.4f} | ce {rec['masked_ce']:.3f} acc {rec['masked_acc']:.3f}"
                  f" | lr {lr:.2e} | gnorm {rec['grad_norm']:.2f} | load max/mean {imb:.2f} | "
                  f"{rec['tokens_per_s'] / 1e3:.0f}k tok/s | {rec['time_s']:.0f}s", flush=True)
            run_loss.zero_(); run_ce.zero_(); run_acc.zero_()
            n_run = 0
            for a in load_acc:
                a.zero_()
            last_log_t, last_log_step = time.time(), step
        if time.time() - last_eval >= eval_every:
            v, _ = val_loss()
            val_history.append({"step": step, "time_s": round(time.time() - t_start, 1), "val_loss": v})
            if v < best["val"]:
                best.update(val=v, step=step, state={k: t.detach().clone() for k, t in model.state_dict().items()})
            print(f"[train-tiny] step {step}: held-out check {v:.4f} (best {best['val']:.4f} @ {best['step']})",
                  flush=True)
            last_eval = time.time()
    if cuda:
        torch.cuda.synchronize()
    t_train_end = time.time()
    v_final, _ = val_loss()
    val_history.append({"step": step, "time_s": round(time.time() - t_start, 1), "val_loss": v_final})
    selected = "final"
    if best["state"] is not None and best["val"] < v_final:
        model.load_state_dict(best["state"])
        selected = f"best held-out check at step {best['step']}"
    print(f"[train-tiny] {step} steps in {t_train_end - t_train0:.0f}s; selected: {selected}", flush=True)

    metrics = heldout_metrics(model, all_windows, ratios=RATIOS, **eval_kw)
    print(format_metrics(metrics), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = Path(args.corpus) / MANIFEST_NAME
    extra = {"corpus_manifest.json": manifest} if manifest.is_file() else {}
    saved = save_checkpoint(model, out, tokenizer_path=Path(args.corpus) / "tokenizer.json",
                            max_shard_bytes=int(args.max_shard_mb * 1024 * 1024) if args.max_shard_mb else None,
                            extra_files=extra)
    ckpt_bytes = sum((out / f).stat().st_size for f in saved["files"] if f.endswith(".safetensors"))
    biases = [m.gate.expert_bias for m in moe]
    tail = history[-3:] if history else []
    log = {
        "wall_time_s": round(time.time() - t_start, 1),
        "train_time_s": round(t_train_end - t_train0, 1),
        "budget_s": budget_s,
        "steps": step,
        "tokens_seen": step * batch * seq_len,
        "tokens_seen_note": "clean tokens per step = batch x seq_len; the model runs 2x that ([noisy ; clean])",
        "final_train_loss": float(np.mean([h["loss"] for h in tail])) if tail else None,
        "final_train_masked_ce": float(np.mean([h["masked_ce"] for h in tail])) if tail else None,
        "heldout": metrics,
        "heldout_setting": "block diffusion: every block masked at the ratio (ceil(ratio*block_length) positions), "
                           "clean previous blocks as context; loss = mean CE (nats) over masked positions; *_text "
                           "excludes EOS padding after a file's end",
        "heldout_windows": int(all_windows.shape[0]),
        "selected": selected,
        "val_history": val_history,
        "history": history,
        "loss_weighting": args.loss,
        "params": nparams,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_files": saved["files"],
        "expert_bias_abs_max": [float(b.abs().max()) for b in biases],
        "config": config.to_hf_dict(),
        "args": {k: v for k, v in vars(args).items()},
        "recipe": {"batch_size": batch, "seq_len": seq_len, "peak_lr": peak_lr, "warmup": warmup,
                   "optimizer": "AdamW(0.9, 0.95)", "schedule": "warmup + cosine on budget fraction",
                   "autocast": "bf16" if cuda else "none (fp32)", "grouped_mm": moe[0].experts.grouped if moe else None},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"},
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"[train-tiny] saved {out} ({ckpt_bytes / 2**20:.1f} MiB weights, {len(saved['files'])} files); "
          f"wall {log['wall_time_s']:.0f}s", flush=True)
    return log


def main(argv=None) -> int:
    t_start = time.time()
    args = build_parser().parse_args(argv)
    train(args, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
