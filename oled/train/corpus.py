"""Training data without downloads: the Python sources of this machine's standard library.

``build_corpus(out_dir)`` selects ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` (no ``site-packages``,
``test``/``tests``, ``idlelib``, ``lib2to3``, ``turtledemo``, ``ensurepip``; no file over 200 KB, not UTF-8, or
containing a special-token string), splits them train / held-out by a hash of the relative path (about 5 % held
out), and writes into ``out_dir``:

- ``train.txt`` / ``heldout.txt``: the files of each split in path order, each followed by ``<|endoftext|>``;
- ``manifest.json``: the exact selection (relative path, sha256, bytes, split) and the Python version;
- ``tokenizer.json``: byte-level BPE trained on the train split (``tokenizer_train``);
- ``train_ids.npy`` / ``heldout_ids.npy``: the token ids (uint16) of the two splits, EOS after every file.

The training host needs only this directory (``python -m oled.train.tiny --corpus DIR``).

CLI: ``python -m oled.train.corpus --out data/stdlib-corpus [--vocab-size 6144]``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from .tokenizer_train import EOS_TOKEN, SPECIAL_TOKENS, load_tokenizer, train_tokenizer

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                           "ensurepip", "__pycache__"})
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 5
MANIFEST_NAME = "manifest.json"


def split_of(rel_path: str, heldout_percent: int = HELDOUT_PERCENT) -> str:
    """Deterministic split: the first 8 hex digits of sha256(relative path), mod 100, below heldout_percent."""
    h = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16)
    return "heldout" if h % 100 < heldout_percent else "train"


def select_files(root: str | Path | None = None, max_file_bytes: int = MAX_FILE_BYTES):
    """Yield (relative path, text, raw bytes) of the selected stdlib files, sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name))
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if len(raw) > max_file_bytes or not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if any(tok in text for tok in SPECIAL_TOKENS):
            continue
        yield rel, text, raw


def encode_docs(tokenizer, docs: list[str], eos_id: int) -> np.ndarray:
    """Token ids of the documents, each followed by EOS, as one uint16 (or int32 for large vocabularies) array."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 65535 else np.int32
    parts = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def build_corpus(out_dir: str | Path, *, vocab_size: int = 6144, heldout_percent: int = HELDOUT_PERCENT,
                 max_total_bytes: int = 30_000_000, root: str | Path | None = None,
                 tokenize: bool = True, verbose: bool = True) -> dict:
    """Write train/held-out text, manifest, tokenizer and token ids into out_dir; returns the manifest."""
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(root or sysconfig.get_paths()["stdlib"])
    entries, docs = [], {"train": [], "heldout": []}
    total = 0
    for rel, text, raw in select_files(stdlib):
        if total + len(raw) > max_total_bytes:
            continue
        total += len(raw)
        split = split_of(rel, heldout_percent)
        entries.append({"path": rel, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "split": split})
        docs[split].append(text)
    for split, name in (("train", "train.txt"), ("heldout", "heldout.txt")):
        with open(out / name, "w", encoding="utf-8", newline="") as f:
            for text in docs[split]:
                f.write(text)
                f.write(EOS_TOKEN)
    manifest = {
        "source": "python standard library",
        "python_version": sys.version,
        "python_implementation": platform.python_implementation(),
        "stdlib_root": str(stdlib),
        "selection": {"glob": "*.py", "excluded_dirs": sorted(EXCLUDED_DIRS), "max_file_bytes": MAX_FILE_BYTES,
                      "utf8_only": True, "max_total_bytes": max_total_bytes,
                      "split_rule": f"int(sha256(relpath)[:8], 16) % 100 < {heldout_percent} -> heldout"},
        "separator": EOS_TOKEN,
        "counts": {s: {"files": len(docs[s]), "bytes": sum(e["bytes"] for e in entries if e["split"] == s)}
                   for s in docs},
        "files": entries,
    }
    if tokenize:
        tok = train_tokenizer(docs["train"], vocab_size=vocab_size, out_path=out / "tokenizer.json")
        eos_id = tok.token_to_id(EOS_TOKEN)
        for split in docs:
            ids = encode_docs(tok, docs[split], eos_id)
            np.save(out / f"{split}_ids.npy", ids)
            manifest["counts"][split]["tokens"] = int(ids.size)
        manifest["tokenizer"] = {"file": "tokenizer.json", "vocab_size": tok.get_vocab_size(), "type": "byte-level BPE"}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    if verbose:
        c = manifest["counts"]
        print(f"corpus: {c['train']['files']} train files ({c['train']['bytes'] / 1e6:.2f} MB"
              f"{', %d tokens' % c['train']['tokens'] if tokenize else ''}), {c['heldout']['files']} held-out "
              f"({c['heldout']['bytes'] / 1e6:.2f} MB{', %d tokens' % c['heldout']['tokens'] if tokenize else ''})"
              f" -> {out} in {time.time() - t0:.1f}s", flush=True)
    return manifest


def load_corpus_ids(corpus_dir: str | Path, vocab_size: int = 6144):
    """(tokenizer, train ids, held-out ids) of a corpus directory; trains the tokenizer / tokenizes when missing."""
    d = Path(corpus_dir)
    tok_path = d / "tokenizer.json"
    if not tok_path.is_file():
        texts = (d / "train.txt").read_text(encoding="utf-8").split(EOS_TOKEN)
        train_tokenizer([t for t in texts if t], vocab_size=vocab_size, out_path=tok_path)
    tok = load_tokenizer(tok_path)
    eos_id = tok.token_to_id(EOS_TOKEN)
    arrays = []
    for split in ("train", "heldout"):
        npy = d / f"{split}_ids.npy"
        if npy.is_file():
            arrays.append(np.load(npy))
        else:
            texts = (d / f"{split}.txt").read_text(encoding="utf-8").split(EOS_TOKEN)
            arrays.append(encode_docs(tok, [t for t in texts if t], eos_id))
    return tok, arrays[0], arrays[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--heldout-percent", type=int, default=HELDOUT_PERCENT)
    p.add_argument("--max-total-mb", type=float, default=30.0)
    p.add_argument("--no-tokenize", action="store_true")
    a = p.parse_args(argv)
    build_corpus(a.out, vocab_size=a.vocab_size, heldout_percent=a.heldout_percent,
                 max_total_bytes=int(a.max_total_mb * 1e6), tokenize=not a.no_tokenize)
    return 0


if __name__ == "__main__":
    sys.exit(main())
