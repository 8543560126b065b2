"""Generation quality of the tiny model: complete held-out function signatures with the engine's decoder.

For each held-out function (from the corpus's held-out split), the prompt is its `def` line and docstring; the
engine generates `gen_length` tokens (greedy, threshold rule). A completion counts as valid Python when the prompt
plus the generated text of the first block, cut at its last complete line, parses with `ast.parse` — as it is, or
with a `pass` line appended at the indentation of its last line (a body that stops at an open block). That check
also passes completions that add nothing but comments, blank lines or a new `def`, so the report also counts the
completions that add a body statement, and those that are valid with one.

    python -m oled.train.generation_report --corpus data/stdlib-corpus --n 40 --out report.json
"""
from __future__ import annotations

import argparse
import ast
import json
import time
from pathlib import Path

from tqdm import tqdm

import oled


def function_prompts(heldout_text: str, separator: str, n: int) -> list[str]:
    """Top-level function signatures with their docstrings from held-out files, in file order."""
    prompts = []
    for source in heldout_text.split(separator):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.body:
                continue
            first = node.body[0]
            has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                and isinstance(first.value.value, str)
            end = first.end_lineno if has_doc else node.body[0].lineno - 1
            prompt = "\n".join(lines[node.lineno - 1:end]) + "\n"
            if len(prompt) < 600:
                prompts.append(prompt)
            if len(prompts) >= n:
                return prompts
    return prompts


def is_valid(prompt: str, completion: str) -> bool:
    body = completion[: completion.rfind("\n") + 1] if "\n" in completion else ""
    text = prompt + body
    candidates = [text]
    last = next((line for line in reversed(body.splitlines()) if line.strip()), None)
    indent = (len(last) - len(last.lstrip())) if last is not None else 4
    candidates += [text + " " * (indent + k) + "pass\n" for k in (0, 4)]
    for c in candidates:
        try:
            ast.parse(c)
            return True
        except SyntaxError:
            continue
    return False


def adds_body(completion: str) -> bool:
    """The completion's complete lines include an indented statement that is not a comment (a real body line)."""
    lines = completion[: completion.rfind("\n") + 1].splitlines()
    return any(line.startswith((" ", "\t")) and line.strip() and not line.strip().startswith("#") for line in lines)


def generation_report(model_dir: str | None, heldout_path: str, n: int = 40, gen_length: int = 64,
                      progress: bool = False) -> dict:
    """progress: a bar over the prompts on stderr (the whole report takes minutes on a CPU)."""
    llm = oled.LLM(model_dir, policy="full")
    prompts = function_prompts(Path(heldout_path).read_text(), "<|endoftext|>", n)
    block = llm.engine.config.block_length
    rows, t0 = [], time.perf_counter()
    for prompt in tqdm(prompts, desc="generation report", unit="prompt", disable=not progress):
        first_block: list[str] = []

        def on_block(text, new_ids, finished, first_block=first_block):
            if not first_block:
                first_block.append(text)

        out = llm.generate(prompt, gen_length=gen_length, block_length=block, threshold=0.95, on_block=on_block)
        first = first_block[0] if first_block else out.text
        rows.append({"prompt": prompt, "completion": out.text, "first_block": first,
                     "valid_first_block": is_valid(prompt, first), "valid_full": is_valid(prompt, out.text),
                     "adds_body": adds_body(first),
                     "finish_reason": out.finish_reason, "tokens_per_forward": out.counters["tokens_per_forward"]})
    valid = sum(r["valid_first_block"] for r in rows)
    return {"model": model_dir or "bundled tiny model", "prompts": len(rows), "gen_length": gen_length,
            "valid_first_block_fraction": valid / max(len(rows), 1),
            "valid_full_fraction": sum(r["valid_full"] for r in rows) / max(len(rows), 1),
            # stricter: valid AND the first block adds a body statement (not only comments, blank lines or a new def)
            "adds_body_fraction": sum(r["adds_body"] for r in rows) / max(len(rows), 1),
            "valid_with_body_fraction": sum(r["valid_first_block"] and r["adds_body"] for r in rows) / max(len(rows), 1),
            "eos_fraction": sum(r["finish_reason"] == "stop" for r in rows) / max(len(rows), 1),
            "mean_tokens_per_forward": sum(r["tokens_per_forward"] for r in rows) / max(len(rows), 1),
            "wall_s": time.perf_counter() - t0, "samples": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the bundled tiny model)")
    ap.add_argument("--corpus", required=True, help="corpus directory holding heldout.txt")
    ap.add_argument("--n", type=int, default=40, help="held-out functions to complete")
    ap.add_argument("--gen-length", type=int, default=64, help="tokens to generate per function")
    ap.add_argument("--out", help="write the report as JSON")
    args = ap.parse_args(argv)
    rep = generation_report(args.model, str(Path(args.corpus) / "heldout.txt"), args.n, args.gen_length,
                            progress=True)
    print(f"{rep['prompts']} held-out functions: first block valid Python {rep['valid_first_block_fraction']:.1%} "
          f"(adds a body statement {rep['adds_body_fraction']:.1%}, valid with one {rep['valid_with_body_fraction']:.1%}), "
          f"whole completion {rep['valid_full_fraction']:.1%}, EOS {rep['eos_fraction']:.1%}, "
          f"{rep['mean_tokens_per_forward']:.2f} tokens/forward ({rep['wall_s']:.0f} s)")
    for r in rep["samples"][:3]:
        print("-" * 60 + "\n" + r["prompt"] + r["completion"][:300])
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
