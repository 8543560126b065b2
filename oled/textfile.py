"""Reading a text file the user named (prompts, workloads, popularity): a directory or binary content is refused
in one line that names the file and what it was given as."""
from __future__ import annotations

import gzip
from pathlib import Path


def read_text(path: str | Path, what: str) -> str:
    """The file's UTF-8 text; ValueError naming `what` (e.g. "--prompts-file") and the path for a directory or
    binary content. A missing file raises FileNotFoundError, so that callers can add how to make it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a directory; give a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                         f"{e.start})") from None


def read_results(path: str | Path) -> str:
    """A result file's text (committed results are kept gzipped): `path` itself, gunzipped if its name ends in .gz,
    else, if it is missing, its gzipped copy path + ".gz". FileNotFoundError names `path` when neither exists."""
    path = Path(path)
    zipped = path if path.suffix == ".gz" else path.with_name(path.name + ".gz")
    if path.suffix != ".gz" and path.is_file():
        return path.read_text()
    if zipped.is_file():
        return gzip.decompress(zipped.read_bytes()).decode()
    raise FileNotFoundError(f"{path}: no such file" + ("" if path.suffix == ".gz" else f" (nor {zipped.name})"))
