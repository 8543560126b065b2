"""CPU SwiGLU expert kernel: results against an fp32 torch reference, on both code paths."""

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from oled.runtime.cpu_calibration import calibrate
from oled.runtime.cpu_kernel import CpuExpertKernel, cpu_flags

HAS_BF16 = "avx512_bf16" in cpu_flags()
HAS_AMX = HAS_BF16 and {"amx_tile", "amx_bf16"} <= cpu_flags()


@pytest.fixture(scope="module")
def fast():
    k = CpuExpertKernel(num_threads=2)
    yield k
    k.close()


@pytest.fixture(scope="module")
def portable():
    k = CpuExpertKernel(num_threads=2, isa="portable")
    yield k
    k.close()


def reference(x, token_idx, job_offsets, blobs, I):
    """fp32 reference: weights upcast, torch matmuls, one job at a time."""
    H = x.shape[1]
    outs = [torch.zeros(0, H)]
    o = job_offsets.tolist()
    for j, b in enumerate(blobs):
        w = b.float()
        g, u, d = w[: I * H].view(I, H), w[I * H : 2 * I * H].view(I, H), w[2 * I * H :].view(H, I)
        xs = x[token_idx[o[j] : o[j + 1]]].float()
        outs.append(F.linear(F.silu(F.linear(xs, g)) * F.linear(xs, u), d))
    return torch.cat(outs)


def make_case(H, I, counts, dtype, x_dtype=None, T=None, gen=None):
    """Random jobs with `counts` tokens each; tokens drawn with repetition, so they repeat across jobs."""
    T = T or max(1, sum(counts))
    x = torch.randn(T, H, generator=gen).to(x_dtype or dtype)
    offs = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
    tok = torch.randint(0, T, (int(offs[-1]),), generator=gen)
    # scaled like trained weights so the activations stay O(1)
    blobs = [(torch.randn(3 * I * H, generator=gen) * H**-0.5).to(dtype) for _ in counts]
    return x, tok, offs, blobs


def run_and_check(kernel, H, I, counts, dtype, tol, x_dtype=None, T=None):
    x, tok, offs, blobs = make_case(H, I, counts, dtype, x_dtype, T)
    out = torch.full((tok.numel(), H), float("nan"))  # poison: every row must be written
    kernel.run(x, tok, offs, blobs, I, out)
    ref = reference(x, tok, offs, blobs, I)
    assert not out.isnan().any(), "output rows not fully written"
    if ref.numel():
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < tol, f"relative error {err:.2e} >= {tol} for H={H} I={I} counts={counts}"
    return out


SHAPES = [(96, 40), (64, 32), (33, 17), (2048, 512)]
COUNTS = [[1], [2], [3], [5], [8], [9], [16], [32], [1, 2, 3, 4], [32, 1, 1, 1, 1, 1], [0, 4, 0, 0, 7, 0]]


def test_fast_path_is_used_when_available(fast):
    if HAS_BF16:
        assert fast.name != "portable" and fast.name != "torch"
    if HAS_AMX:
        assert fast.name == "amx"
    assert fast.num_threads == 2


@pytest.mark.skipif(not HAS_AMX, reason="CPU without AMX")
@pytest.mark.parametrize("H,I", [(64, 32), (96, 64), (2048, 512)])
def test_amx_matches_reference(H, I):
    """AMX for every job (amx_min_tokens=1), and mixed with AVX-512 jobs (threshold 8): 1-40 tokens, 1-3 groups."""
    for amx_min in (1, 8):
        k = CpuExpertKernel(num_threads=2, amx_min_tokens=amx_min)
        assert k.name == "amx"
        for counts in ([1], [5], [16], [17], [32], [40], [33, 1, 0, 8, 2, 16]):
            run_and_check(k, H, I, counts, torch.bfloat16, 1e-2)
        run_and_check(k, H, I, [3, 20, 1], torch.bfloat16, 1e-2, x_dtype=torch.float32)
        k.close()


