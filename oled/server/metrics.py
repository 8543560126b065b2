"""Server metrics in the Prometheus text format (no client library: a few counters, gauges and histograms).

Expert counters come from the engine's per-forward records (`ExpertManager.stats`), summed per forward kind
("prefill", "iteration", "cache_fill"); the hit rate gauge uses the iteration forwards, like `oled generate`.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

from ..runtime.stats import COUNTERS

TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
EXPERT_COUNTERS = {"pairs": "token-expert pairs routed", "pairs_hit": "pairs served by resident experts",
                   "pairs_cpu": "pairs computed on the CPU", "loads": "expert loads (H2D copies)",
                   "prefetches": "speculative expert loads", "bytes_h2d": "bytes copied host to device"}


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.9g}")
        out.append(f"{name}_count {self.count}")
        return out


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.start_time = time.time()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)      # (endpoint, status) -> count
        self.finished: dict[str, int] = defaultdict(int)                   # finish reason -> generations
        self.cancelled = 0                                                  # requests cancelled (client gone)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.nfe = 0
        self.cache_forwards = 0
        self.expert: dict[tuple[str, str], int] = defaultdict(int)         # (counter, kind) -> total
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)

    # ------------------------------------------------------------------------------------------------ record
    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def record_generation(self, result, prompt_tokens: int, records, finish_reason: str) -> None:
        """One prompt's generation: the loop's GenerationResult and the expert records of its forwards."""
        with self.lock:
            self.finished[finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += len(result.token_ids)
            self.nfe += result.nfe
            self.cache_forwards += result.cache_forwards
            if result.token_ids and finish_reason != "cancelled":
                self.tpot.observe(result.tpot_s)
            for r in records:
                for c in EXPERT_COUNTERS:
                    self.expert[(c, r.kind)] += getattr(r, c)

    def record_request(self, queue_s: float, total_s: float, cancelled: bool) -> None:
        with self.lock:
            self.queue_wait.observe(queue_s)
            if cancelled:
                self.cancelled += 1
            else:
                self.latency.observe(total_s)

    # ------------------------------------------------------------------------------------------------ render
    def render(self, engine, queue_depth: int, running: int, max_queue: int) -> str:
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        with self.lock:
            metric("oled_info", "gauge", "the served model and engine settings",
                   [f'oled_info{{model="{_label(engine.model_name)}",policy="{_label(engine.policy.name)}",'
                    f'device="{_label(engine.device)}",dtype="{_label(str(engine.dtype).replace("torch.", ""))}"}} 1'])
            metric("oled_uptime_seconds", "gauge", "seconds since the server started",
                   [f"oled_uptime_seconds {time.time() - self.start_time:.3f}"])
            metric("oled_requests_total", "counter", "HTTP requests by endpoint and status code",
                   [f'oled_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())])
            metric("oled_requests_cancelled_total", "counter", "generation requests cancelled by a disconnected client",
                   [f"oled_requests_cancelled_total {self.cancelled}"])
            metric("oled_generations_total", "counter", "generations (one per prompt) by finish reason",
                   [f'oled_generations_total{{finish_reason="{_label(r)}"}} {n}'
                    for r, n in sorted(self.finished.items())])
            metric("oled_queue_depth", "gauge", "requests waiting for the engine",
                   [f"oled_queue_depth {queue_depth}"])
            metric("oled_queue_limit", "gauge", "requests that may wait before the server answers 429",
                   [f"oled_queue_limit {max_queue}"])
            metric("oled_requests_running", "gauge", "requests the engine is decoding (batch 1: 0 or 1)",
                   [f"oled_requests_running {running}"])
            metric("oled_prompt_tokens_total", "counter", "prompt tokens processed",
                   [f"oled_prompt_tokens_total {self.prompt_tokens}"])
            metric("oled_generation_tokens_total", "counter", "tokens generated (EOS included)",
                   [f"oled_generation_tokens_total {self.generation_tokens}"])
            metric("oled_forwards_total", "counter", "model forwards by kind (denoising iterations, cache fills)",
                   [f'oled_forwards_total{{kind="iteration"}} {self.nfe}',
                    f'oled_forwards_total{{kind="cache"}} {self.cache_forwards}'])
            metric("oled_tpot_seconds", "histogram", "decode time per output token of each generation",
                   self.tpot.lines("oled_tpot_seconds"))
            metric("oled_request_duration_seconds", "histogram", "time from arrival to the last token",
                   self.latency.lines("oled_request_duration_seconds"))
            metric("oled_queue_wait_seconds", "histogram", "time a request waited for the engine",
                   self.queue_wait.lines("oled_queue_wait_seconds"))
            kinds = sorted({k for (_, k) in self.expert}) or ["iteration"]
            for c, help_ in EXPERT_COUNTERS.items():
                name = "oled_h2d_bytes_total" if c == "bytes_h2d" else f"oled_expert_{c}_total"
                metric(name, "counter", f"{help_}, by forward kind",
                       [f'{name}{{kind="{k}"}} {self.expert.get((c, k), 0)}' for k in kinds])
            pairs = self.expert.get(("pairs", "iteration"), 0)
            hit = self.expert.get(("pairs_hit", "iteration"), 0) / pairs if pairs else 0.0
            metric("oled_expert_hit_rate", "gauge",
                   "share of token-expert pairs of denoising iterations served by resident experts",
                   [f"oled_expert_hit_rate {hit:.6f}"])
        budget = engine.budget
        metric("oled_expert_cache_bytes", "gauge", "device memory reserved for routed experts",
               [f"oled_expert_cache_bytes {int(budget.bytes)}"])
        allocated = reserved = total = 0
        if engine.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(engine.device)
            reserved = torch.cuda.memory_reserved(engine.device)
            total = torch.cuda.get_device_properties(engine.device).total_memory
        metric("oled_gpu_memory_allocated_bytes", "gauge", "GPU memory allocated by tensors (0 on CPU)",
               [f"oled_gpu_memory_allocated_bytes {allocated}"])
        metric("oled_gpu_memory_reserved_bytes", "gauge", "GPU memory reserved by the caching allocator (0 on CPU)",
               [f"oled_gpu_memory_reserved_bytes {reserved}"])
        metric("oled_gpu_memory_total_bytes", "gauge", "GPU memory of the device (0 on CPU)",
               [f"oled_gpu_memory_total_bytes {total}"])
        return "\n".join(lines) + "\n"


assert set(EXPERT_COUNTERS) <= set(COUNTERS)
