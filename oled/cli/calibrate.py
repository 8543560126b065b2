"""`oled calibrate`: measure expert popularity (tokens routed to each expert of each MoE layer) over a set of prompts,
for static placements (`--policy fiddler --popularity FILE`).

  oled calibrate --random-weights tiny --prompt "Hello" --prompt "Write a poem" --out popularity.json
  oled calibrate --model DIR --prompts-file prompts.txt --expert-budget 0.5 --policy lru --out popularity.json
  oled calibrate --model DIR --workload chat --out popularity.json

The file is {"layers": {layer: {expert: tokens}}, "provenance": {model, prompts, date, ...}}; the counts are
RunStats.popularity() over every forward of the run (prefill, cache fills and denoising iterations).
"""
from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path

from .. import __version__ as version
from ..bench import workloads
from ..engine import default_model_dir
from ..llm import LLM
from ..policies.fiddler import popularity_document
from ..textfile import read_text
from .common import add_decode_args, add_engine_args, decode_params, engine_config

CALIBRATION_POLICIES = ("full", "lru")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure expert popularity for static placements (fiddler)",
                       description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("prompts (at least one source)")
    src.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", metavar="FILE", help="prompts, one per line (blank lines skipped)")
    src.add_argument("--workload", metavar="NAME",
                     help="a shipped workload (code, math, chat, long), a workload .jsonl file or synthetic:LEN[:N]")
    src.add_argument("--limit", type=int, help="use at most this many prompts (default: all)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each --prompt / --prompts-file text in the chat template (workloads carry their own)")
    p.add_argument("--out", required=True, metavar="FILE", help="popularity JSON to write")
    add_engine_args(p)
    add_decode_args(p)
    p.set_defaults(policy="full", gen_length=64)


def collect_prompts(args) -> list[str]:
    """The texts of --prompt and --prompts-file, in that order (the workload comes later: it needs the tokenizer)."""
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = read_text(args.prompts_file, "--prompts-file")
        except FileNotFoundError:
            raise ValueError(f"--prompts-file {args.prompts_file!r} not found") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts and not args.workload:
        raise ValueError("no prompts: give --prompt TEXT (repeatable), --prompts-file FILE or --workload NAME")
    return prompts


def _workload(name: str, tokenizer):
    return workloads.load(name, tokenizer)


def run(args) -> int:
    if args.policy not in CALIBRATION_POLICIES:
        raise ValueError(f"calibrate runs with --policy full (every expert resident) or lru (when the experts do "
                         f"not fit), not {args.policy!r}")
    texts = collect_prompts(args)
    decode_params(args).validate()          # before the model is built
    cfg = engine_config(args)
    llm = LLM(**cfg.to_dict())
    engine = llm.engine
    tok = llm.tokenizer
    # (label, token ids): the given texts (chat template applied with --chat), then the workload's prompts
    items = [(t, tok.chat_ids([{"role": "user", "content": t}]) if args.chat else tok.encode(t)) for t in texts]
    workload = None
    if args.workload:
        workload = _workload(args.workload, tok)
        items += [(p.id, p.ids(tok)) for p in workload.prompts]
    if args.limit is not None:
        items = items[: args.limit]
    if not items:
        raise ValueError("no prompts to calibrate with")
    params = decode_params(args)
    engine.manager.stats.reset()
    generated = 0
    for i, (_, ids) in enumerate(items):
        out = llm.generate(prompt_token_ids=ids, **vars(params))
        generated += len(out.token_ids)
        print(f"[{i + 1}/{len(items)}] {len(ids)} prompt tokens, {len(out.token_ids)} generated", file=sys.stderr)
    stats = engine.manager.stats
    popularity = stats.popularity()
    provenance = {
        "model": engine.model_name,
        "model_path": None if cfg.random_weights else str(cfg.model or default_model_dir()),
        "random_weights": cfg.random_weights,
        "seed": cfg.seed if cfg.random_weights else None,
        "model_type": engine.config.model_type,
        "moe_layers": list(engine.config.moe_layers),
        "num_experts": engine.config.num_experts,
        "top_k": engine.config.top_k,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "device": str(engine.device),
        "policy": engine.policy.name,
        "expert_budget": cfg.expert_budget,
        "decode": {k: v for k, v in vars(params).items() if k != "stop"},
        "chat": args.chat,
        "prompts": [label for label, _ in items],        # the texts given, or the workload's prompt ids
        "workload": workload.describe() if workload is not None else None,
        "num_prompts": len(items),
        "prompt_tokens": sum(len(ids) for _, ids in items),
        "generated_tokens": generated,
        "forwards": stats.forward + 1,
        "counts": "tokens routed to each expert over all forwards (prefill, cache fill, iterations)",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "oled_version": version,
    }
    doc = popularity_document(popularity, provenance)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote expert popularity of {len(popularity)} MoE layers over {len(items)} prompts "
          f"({stats.forward + 1} forwards) to {out_path}", file=sys.stderr)
    engine.manager.close()
    return 0