@pytest.mark.parametrize("H,I", SHAPES)
def test_bf16_matches_reference(fast, portable, H, I):
    counts_list = COUNTS if H < 1024 else [[1], [3], [8], [32], [32, 1, 1, 0, 2]]
    for counts in counts_list:
        a = run_and_check(fast, H, I, counts, torch.bfloat16, 1e-2)
        b = run_and_check(portable, H, I, counts, torch.bfloat16, 1e-2)
        assert a.shape == b.shape


@pytest.mark.parametrize("H,I", [(96, 40), (33, 17), (256, 64)])
def test_fp32_blobs_exact(fast, portable, H, I):
    """fp32 blobs (the engine's CPU tests) go through the fp32 path: tight tolerance on both kernels."""
    for counts in ([1], [7], [32, 1, 0, 2]):
        run_and_check(fast, H, I, counts, torch.float32, 1e-5)
        run_and_check(portable, H, I, counts, torch.float32, 1e-5)


def test_fp32_input_bf16_weights(fast, portable):
    for k in (fast, portable):
        run_and_check(k, 96, 40, [3, 1, 12], torch.bfloat16, 1e-2, x_dtype=torch.float32)


def test_fast_and_portable_agree(fast, portable):
    x, tok, offs, blobs = make_case(160, 72, [4, 0, 19, 1], torch.bfloat16)
    a, b = torch.empty(tok.numel(), 160), torch.empty(tok.numel(), 160)
    fast.run(x, tok, offs, blobs, 72, a)
    portable.run(x, tok, offs, blobs, 72, b)
    assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_duplicate_tokens_and_rows(fast):
    """The same token in several jobs and twice in one job: each output row is its own (job, token) result."""
    H, I = 64, 48
    x, _, _, blobs = make_case(H, I, [3, 3], torch.bfloat16, T=4)
    tok = torch.tensor([1, 1, 2, 1, 3, 0])
    offs = torch.tensor([0, 3, 6])
    out = torch.full((6, H), float("nan"))
    fast.run(x, tok, offs, blobs, I, out)
    assert torch.equal(out[0], out[1])
    ref = reference(x, tok, offs, blobs, I)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_empty_and_degenerate(fast):
    H, I = 32, 16
    x, tok, offs, blobs = make_case(H, I, [0, 0], torch.bfloat16, T=3)
    out = torch.empty(0, H)
    fast.run(x, tok, offs, blobs, I, out)  # all jobs empty: nothing to do
    fast.run(x, tok, torch.zeros(1, dtype=torch.int64), [], I, out)  # no jobs


def test_bad_arguments(fast):
    H, I = 32, 16
    x, tok, offs, blobs = make_case(H, I, [2], torch.bfloat16)
    with pytest.raises(ValueError):
        fast.run(x, torch.tensor([0, 5]), offs, blobs, I, torch.empty(2, H))  # token out of range
    with pytest.raises(ValueError):
        fast.run(x, tok, offs, blobs, I + 1, torch.empty(2, H))  # blob size mismatch
    with pytest.raises(ValueError):
        fast.run(x, tok, offs, blobs, I, torch.empty(2, H, dtype=torch.bfloat16))  # out dtype


def test_submitted_batches_give_their_results_when_waited_for(fast, portable):
    """submit returns a job; its outputs are complete once wait() returns, while this thread did other work
    meanwhile. The job keeps the batch's tensors alive (the caller drops its own), and a second submit waits for the
    first batch (its job then returns the first batch's time)."""
    import gc

    for kernel in (fast, portable):
        cases = [make_case(96, 40, counts, torch.bfloat16, gen=torch.Generator().manual_seed(i))
                 for i, counts in enumerate(([3, 1, 9], [32, 2]))]
        refs = [reference(*case, 40) for case in cases]
        outs, jobs = [], []
        for x, tok, offs, blobs in cases:
            out = torch.full((tok.numel(), 96), float("nan"))
            jobs.append(kernel.submit(x.clone(), tok.clone(), offs.clone(), [b.clone() for b in blobs], 40, out))
            outs.append(out)
            gc.collect()                        # the clones are referenced by the job only
        assert jobs[0].seconds is not None      # the second submit waited for the first batch
        seconds = [job.wait() for job in jobs]
        assert all(s > 0 for s in seconds) and jobs[1].wait() == seconds[1]
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        assert kernel.submit(cases[0][0], cases[0][1][:0], torch.tensor([0]), [], 40,
                             torch.empty(0, 96)).wait() == 0.0


