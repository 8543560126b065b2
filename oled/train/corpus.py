"""Training data without downloads: the Python sources of this machine's standard library.

``build_corpus(out_dir)`` selects ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` (no ``site-packages``,
``test``/``tests``, ``idlelib``, ``lib2to3``, ``turtledemo``, ``ensurepip``; no file over 200 KB, not UTF-8, or
containing a special-token string), splits them train / held-out by a hash of the relative path (about 5 % held
out), and writes into ``out_dir``:

- ``train.txt`` / ``heldout.txt``: the files of each split in path order, each followed by ``<|endoftext|>``
  (``.txt.gz`` with ``--gzip``: a quarter of the size, for a corpus that has to travel);
- ``manifest.json``: the exact selection (relative path, sha256, bytes, split) and the Python version;
- ``tokenizer.json``: byte-level BPE trained on the train split (``tokenizer_train``), or a copy of ``--tokenizer``;
- ``train_ids.npy`` / ``heldout_ids.npy``: the token ids (uint16) of the two splits, EOS after every file (not with
  ``--no-tokenize``: the trainer then tokenizes the text when it loads it).

The training host needs only this directory (``python -m oled.train.tiny --corpus DIR``).

CLI: ``python -m oled.train.corpus --out data/stdlib-corpus [--vocab-size 6144]``; the routing proxy's corpus
(the bundled model's data and tokenizer, small enough to carry): ``python -m oled.train.corpus --out
data/proxy-corpus --no-tokenize --gzip --tokenizer oled/assets/tiny-model/tokenizer.json``.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import shutil
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


def _text_path(corpus_dir: Path, split: str, compressed: bool) -> Path:
    return corpus_dir / f"{split}.txt{'.gz' if compressed else ''}"


def _open_text(corpus_dir: Path, split: str, mode: str = "r", compressed: bool | None = None):
    """A split's text file, plain or gzipped (compressed=None: whichever the directory has)."""
    if compressed is None:
        compressed = not _text_path(corpus_dir, split, False).is_file()
    path = _text_path(corpus_dir, split, compressed)
    return (gzip.open if compressed else open)(path, mode + "t", encoding="utf-8", newline="")


def read_documents(corpus_dir: str | Path, split: str) -> list[str]:
    """The documents of a split's text (train.txt or train.txt.gz), without their separators."""
    with _open_text(Path(corpus_dir), split) as f:
        return [t for t in f.read().split(EOS_TOKEN) if t]


def build_corpus(out_dir: str | Path, *, vocab_size: int = 6144, heldout_percent: int = HELDOUT_PERCENT,
                 max_total_bytes: int = 30_000_000, root: str | Path | None = None,
                 tokenize: bool = True, compress: bool = False, tokenizer: str | Path | None = None,
                 verbose: bool = True) -> dict:
    """Write train/held-out text (gzipped with compress), manifest, tokenizer (trained, or a copy of `tokenizer`)
    and token ids (with tokenize) into out_dir; returns the manifest."""
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
    for split in ("train", "heldout"):
        with _open_text(out, split, "w", compressed=compress) as f:
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
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        manifest["tokenizer"] = {"file": "tokenizer.json", "copied_from": str(tokenizer)}
    if tokenize:
        tok = (load_tokenizer(out / "tokenizer.json") if tokenizer is not None else
               train_tokenizer(docs["train"], vocab_size=vocab_size, out_path=out / "tokenizer.json"))
        eos_id = tok.token_to_id(EOS_TOKEN)
        for split in docs:
            ids = encode_docs(tok, docs[split], eos_id)
            np.save(out / f"{split}_ids.npy", ids)
            manifest["counts"][split]["tokens"] = int(ids.size)
        manifest["tokenizer"] = dict(manifest.get("tokenizer", {}), file="tokenizer.json",
                                     vocab_size=tok.get_vocab_size(), type="byte-level BPE")
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
        train_tokenizer(read_documents(d, "train"), vocab_size=vocab_size, out_path=tok_path)
    tok = load_tokenizer(tok_path)
    eos_id = tok.token_to_id(EOS_TOKEN)
    arrays = []
    for split in ("train", "heldout"):
        npy = d / f"{split}_ids.npy"
        if npy.is_file():
            arrays.append(np.load(npy))
        else:
            arrays.append(encode_docs(tok, read_documents(d, split), eos_id))
    return tok, arrays[0], arrays[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--heldout-percent", type=int, default=HELDOUT_PERCENT)
    p.add_argument("--max-total-mb", type=float, default=30.0)
    p.add_argument("--no-tokenize", action="store_true", help="no token ids (the trainer tokenizes on loading)")
    p.add_argument("--gzip", action="store_true", help="write the text gzipped (train.txt.gz, heldout.txt.gz)")
    p.add_argument("--tokenizer", metavar="FILE", help="copy this tokenizer.json instead of training one")
    a = p.parse_args(argv)
    if a.tokenizer and not Path(a.tokenizer).is_file():
        p.error(f"--tokenizer {a.tokenizer}: no such file")
    build_corpus(a.out, vocab_size=a.vocab_size, heldout_percent=a.heldout_percent,
                 max_total_bytes=int(a.max_total_mb * 1e6), tokenize=not a.no_tokenize, compress=a.gzip,
                 tokenizer=a.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
