"""CPU SwiGLU expert kernel: computes "missed" experts on the CPU while the GPU computes the others.

The C source (oled/kernels/cpu_swiglu.c) is compiled on first use with the system compiler and cached under
~/.cache/oled/kernels/<hash of source, flags and compiler>/ and loaded through ctypes. Its worker threads are the
library's own: `submit` starts a batch and returns, so the engine's main thread goes on launching GPU work while
the batch runs, and waits for it (without the GIL) only when it needs the outputs.

The kernel's knobs are CpuExpertKernel's arguments, EngineConfig's cpu_* fields and the CLI's --cpu-* flags:
worker count, instruction set (auto / avx512_bf16 / portable), the token count from which AMX is used, pinning, the
idle spin, work chunks per worker, and the software prefetch of the next weight rows (AVX-512 path) and its distance
in 64-byte columns (AMX path). Building it reads the environment: OLED_KERNEL_CACHE (the compiled-library cache,
default ~/.cache/oled/kernels) and CC (the compiler, default cc, then gcc).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import fp8
from ..config import CPU_ISAS

log = logging.getLogger("oled")

_SRC = Path(__file__).resolve().parent.parent / "kernels" / "cpu_swiglu.c"
_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp-simd", "-fno-strict-aliasing", "-std=gnu11"]
_LIBS = ["-lpthread", "-lm"]
# Cost of one token per weight element, relative to reading that element (in 1/256; AMX jobs use an eighth): the
# work split gives a chunk of an expert with 32 tokens fewer rows than one of an expert with a single token.
_TOKEN_COST_256THS = 8
# AMX and AVX-512 both reach DRAM bandwidth at a few tokens an expert; above that AVX-512 falls behind while AMX
# keeps up (benchmarks/probes/CPU_KERNEL_NOTES.md).
_AMX_MIN_TOKENS = 4
ISAS = CPU_ISAS
# a blob's weights as the library takes them (its W_F32, W_BF16, W_FP8): by the blob's dtype, uint8 an FP8 blob
_WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, fp8.BLOB: 2}

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lib_loaded = False
_logged: set[str] = set()


def _log_once(msg: str, *args) -> None:
    key = msg % args
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


# --------------------------------------------------------------------------------------------------------------
# CPU topology


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _parse_cpu_list(s: str) -> list[int]:
    out: list[int] = []
    for part in s.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def physical_cpus() -> tuple[list[int], list[int]]:
    """(one CPU per physical core, the hyperthread siblings left over), both within this process's CPU set."""
    allowed = sorted(os.sched_getaffinity(0))
    allowed_set = set(allowed)
    seen: set[int] = set()
    cores: list[int] = []
    siblings: list[int] = []
    for c in allowed:
        if c in seen:
            siblings.append(c)
            continue
        try:
            sib = _parse_cpu_list(Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text())
        except (OSError, ValueError):
            sib = [c]
        seen.update(s for s in sib if s in allowed_set)
        cores.append(c)
    return cores, siblings


