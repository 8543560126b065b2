"""The part of a trace a CPU replay script reads, and the expert size it counts bytes at: the replay scripts under
benchmarks/ take the same two options. A routing proxy's experts are small (48 KiB), so its traces' bytes are
rescaled to the experts `oled bench --routing` replays them on (6 MiB for LLaDA2.0-mini). The scripts that replay
policies on the mapped path also share their trace, budget, policy, capture and cost-model arguments
(add_replay_args, replay_costs). A grid on a trace (`oled bench --routing` / `--replay`) replays all its requests
unless --prompts N asks for a sample, which it states (sampled_requests)."""
from __future__ import annotations

from ..config import EngineConfig
from ..runtime.cost_model import CostModel
from .format import Trace

MIN_SAMPLE = 3      # fewer requests than this show one request's routing, not the trace's workload


def add_replay_args(ap, policies: str, budgets: str = "0.6,0.4,0.25", costs: bool = True,
                    expert_mib: bool = True) -> None:
    """The trace (positional), --budgets, --policies, --capture-slots (the engine's default), --costs when
    `costs` (for the policies that plan on the cost model), and add_selection_args' options (--expert-mib only for
    a script that counts bytes)."""
    ap.add_argument("trace")
    ap.add_argument("--budgets", default=budgets)
    ap.add_argument("--policies", default=policies)
    ap.add_argument("--capture-slots", type=int, default=EngineConfig.capture_slots)
    if costs:
        ap.add_argument("--costs", help="a cost model's JSON or an `oled bench` results.jsonl carrying one (for "
                                        "the policies that plan on it)")
    add_selection_args(ap, expert_mib=expert_mib)


def replay_costs(path):
    """--costs: the cost model it names, or None without it."""
    return None if path is None else CostModel.from_file(path)


def add_selection_args(ap, size_default: str = "the trace's", expert_mib: bool = True) -> None:
    """--requests N and (with expert_mib) --expert-mib M on an argparse parser."""
    ap.add_argument("--requests", type=int, help="only the trace's first N requests (oled bench --prompts N)")
    if expert_mib:
        ap.add_argument("--expert-mib", type=float, help=f"expert size for the bytes (default: {size_default})")


def selected_trace(path, requests: int | None) -> Trace:
    """The trace at `path`, cut to its first `requests` requests when given."""
    trace = Trace.load(path)
    return trace if requests is None else trace.first_requests(requests)


def expert_bytes(expert_mib: float | None, default: int) -> int:
    """--expert-mib in bytes, or `default` without it."""
    return default if expert_mib is None else int(expert_mib * 2**20)


def sampled_requests(total: int, prompts: int | None) -> tuple[int, str | None]:
    """How many of a trace's `total` requests a grid replays: all, unless `prompts` (--prompts N) asks for fewer;
    and then the sentence that states the sample (None for all)."""
    if prompts is None or prompts >= total:
        return total, None
    if prompts < 1:
        raise ValueError(f"--prompts {prompts}: a grid on a trace replays at least one of its requests")
    note = f"a sample of the trace's requests: the first {prompts} of {total}"
    if prompts < MIN_SAMPLE:
        note += f" (fewer than {MIN_SAMPLE}: the routing of {'one request' if prompts == 1 else 'two requests'}, " \
                "not the trace's workload)"
    return prompts, note
