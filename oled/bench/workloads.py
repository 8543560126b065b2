"""Benchmark workloads: small prompt sets shipped with the project, plus synthetic prompts of a given length.

Named workloads are JSON Lines files under oled/data/workloads/ (NAME.jsonl). The first line is a header object
({"_header": true, "workload", "description", "provenance", "written_by", "date", "purpose", "format"}); each
following line is one prompt:
  {"id", "prompt": TEXT}                 plain completion (the text goes to the tokenizer as is)
  {"id", "messages": [{role, content}]}  chat (rendered with the model's chat template)
  {"id", "document": NAME, "question"}   long context: one user message "<document text>\\n\\nQuestion: ..."
                                         (documents are lines {"document": NAME, "text": TEXT} of the same file)
A path to a file in this format works wherever a name does.

`synthetic:LEN` (or `synthetic:LEN:N`) gives N (default 8) prompts of exactly LEN tokens, deterministically: the
shipped workloads' texts are tokenized with the model's tokenizer, concatenated, and prompt i is the LEN tokens
starting at offset i * 997 (wrapping around).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..textfile import read_text
from ..tokenizer import Tokenizer

WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "data" / "workloads"
ALIASES = {"long-context": "long", "longcontext": "long", "gsm": "math"}
SYNTHETIC_PROMPTS = 8
SYNTHETIC_STRIDE = 997


@dataclass
class Prompt:
    id: str
    prompt: str | None = None                  # text for the tokenizer (chat template already applied)
    token_ids: list[int] | None = None         # synthetic prompts: the ids themselves
    messages: list[dict] | None = None         # chat prompts: the messages (tokenized with the template)

    def ids(self, tokenizer) -> list[int]:
        if self.token_ids is not None:
            return list(self.token_ids)
        # the template's markers are special tokens, the messages' contents and a plain prompt text
        return tokenizer.chat_ids(self.messages) if self.messages is not None else tokenizer.encode(self.prompt)


@dataclass
class Workload:
    name: str
    source: str
    prompts: list[Prompt]
    provenance: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "num_prompts": len(self.prompts),
                "prompt_ids": [p.id for p in self.prompts], "provenance": self.provenance}


def available() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.jsonl")) + ["synthetic:LEN"]


def _chat(messages: list[dict]) -> str:
    return Tokenizer.chat_prompt(messages)


def read_file(path: Path, name: str | None = None) -> Workload:
    lines = []
    for number, line in enumerate(read_text(path, "workload file").splitlines(), 1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"workload file {str(path)!r} line {number}: not JSON ({e})") from None
    if not lines or not lines[0].get("_header"):
        raise ValueError(f"workload file {path}: the first line must be a header object with \"_header\": true and "
                         f"the provenance (see oled/bench/workloads.py)")
    header = {k: v for k, v in lines[0].items() if k != "_header"}
    documents = {d["document"]: d["text"] for d in lines[1:] if "text" in d and "document" in d}
    prompts = []
    for i, obj in enumerate(lines[1:], start=2):
        if "text" in obj and "document" in obj:
            continue
        pid = str(obj.get("id", f"{path.stem}-{i - 1:02d}"))
        if "prompt" in obj:
            prompts.append(Prompt(pid, prompt=obj["prompt"]))
        elif "messages" in obj:
            prompts.append(Prompt(pid, prompt=_chat(obj["messages"]), messages=obj["messages"]))
        elif "document" in obj and "question" in obj:
            if obj["document"] not in documents:
                raise ValueError(f"workload file {path}, line {i}: unknown document {obj['document']!r}")
            messages = [{"role": "user", "content": f"{documents[obj['document']]}\n\nQuestion: {obj['question']}"}]
            prompts.append(Prompt(pid, prompt=_chat(messages), messages=messages))
        else:
            raise ValueError(f"workload file {path}, line {i}: expected prompt, messages or document+question")
    if not prompts:
        raise ValueError(f"workload file {path} has no prompts")
    return Workload(name or header.get("workload", path.stem), str(path), prompts, header)


def _corpus_texts() -> list[str]:
    texts = []
    for path in sorted(WORKLOAD_DIR.glob("*.jsonl")):
        for line in path.read_text().splitlines()[1:]:
            obj = json.loads(line)
            if "text" in obj:
                texts.append(obj["text"])
            elif "prompt" in obj:
                texts.append(obj["prompt"])
            elif "messages" in obj:
                texts.extend(m.get("content", "") for m in obj["messages"])
            elif "question" in obj:
                texts.append(obj["question"])
    return texts


def synthetic(length: int, count: int, tokenizer) -> Workload:
    if length < 1 or count < 1:
        raise ValueError(f"synthetic workload: length and count must be positive, got {length} and {count}")
    ids: list[int] = []
    for text in _corpus_texts():
        ids.extend(tokenizer.encode(text + "\n\n"))
    prompts = []
    for i in range(count):
        start = (i * SYNTHETIC_STRIDE) % len(ids)
        reps = (start + length) // len(ids) + 1
        prompts.append(Prompt(f"synthetic-{length}-{i:02d}", token_ids=(ids * (reps + 1))[start: start + length]))
    name = f"synthetic:{length}" + (f":{count}" if count != SYNTHETIC_PROMPTS else "")
    return Workload(name, name, prompts, {
        "description": f"{count} prompts of exactly {length} tokens cut from the shipped workloads' texts",
        "provenance": "generated deterministically from oled/data/workloads/*.jsonl (written by the project)",
        "purpose": "controlled prompt lengths (prefill size, context length)"})


def load(name: str, tokenizer=None, limit: int | None = None) -> Workload:
    """A shipped workload by name (code, math, chat, long), a JSONL file path, or synthetic:LEN[:N]."""
    if name.startswith("synthetic:"):
        parts = name.split(":")
        try:
            length = int(parts[1])
            count = int(parts[2]) if len(parts) > 2 else SYNTHETIC_PROMPTS
        except (IndexError, ValueError):
            raise ValueError(f"workload {name!r}: expected synthetic:LEN or synthetic:LEN:N") from None
        if tokenizer is None:
            raise ValueError(f"workload {name!r} is made of token ids and needs the model's tokenizer")
        wl = synthetic(length, count, tokenizer)
    else:
        path = WORKLOAD_DIR / f"{ALIASES.get(name, name)}.jsonl"
        if not path.is_file():
            path = Path(name)
            if not path.is_file():
                raise ValueError(f"unknown workload {name!r}; choose from {', '.join(available())} or give a .jsonl "
                                 f"file")
            wl = read_file(path)
        else:
            wl = read_file(path, ALIASES.get(name, name))
    if limit is not None:
        wl.prompts = wl.prompts[:limit]
    return wl


def load_prompts(name: str, tokenizer=None) -> list[Prompt]:
    """The prompts of a workload (each has .id and .prompt, the text with any chat template applied)."""
    return load(name, tokenizer).prompts