def test_close_waits_for_a_batch_in_flight():
    k = CpuExpertKernel(num_threads=1)
    x, tok, offs, blobs = make_case(256, 128, [32, 32, 32], torch.bfloat16, gen=torch.Generator().manual_seed(3))
    out = torch.full((tok.numel(), 256), float("nan"))
    job = k.submit(x, tok, offs, blobs, 128, out)
    k.close()                                   # before anyone waited
    assert job.seconds is not None and job.seconds > 0
    torch.testing.assert_close(out, reference(x, tok, offs, blobs, 128), rtol=2e-2, atol=2e-2)
    assert job.wait() == job.seconds


def test_runs_from_worker_thread_and_reuses_pool(fast):
    """run may be called from a thread other than the one that made the kernel (the cost model's copy-slowdown
    measurement does, while the main thread copies); repeated calls reuse the pool (shapes change between calls,
    scratch grows)."""
    errs = []

    def work():
        try:
            for H, I, counts in [(96, 40, [2, 5]), (256, 128, [32, 1]), (96, 40, [1])]:
                run_and_check(fast, H, I, counts, torch.bfloat16, 1e-2)
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errs, errs


def test_single_thread_and_more_threads_than_cores():
    for n in (1, 3):
        k = CpuExpertKernel(num_threads=n)
        run_and_check(k, 96, 40, [5, 1, 9], torch.bfloat16, 1e-2)
        k.close()


def test_logs_choice_once(caplog):
    caplog.set_level(logging.INFO, logger="oled")
    ks = [CpuExpertKernel(num_threads=2) for _ in range(2)]
    assert sum("CPU expert kernel" in r.message for r in caplog.records) <= 1
    for k in ks:
        k.close()


def test_calibrate_smoke(fast):
    res = calibrate(fast, 64, 32, token_counts=(1, 4), n_experts=8, repeats=2)
    assert set(res) == {1, 4} and all(v > 0 for v in res.values())


def test_hold_keeps_workers_polling_until_its_deadline():
    """A hold keeps the idle workers polling (CPU time accrues) until its deadline or until it is ended; held
    calls compute the same results."""
    import time

    k = CpuExpertKernel(num_threads=1)
    run_and_check(k, 96, 40, [3, 1], torch.bfloat16, 1e-2)     # the worker exists and has run
    time.sleep(0.05)                                           # past its short spin: asleep

    def cpu_seconds_over(wall, hold=None):
        if hold is not None:
            k.hold(hold)
        t = time.process_time()
        time.sleep(wall)
        return time.process_time() - t

    assert cpu_seconds_over(0.3) < 0.1                           # asleep: no polling
    assert 0.12 < cpu_seconds_over(0.5, hold=0.25) < 0.4         # polls through the 0.25 s hold, then sleeps
    k.hold(5.0)
    run_and_check(k, 96, 40, [2, 7, 1], torch.bfloat16, 1e-2)
    assert cpu_seconds_over(0.3, hold=0.0) < 0.1                 # ended early
    k.close()


def test_run_returns_the_kernels_own_time(fast):
    """run() returns the seconds spent inside the kernel call: positive, within the caller's wall time around it,
    and 0 for an empty batch (what the runtime records as each CPU job's measured time)."""
    import time

    H, I = 256, 128
    blobs = [(torch.randn(3 * H * I) * 0.05).to(torch.bfloat16) for _ in range(3)]
    x = torch.randn(4, H).to(torch.bfloat16)
    tok, offs = torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([0, 2, 4, 6])
    out = torch.empty(6, H)
    for _ in range(3):
        t0 = time.perf_counter()
        inside = fast.run(x, tok, offs, blobs, I, out)
        wall = time.perf_counter() - t0
        assert 0 < inside <= wall
    assert fast.run(x, tok[:0], torch.tensor([0]), [], I, torch.empty(0, H)) == 0.0