def l3_bytes() -> int:
    """Total last-level cache of the machine (sum over distinct L3 instances); 32 MiB if unknown."""
    total, seen = 0, set()
    for idx in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        try:
            key = (idx / "shared_cpu_list").read_text().strip()
            if key in seen:
                continue
            seen.add(key)
            s = (idx / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            total += int(s.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
    return total or (32 << 20)


# --------------------------------------------------------------------------------------------------------------
# build and load


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _compile(cc: str, extra: list[str]) -> Path:
    src = _SRC.read_bytes()
    flags = _FLAGS + extra
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256(src + repr((cc, flags, _LIBS, version)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("OLED_KERNEL_CACHE", Path.home() / ".cache" / "oled" / "kernels"))
    so = root / h / "liboled_cpu.so"
    if so.exists():
        return so
    try:
        (root / h).mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: build in the temp dir instead
        root = Path(tempfile.gettempdir()) / f"oled-kernels-{os.getuid()}"
        so = root / h / "liboled_cpu.so"
        if so.exists():
            return so
        (root / h).mkdir(parents=True, exist_ok=True)
    cache = root / h
    # build next to the target and rename: concurrent processes never load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cc, *flags, "-o", tmp, str(_SRC), *_LIBS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    os.replace(tmp, so)
    return so


def _load_library() -> ctypes.CDLL | None:
    """Compile (once, cached) and load the kernel library; None if no compiler works (torch fallback)."""
    global _lib, _lib_error, _lib_loaded
    with _lib_lock:
        if _lib_loaded:
            return _lib
        _lib_loaded = True
        cc = _compiler()
        if cc is None:
            _lib_error = "no C compiler found (cc, gcc, clang)"
            return None
        errors = []
        # fewer instruction sets for compilers that do not know AMX or AVX-512 BF16
        for extra in ([], ["-DOLED_NO_AMX"], ["-DOLED_NO_AMX", "-DOLED_NO_AVX512BF16"]):
            try:
                lib = ctypes.CDLL(str(_compile(cc, extra)))
                break
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                errors.append(str(e))
        else:
            _lib_error = "; ".join(errors)
            return None
        if errors:
            _lib_error = errors[0]
        P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.oled_has_avx512bf16.restype = I32
        lib.oled_compiled_fast.restype = I32
        lib.oled_has_amx.restype = I32
        lib.oled_compiled_amx.restype = I32
        lib.oled_set_pf_dist.restype = None
        lib.oled_set_pf_dist.argtypes = [I32]
        lib.oled_pool_create.restype = P
        lib.oled_pool_create.argtypes = [I32, P, I64]
        lib.oled_pool_destroy.restype = None
        lib.oled_pool_destroy.argtypes = [P]
        lib.oled_pool_last_ns.restype = I64
        lib.oled_pool_last_ns.argtypes = [P]
        lib.oled_pool_hold.restype = None
        lib.oled_pool_hold.argtypes = [P, I64]
        lib.oled_pool_pinned.restype = I32
        lib.oled_pool_pinned.argtypes = [P]
        lib.oled_set_prefetch.restype = None
        lib.oled_set_prefetch.argtypes = [I32]
        lib.oled_submit.restype = I32
        lib.oled_submit.argtypes = [P, I32, P, I32, I64, I64, I64, P, I64, P, I64, P, I32, P, I64, I64, I32]
        lib.oled_wait.restype = None
        lib.oled_wait.argtypes = [P]
        _lib = lib
        return lib


_RUN_ERRORS = {-1: "bad arguments", -2: "token index out of range", -3: "out of memory", -4: "unsupported mode"}


# --------------------------------------------------------------------------------------------------------------
# kernel


def check_knobs(isa: str, amx_min_tokens: int, spin_us: float, chunks: int, prefetch_distance: int) -> None:
    """One line naming the first knob out of range (the engine checks them before it needs a kernel)."""
    if isa not in ISAS:
        raise ValueError(f"cpu_isa must be one of {', '.join(ISAS)}, got {isa!r}")
    for name, value, least in (("cpu_amx_min_tokens", amx_min_tokens, 0), ("cpu_chunks", chunks, 1),
                               ("cpu_prefetch_distance", prefetch_distance, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if not isinstance(spin_us, (int, float)) or not 0 <= spin_us < float("inf"):
        raise ValueError(f"cpu_spin_us must be a number of microseconds >= 0, got {spin_us!r}")


class CpuExpertKernel:
    """Computes batches of (expert, tokens) SwiGLU jobs of one MoE layer on the CPU.

    `submit` starts a batch on the library's worker threads and returns at once; its job's `wait` blocks (without
    the GIL) until the batch is done. The engine submits from its main thread and goes on launching GPU work, so no
    Python thread has to be scheduled, or to take the GIL from the main thread, for a batch to start or finish (as
    one had to until `bc874e8`, when batches ran in a Python worker thread). `run` is submit and wait. One batch is in
    flight at a time: a submit waits for the previous batch first. Calls are serialised by a lock.
    """

    name: str  # "amx" (AVX-512 BF16 + AMX for jobs with many tokens), "avx512_bf16", "portable" or "torch"
    num_threads: int

    def __init__(self, num_threads: int | None = None, isa: str = "auto", amx_min_tokens: int = _AMX_MIN_TOKENS,
                 pin: bool = True, spin_us: float = 50.0, chunks: int = 4, prefetch: bool = True,
                 prefetch_distance: int = 4):
        """num_threads: workers (default: the physical cores available); isa: "auto" (the fastest the CPU has),
        "avx512_bf16" (no AMX) or "portable" (plain C); amx_min_tokens: jobs with at least this many tokens use AMX
        (0: never); pin: workers pinned to the last physical cores; spin_us: how long an idle worker polls before it
        sleeps; chunks: work chunks per worker and call; prefetch / prefetch_distance: software prefetch of the
        weight tiles, this many ahead (EngineConfig's cpu_* fields)."""
        check_knobs(isa, amx_min_tokens, spin_us, chunks, prefetch_distance)
        self.knobs = dict(isa=isa, amx_min_tokens=amx_min_tokens, pin=bool(pin), spin_us=float(spin_us),
                          chunks=chunks, prefetch=bool(prefetch), prefetch_distance=prefetch_distance)
        cores, siblings = physical_cpus()
        if num_threads is None:
            num_threads = len(cores)
        self.num_threads = max(1, int(num_threads))
        self._lock = threading.Lock()
        self._pool = None
        self._inflight: CpuJob | None = None    # the batch submitted and not yet waited for
        self.cpus: list[int] = []
        lib = _load_library()
        self._lib = lib
        force_portable = isa == "portable"
        self.amx_min_tokens = 0
        if lib is None:
            self.name = "torch"
            log.warning("CPU expert kernel: torch fallback (%s)", _lib_error)
            return
        lib.oled_set_prefetch(int(bool(prefetch)))       # library-wide: one kernel per engine
        lib.oled_set_pf_dist(int(prefetch_distance))
        fast = bool(lib.oled_compiled_fast()) and bool(lib.oled_has_avx512bf16()) and "avx512_bf16" in cpu_flags()
        amx = (fast and amx_min_tokens > 0 and isa != "avx512_bf16" and {"amx_tile", "amx_bf16"} <= cpu_flags()
               and bool(lib.oled_compiled_amx()) and bool(lib.oled_has_amx()))
        self.amx_min_tokens = amx_min_tokens if amx else 0
        self.name = "portable" if not fast or force_portable else "amx" if amx else "avx512_bf16"
        self._mode = {"portable": 0, "avx512_bf16": 1, "amx": 2}[self.name]
        self._chunks = int(chunks)

        # Pin to the LAST physical cores: core 0 tends to take interrupts and the main (GPU-launching) thread.
        # More threads than cores spill onto hyperthread siblings.
        order = cores[::-1] + siblings[::-1]
        self.cpus = [order[i % len(order)] if pin and order else -1 for i in range(self.num_threads)]
        spin_ns = int(float(spin_us) * 1000)
        arr = (ctypes.c_int * self.num_threads)(*self.cpus)
        self._pool = lib.oled_pool_create(self.num_threads, arr, spin_ns)
        if not self._pool:
            raise RuntimeError("oled_pool_create failed")
        self._finalizer = weakref.finalize(self, lib.oled_pool_destroy, self._pool)
        why = "" if fast or force_portable else f" (no AVX-512 BF16: {_lib_error or 'CPU lacks avx512_bf16'})"
        _log_once("CPU expert kernel: %s%s%s, %d threads pinned to cpus %s", self.name, why,
                  f" (jobs with >= {self.amx_min_tokens} tokens)" if amx else "", self.num_threads,
                  sorted(self.cpus) if pin else "none")

    def close(self) -> None:
        """Stop the worker threads (also done at garbage collection)."""
        with self._lock:
            if self._pool is not None:
                self._wait_locked()
                self._finalizer()
                self._pool = None

    def run(self, x, token_idx, job_offsets, blobs, intermediate: int, out) -> float:
        """out[p] = down(silu(gate(x[token_idx[p]])) * up(x[token_idx[p]])) for the tokens of each job, fp32.
        Returns the kernel's own seconds (timed inside the library: not the caller's wait to run again after it).

        x [T,H] bf16/fp32; token_idx [P] int64; job_offsets [J+1] int64; blobs: J 1-D tensors gate|up|down, in
        bf16 or fp32, or FP8 blobs (uint8, oled/fp8.py; AVX-512 BF16 where present, not AMX); out [P,H] fp32. All
        contiguous CPU tensors.
        """
        return self.submit(x, token_idx, job_offsets, blobs, intermediate, out).wait()

    def submit(self, x, token_idx, job_offsets, blobs, intermediate: int, out) -> "CpuJob":
        """`run`'s batch, started without waiting for it: out is written by the time the job's `wait` returns.
        The job keeps every tensor the batch reads or writes alive until then. The torch fallback computes the batch
        here, before returning."""
        T, H = x.shape
        J = len(blobs)
        I = int(intermediate)
        P = token_idx.numel()
        if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("x must be a contiguous CPU bf16/fp32 tensor")
        if token_idx.dtype != torch.int64 or job_offsets.dtype != torch.int64:
            raise ValueError("token_idx and job_offsets must be int64")
        if job_offsets.numel() != J + 1:
            raise ValueError(f"job_offsets has {job_offsets.numel()} entries for {J} blobs")
        if out.dtype != torch.float32 or tuple(out.shape) != (P, H) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous fp32 [{P}, {H}] tensor")
        if J == 0 or P == 0:
            return CpuJob.finished(0.0)
        wdtype = blobs[0].dtype
        if wdtype not in _WEIGHT_FORMATS:
            raise ValueError(f"unsupported blob dtype {wdtype}")
        E = fp8.blob_bytes(H, I) if fp8.is_fp8_blob(blobs[0]) else 3 * I * H
        for b in blobs:
            if b.dtype != wdtype or b.numel() != E or not b.is_cpu or not b.is_contiguous():
                raise ValueError(f"each blob must be a contiguous CPU tensor of {E} {wdtype}")
        if self._lib is None:
            t0 = time.perf_counter()
            _torch_run(x, token_idx, job_offsets, blobs, I, out)
            return CpuJob.finished(time.perf_counter() - t0)
        token_idx = token_idx.contiguous()
        job_offsets = job_offsets.contiguous()
        ptrs = (ctypes.c_int64 * J)(*[b.data_ptr() for b in blobs])
        # fp32 blobs (the engine's CPU tests) go through the portable path; FP8 blobs through AVX-512 BF16 (their
        # e4m3 bytes widened to bf16 in registers) where the kernel has it, never AMX
        mode = self._mode if wdtype == torch.bfloat16 else min(self._mode, 1) if wdtype == fp8.BLOB else 0
        with self._lock:
            if self._pool is None:
                raise RuntimeError("kernel closed")
            self._wait_locked()       # the batch before, if its caller has not waited for it
            rc = self._lib.oled_submit(
                self._pool, mode, x.data_ptr(), int(x.dtype == torch.bfloat16), T, H, I, token_idx.data_ptr(), P,
                job_offsets.data_ptr(), J, ctypes.addressof(ptrs), _WEIGHT_FORMATS[wdtype], out.data_ptr(),
                _TOKEN_COST_256THS, self.amx_min_tokens, self._chunks)
            if rc != 0:
                raise ValueError(f"CPU expert kernel: {_RUN_ERRORS.get(rc, rc)}")
            job = self._inflight = CpuJob(self, (x, token_idx, job_offsets, blobs, ptrs, out))
        return job

    def drain(self) -> None:
        """Wait for the batch in flight, if any."""
        with self._lock:
            if self._pool is not None:
                self._wait_locked()

    def _wait_locked(self) -> None:
        """Wait for the batch in flight and give its job the kernel's own seconds (the library releases the GIL)."""
        job = self._inflight
        if job is None:
            return
        self._lib.oled_wait(self._pool)
        self._inflight = None
        job.seconds, job.keep = self._lib.oled_pool_last_ns(self._pool) / 1e9, None

    def hold(self, seconds: float) -> None:
        """Keep the idle workers polling for the next `seconds` (0: let them sleep after the usual short spin). A hold
        wakes sleeping workers at once, so that their wake-up (hundreds of µs for 15 threads on a virtual machine)
        overlaps the caller's other work instead of delaying its next call: the engine calls it ahead of a layer's
        CPU job (EngineConfig.cpu_wake, runtime/manager.py). The deadline bounds the polling if a hold is never ended."""
        if self._lib is not None and self._pool is not None:
            self._lib.oled_pool_hold(self._pool, int(seconds * 1e9))

    @property
    def pinned_threads(self) -> int:
        """Workers that pinned themselves to their core (known once they have run)."""
        return self._lib.oled_pool_pinned(self._pool) if self._pool else 0


class CpuJob:
    """A batch started by CpuExpertKernel.submit. `wait()` returns the kernel's own seconds once the batch is done
    (at once if it is); until then the job keeps the batch's tensors alive."""
    __slots__ = ("kernel", "keep", "seconds")

    def __init__(self, kernel, keep):
        self.kernel, self.keep, self.seconds = kernel, keep, None

    @classmethod
    def finished(cls, seconds: float) -> "CpuJob":
        job = cls(None, None)
        job.seconds = seconds
        return job

    def wait(self) -> float:
        if self.seconds is None:        # still in flight: a job waited for by anyone has its seconds
            self.kernel.drain()
        return self.seconds


def _torch_run(x, token_idx, job_offsets, blobs, I, out) -> None:
    """Last-resort fallback when no C compiler is available."""
    H = x.shape[1]
    offs = job_offsets.tolist()
    for j, b in enumerate(blobs):
        p0, p1 = offs[j], offs[j + 1]
        if p1 == p0:
            continue
        w = fp8.dequantise_blobs(b, H, I, torch.float32) if fp8.is_fp8_blob(b) else b.float()
        g, u, d = w[: I * H].view(I, H), w[I * H : 2 * I * H].view(I, H), w[2 * I * H :].view(H, I)
        xs = x[token_idx[p0:p1]].float()
        out[p0:p1] = F.linear(F.silu(F.linear(xs, g)) * F.linear(xs, u), d)
