"""How fast the GPU's streaming multiprocessors read expert blobs from pinned host memory with a plain gather kernel,
against the copy engine copying the same blobs. CUDA only.

The mapped path's MoE kernels read a miss's weights from pinned host memory tile by tile as they compute
(oled/kernels/triton_moe.py). On some machines that read is slower than the copy engine: one H100 host read
LLaDA2.0-mini's 6 MiB experts in the kernels at 30-41 GB/s while its copy engine moved them at 53-54 (BENCHMARKS.md
section 35). Reads by the SMs are bounded by the requests in flight over the link's latency, and a GEMM has few
programs on one expert's weights. This probe asks whether a kernel that does nothing but stream the blobs into device
memory, with many programs a blob, reaches the copy engine's rate: if it does, staging a layer's misses into slots
before its GEMMs (inside the same graph, no host) would read them at the link's rate where the GEMMs do not.

    python benchmarks/probes/host_read_probe.py [--blobs 1,4,8,32] [--blocks 4096,16384] [--chunks 1,4] [--out FILE]

Per (m blobs, block elements a load, loads a program): the gather kernel's median time over 20 calls, each on blobs
not read in the last calls (L2 holds none of them), its GB/s, and the copy engine's time and GB/s for the same m blobs
(one cudaMemcpyAsync a blob, as the engine loads). The gathered blobs must equal their sources bit for bit.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

EXPERTS, BLOB = 256, 3 * 512 * 2048          # LLaDA2.0-mini: 256 experts a layer, gate|up|down of 2048 x 512, bf16


@triton.jit
def gather_kernel(src, dst, ids, numel, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """dst[b] = src[ids[b]]: program (b, c) copies elements [c * CHUNKS * BLOCK, (c + 1) * CHUNKS * BLOCK) of blob b."""
    b, c = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids + b).to(tl.int64)
    for i in range(CHUNKS):
        offs = (c * CHUNKS + i) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst + b.to(tl.int64) * numel + offs, tl.load(src + e * numel + offs, mask=mask), mask=mask)


def median_us(fn, calls: int) -> float:
    """Median µs of fn(i) for i in 0 .. calls - 1, each timed alone with CUDA events."""
    times = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blobs", default="1,4,8,32")
    ap.add_argument("--blocks", default="4096,16384", help="elements each load of a program reads")
    ap.add_argument("--chunks", default="1,4", help="loads each program makes, one after the other")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_read_probe: needs a CUDA device")
        return 2
    store = torch.empty(EXPERTS, BLOB, dtype=torch.bfloat16).pin_memory()
    store.view(torch.int16).copy_(torch.randint(-2**15, 2**15, store.shape, dtype=torch.int16))
    lines = []
    for m in map(int, args.blobs.split(",")):
        dst = torch.empty(m, BLOB, dtype=torch.bfloat16, device="cuda")
        groups = [torch.arange(i * m, (i + 1) * m) % EXPERTS for i in range(EXPERTS // m + 1)]   # blobs per call
        ids = [g.cuda() for g in groups]

        def copy(i):
            for j, e in enumerate(groups[i % len(groups)].tolist()):
                dst[j].copy_(store[e], non_blocking=True)
        copy(0)
        copy_us = median_us(copy, args.calls)
        for block in map(int, args.blocks.split(",")):
            for chunks in map(int, args.chunks.split(",")):
                grid = (m, triton.cdiv(BLOB, block * chunks))

                def gather(i):
                    gather_kernel[grid](store, dst, ids[i % len(ids)], BLOB, BLOCK=block, CHUNKS=chunks)
                gather(0)
                torch.cuda.synchronize()
                ok = bool(torch.equal(dst.cpu(), store[groups[0]]))
                us = median_us(gather, args.calls)
                gb = m * BLOB * 2 / 1e9
                line = {"blobs": m, "block": block, "chunks": chunks, "programs": grid[0] * grid[1],
                        "gather_us": us, "gather_gbps": gb / (us * 1e-6), "copy_us": copy_us,
                        "copy_gbps": gb / (copy_us * 1e-6), "equal": ok}
                print(json.dumps(line), flush=True)
                lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0 if all(line["equal"] for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
