"""`oled generate "prompt"`: print the completion (streamed block by block) and one line of statistics."""
from __future__ import annotations

import json
import sys

from ..llm import LLM
from .common import add_decode_args, add_engine_args, add_special_tokens_arg, decode_params, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for a prompt")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print machine-readable output (with token ids)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="print the text only at the end")
    p.add_argument("--stats", action="store_true", help="print the expert statistics (hit rates, H2D, CPU)")
    add_special_tokens_arg(p)
    add_engine_args(p)
    add_decode_args(p)


def run(args) -> int:
    params = decode_params(args)
    params.validate()                    # before the model is built
    llm = LLM(**engine_config(args).to_dict())
    special = args.allow_special_tokens
    if args.chat:
        prompt = {"prompt_token_ids": llm.tokenizer.chat_ids([{"role": "user", "content": args.prompt}], special)}
    else:
        prompt = {"prompts": args.prompt, "allow_special_tokens": special}
    printed = [0]

    def on_block(text, new_ids, finished):
        if args.stream and not args.json:
            sys.stdout.write(text[printed[0]:])
            sys.stdout.flush()
            printed[0] = len(text)

    out = llm.generate(**prompt, on_block=on_block, **vars(params))
    stats = llm.stats()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
                          "finish_reason": out.finish_reason, "counters": out.counters, "expert_stats": stats,
                          "engine": llm.engine.describe()}))
        return 0
    if not args.stream:
        sys.stdout.write(out.text)
    elif len(out.text) < printed[0]:   # a stop string cut the streamed text
        pass
    c = out.counters
    print(f"\n[{c['generated_tokens']} tokens, {c['nfe']} forwards, {c['tokens_per_forward']:.2f} tok/fwd, "
          f"TPOT {c['tpot_s'] * 1e3:.2f} ms, prefill {c['prefill_s'] * 1e3:.1f} ms, "
          f"hit rate {stats.get('hit_rate_tokens', 1.0):.1%}, finish {out.finish_reason}]", file=sys.stderr)
    if args.stats:
        print(json.dumps(stats, indent=2), file=sys.stderr)
    return 0
