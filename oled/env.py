"""What a result line records about where it ran: git commit, hardware, library versions."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy
import torch

from . import __version__

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def peak_memory(device) -> dict:
    """The process's peak memory so far: host resident set (pinned expert store included) and, on CUDA, the most
    GPU memory torch has held allocated."""
    device = torch.device(device)
    gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "gpu_peak_allocated_bytes": gpu}


def device_label(device) -> str:
    """"CPU" for CPU runs (CPU-only figures are labelled CPU), else the GPU's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


@lru_cache(maxsize=None)
def _static_environment() -> dict:
    try:
        cpus_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus_usable = os.cpu_count()
    versions = {"oled": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "numpy": numpy.__version__, "cuda": torch.version.cuda}
    try:
        import matplotlib  # optional: the bench extra
        versions["matplotlib"] = matplotlib.__version__
    except ImportError:
        pass
    return {"git": git_info(), "platform": platform.platform(),
            "cpu": {"model": cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": cpus_usable,
                    "memory_gib": _mem_total_gib()},
            "versions": versions}


def environment(device) -> dict:
    env = dict(_static_environment())
    device = torch.device(device)
    env["device"] = str(device)
    env["oled_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OLED_")}   # cache locations (the knobs are EngineConfig fields)
    env["label"] = device_label(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                      "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
    else:
        env["gpu"] = None
    return env


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
