"""The part of a trace a CPU replay script reads, and the expert size it counts bytes at: the replay scripts under
benchmarks/ take the same two options. A routing proxy's experts are small (48 KiB), so its traces' bytes are
rescaled to the experts `oled bench --routing` replays them on (6 MiB for LLaDA2.0-mini)."""
from __future__ import annotations

from .format import Trace


def add_selection_args(ap, size_default: str = "the trace's") -> None:
    """--requests N and --expert-mib M on an argparse parser."""
    ap.add_argument("--requests", type=int, help="only the trace's first N requests (oled bench --prompts N)")
    ap.add_argument("--expert-mib", type=float, help=f"expert size for the bytes (default: {size_default})")


def selected_trace(path, requests: int | None) -> Trace:
    """The trace at `path`, cut to its first `requests` requests when given."""
    trace = Trace.load(path)
    return trace if requests is None else trace.first_requests(requests)


def expert_bytes(expert_mib: float | None, default: int) -> int:
    """--expert-mib in bytes, or `default` without it."""
    return default if expert_mib is None else int(expert_mib * 2**20)
