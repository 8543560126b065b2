"""The README's main job on a machine whose cores are busy with other work, against the same job on idle cores.

Issue 16: with both cores of a 2-core machine busy, torch's default intra-op threads (one per core) spun against
the load and the main job took 610 ms per token instead of 47. The engine now sizes torch's threads together with
the CPU expert kernel's (oled/runtime/threads.py); this measures the default against `--torch-threads N`.

    python benchmarks/busy_cores.py --repeats 5          # the engine's default threads
    python benchmarks/busy_cores.py --compare            # also --torch-threads <cores>, torch's own default
    python benchmarks/busy_cores.py --extra --policy tide --expert-budget 0.4

The load is one Python busy loop per core in this process's CPU set (or --busy N), started for each loaded run and
ending by itself after --load-seconds even if this script is killed; idle and loaded runs alternate. TPOT is the
job's own figure (decode time / generated tokens). The load-average column shows load from outside the script.
The control row times a fixed single-threaded torch loop the same way: the slowdown the machine itself gives one
thread under this load, which the engine's ratio is to be read against.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MAIN_JOB = ["generate", "def fibonacci(n):", "--gen-length", "64", "--json"]
BUSY_LOOP = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"
LOAD_START_S = 0.5          # lets the busy loops reach full speed before the job starts


# The control: a fixed single-threaded torch workload, to tell the machine's own slowdown under the load (its
# scheduler, SMT siblings on a virtual machine) from what the engine adds. Prints its wall time in ms.
CONTROL = ("import time, torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nt = time.perf_counter()\n"
           "for _ in range(3000):\n    a @ a\nprint((time.perf_counter() - t) * 1e3)\n")


def tpot_ms(extra: list[str]) -> float:
    cli = "import sys; from oled.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", cli, *MAIN_JOB, *extra], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["counters"]["tpot_s"] * 1e3


def control_ms(_extra: list[str]) -> float:
    return float(subprocess.run([sys.executable, "-c", CONTROL], capture_output=True, text=True, check=True).stdout)


def busy_run(job, extra: list[str], busy: int, load_seconds: float) -> float:
    """One run of job(extra) with `busy` busy loops running throughout."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(load_seconds)]) for _ in range(busy)]
    try:
        time.sleep(LOAD_START_S)
        return job(extra)
    finally:
        for p in loops:
            p.terminate()
            p.wait()


def measure(job, extra: list[str], repeats: int, busy: int, load_seconds: float) -> tuple[float, float]:
    """Median idle and busy figure of job(extra), the runs interleaved (idle, busy, idle, ...) so that load from
    outside this script drifts into both alike."""
    idle, loaded = [], []
    for _ in range(repeats):
        idle.append(job(extra))
        loaded.append(busy_run(job, extra, busy, load_seconds))
    return statistics.median(idle), statistics.median(loaded)


def main() -> int:
    cores = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--busy", type=int, default=cores, help="busy loops while loaded")
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting (median)")
    ap.add_argument("--load-seconds", type=float, default=300.0, help="each busy loop ends by itself after this")
    ap.add_argument("--compare", action="store_true",
                    help=f"also run with --torch-threads {cores} (torch's own default: one thread per core)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more flags for the job")
    args = ap.parse_args()
    settings = [("default threads", [])]
    if args.compare:
        settings.append((f"--torch-threads {cores}", ["--torch-threads", str(cores)]))
    print(f"{cores} CPUs; main job: oled {' '.join(MAIN_JOB)} {' '.join(args.extra)}; median of {args.repeats}")
    print(f"{'setting':<28} {'idle ms':>9} {'busy ms':>9} {'busy / idle':>12} {'load avg':>9}")
    rows = [(name, tpot_ms, flags + args.extra) for name, flags in settings]
    rows.append(("control: 1-thread torch loop", control_ms, []))
    for name, job, extra in rows:
        load = os.getloadavg()[0]            # 1-minute load before the setting: shows load from outside
        idle, busy = measure(job, extra, args.repeats, args.busy, args.load_seconds)
        print(f"{name:<28} {idle:9.1f} {busy:9.1f} {busy / idle:12.2f} {load:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
