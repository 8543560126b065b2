"""`oled compare`: a candidate engine configuration's logits against a reference's, teacher-forced on the same
canvases (oled/bench/teacher_forced.py), and the tokens of a free candidate run.

  oled compare --candidate policy=oled --candidate cpu_share=true --candidate expert_budget=0.4 --dtype bfloat16
  oled compare --random-weights tiny --dtype float32 --candidate policy=lru --candidate expert_budget=0.25
  oled compare --prompt "def fib(n):" --candidate dtype=bfloat16 --dtype float32 --json cmp.json
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..bench import workloads
from ..bench.teacher_forced import compare
from ..config import SECTIONS, SETTING_NAMES, EngineConfig
from ..engine import check_dtype, pick_device
from ..fp8 import check_expert_dtype
from ..policies.spec import PolicySpec
from ..runtime.budget import parse_spec
from .common import FIELDS, TYPES, add_decode_args, add_settings, decode_params, positive_int

# the settings both configurations share: the model itself and where it runs (dtype and device may differ)
SHARED = ("model", "random_weights", "layers", "seed", "device", "dtype")
MODEL_SETTINGS = ("model", "random_weights", "layers", "seed")      # not per configuration: the same weights
REFERENCE = {"policy": "full", "expert_budget": "1.0"}               # every expert resident, computed on the device
TRUE, FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")
NUMBER_WORDS = {"int": "a whole number", "float": "a number"}
DEFAULT_PROMPTS = 4
DEFAULT_GEN_LENGTH = 64
DEFAULT_MAX_FORWARDS = 4096
DEFAULT_MAX_LOGITS_GIB = 8.0


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="teacher-forced logits and tokens of one engine configuration against another",
                       description=__doc__.split("\n\n")[0])
    add_settings(p.add_argument_group("model (shared by both configurations)"), SHARED)
    g = p.add_argument_group("configurations")
    g.add_argument("--reference", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine setting of the reference (EngineConfig's field names: policy=full, "
                        "expert_budget=1.0, cuda_graphs=false, ...; repeat for more; default: policy=full "
                        "expert_budget=1.0, every expert resident)")
    g.add_argument("--candidate", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine setting of the candidate, over the engine's defaults (policy=oled, "
                        "cpu_share=true, expert_budget=0.4, dtype=bfloat16, ...; repeat for more)")
    w = p.add_argument_group("prompts")
    w.add_argument("--workload", default="chat", help="a shipped workload (chat, code, math, long), a .jsonl file or "
                                                      "synthetic:LEN[:N]")
    w.add_argument("--prompts", type=positive_int, metavar="N",
                   help=f"the workload's first N prompts (default: {DEFAULT_PROMPTS})")
    w.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt text instead of the workload (repeat for more)")
    lim = p.add_argument_group("limits and output")
    lim.add_argument("--max-forwards", type=positive_int, default=DEFAULT_MAX_FORWARDS,
                     help="refuse prompts that may take more forwards than this a configuration")
    lim.add_argument("--max-logits-gib", type=positive_float, default=DEFAULT_MAX_LOGITS_GIB,
                     help="refuse prompts whose reference logits at the masked positions may take more host memory")
    lim.add_argument("--json", metavar="FILE", help="write the comparison (totals, per prompt, per forward) here")
    add_decode_args(p)
    p.set_defaults(gen_length=DEFAULT_GEN_LENGTH)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a finite number above 0, got {text!r}")
    return value


def parse_setting(item: str, flag: str) -> tuple[str, object]:
    """KEY=VALUE -> (EngineConfig field name, value of the field's type), checked against its choices and minimum."""
    key, sep, text = item.partition("=")
    name = key.strip().replace("-", "_")
    if not sep or not name:
        raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
    if name not in SETTING_NAMES or name in SECTIONS:
        raise ValueError(f"{flag} {item!r}: unknown engine setting {name!r}; one of {', '.join(SETTING_NAMES)}")
    if name in MODEL_SETTINGS:
        raise ValueError(f"{flag} {item!r}: the model is shared by both configurations; give --{key.replace('_', '-')}")
    f = FIELDS[name]
    kind = f.type.replace(" | None", "")
    if f.type.endswith("| None") and text.lower() == "none":
        return name, None
    if kind == "bool":
        if text.lower() not in TRUE + FALSE:
            raise ValueError(f"{flag} {item!r}: {name} is true or false")
        return name, text.lower() in TRUE
    try:
        value = TYPES[kind](text)
    except ValueError:
        raise ValueError(f"{flag} {item!r}: {name} takes {NUMBER_WORDS[kind]}") from None
    meta = f.metadata
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"{flag} {item!r}: {name} is one of {', '.join(meta['choices'])}")
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise ValueError(f"{flag} {item!r}: {name} must be at least {meta['minimum']}")
    return name, value


def configuration(args, items: list[str], flag: str, defaults: dict) -> EngineConfig:
    """The shared model flags, then `defaults`, then the KEY=VALUE items; what can be checked before a model is
    built is checked here."""
    settings = {name: getattr(args, name) for name in SHARED}
    settings.update(defaults)
    settings.update(parse_setting(item, flag) for item in items)
    cfg = EngineConfig(**settings)
    PolicySpec.parse(cfg.policy, live=True)         # the engine checks these too, but only once it is built: the
    parse_spec(cfg.expert_budget)                   # candidate's after the reference has run
    check_dtype(cfg.dtype)
    check_expert_dtype(cfg.expert_dtype)
    pick_device(cfg.device)
    return cfg


def prompts_of(args, tokenizer=None) -> list:
    if args.prompt:
        if args.prompts is not None:
            raise ValueError("--prompts N takes a workload's first prompts; with --prompt give the texts only")
        return [workloads.Prompt(f"prompt-{i}", prompt=text) for i, text in enumerate(args.prompt)]
    return workloads.load(args.workload, tokenizer, limit=args.prompts or DEFAULT_PROMPTS).prompts


COLUMNS = (("prompt", "id", "{}"), ("forwards", "forwards", "{}"), ("positions", "positions", "{}"),
           ("max |dlogit|", "max_abs", "{:.3e}"), ("mean |dlogit|", "mean_abs", "{:.3e}"),
           ("argmax agree", "argmax_agreement", "{:.4%}"), ("committed agree", "committed_agreement", "{:.4%}"),
           ("free tokens agree", "free_token_agreement", "{:.2%}"))


def table(rows: list[dict]) -> str:
    cells = [[title for title, _, _ in COLUMNS]] + [[fmt.format(r[key]) for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def run(args) -> int:
    params = decode_params(args)
    params.validate()
    reference = configuration(args, args.reference, "--reference", REFERENCE)
    candidate = configuration(args, args.candidate, "--candidate", {})
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise ValueError(f"--json {args.json}: its folder does not exist")
    if args.prompt or not args.workload.startswith("synthetic:"):
        prompts_of(args)                 # a bad workload refused before any model is built (synthetic: token ids)
    result = compare(reference, candidate, lambda tokenizer: prompts_of(args, tokenizer), params,
                     max_forwards=args.max_forwards, max_logit_bytes=args.max_logits_gib * 2**30,
                     say=lambda line: print(line, file=sys.stderr))
    print(table([p.summary() for p in result.prompts] + [result.total()]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0
