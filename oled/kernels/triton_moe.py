"""The routed experts of one MoE call over a layer's slot pool in three Triton launches: a drop-in for
oled.runtime.grouped.grouped_swiglu followed by its index_copy_.

For every (token, expert) pair p = t * k + j whose slot s = pair_slots[p] is in the pool,
    out[p] = down_s( silu(gate_s x[t]) * up_s x[t] )
and every other row of `out` is left as it was. The pool holds one layer's slots, a blob a row:
gate [I, H] | up [I, H] | down [H, I]. Given the shared expert's blob (same layout), rows T * k + t get
shared(x[t]) in the same launches: T more pairs in a bin of their own, after the routed ones.

Launches, the same three whatever the routing, with shapes fixed by (T, k, S) alone (no host synchronisation,
so a CUDA graph captures them and replays them with other routing):
  1. align (oled/kernels/moe_align_kernel.py, one program): pairs grouped by slot (a histogram, a prefix sum,
     an atomic cursor a slot; experts read from host memory first, so their PCIe-bound blocks start first), each
     slot's rows padded to a multiple of BLOCK_M with -1, and a table
     block -> slot; sized for the worst case, P + min(P, S) * (BLOCK_M - 1) rows, so blocks past the used
     rows are marked empty;
  2. gate|up (oled/kernels/moe_kernel.py): a program per (block, BLOCK_N columns of I): x rows gathered by
     token, gate and up tiles read in the same pass over H, SiLU(gate) * up in the epilogue, written to an
     intermediate in x's dtype;
  3. down: a program per (block, BLOCK_N columns of H), stored straight to out[p] of each row that holds a pair.
Programs of empty blocks return after one load. The scratch (pair list, block table, cursors, intermediate) is
four torch.empty of those fixed shapes, no tensor op.

Rounding: as the torch path, every product accumulates in fp32 and the intermediates are rounded where torch
stores them: h = x @ [gate; up]^T to x's dtype, silu(h_gate) to x's dtype (computed in fp32 as torch's CUDA silu
does, expf and an IEEE division), the product to x's dtype, the output to x's dtype. What differs is the order
of the fp32 sums (tiles of BLOCK_K here, cuBLAS/CUTLASS's own split in torch._grouped_mm): in bf16 an element of
h, hence of the output, may land a bf16 ulp or two away from the torch path's (benchmarks/kernels_bench.py
counts the bits that differ on the GPU); in fp32 they agree to rounding. Under the interpreter the SiLU takes
numpy's exp, and bf16 is rounded on the bits, to nearest even as a compiled cast rounds (the interpreter's own cast
truncates).

FP8 experts (a uint8 pool of oled/fp8.py's blobs; host and capture alike): the weight tiles are read as e4m3 and
widened to x's dtype, and each column's fp32 sum is multiplied by its power-of-two scale, so the outputs are the bits
of the same launches over the dequantised weights (the rounding above is unchanged). The shared expert (bf16) is
not computed in an FP8 pool's launches.

Independence: a pair's output depends only on x[t] and its slot's weights: the K order is fixed, tiles are
row-independent (which row of its block a pair lands in, the atomics' order on a GPU, does not matter), and no
split of K depends on the routing. So a pair gives the same bits alone or among many, in any slot
(tests/test_triton_moe.py checks it under the interpreter).

Tiles: MoeTiles below. The defaults are meant for decode on LLaDA2.0-mini (H 2048, I 512, top-8, a few pairs an
expert): memory bound, so the aim is to read each active expert's weights once with enough programs in flight.
BLOCK_M is fixed (not chosen from P) so that the MMA shape, hence a pair's bits, never depend on the call's size.
The choice of tiles: docs/decisions.md, moe-tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import fp8
from .triton_support import available, check_device, interpreted

__all__ = ["CpuShare", "MoeTiles", "align_pairs", "available", "combine_pairs", "fused_swiglu_pairs", "padded_rows"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_TILE = 16                  # tl.dot's smallest M, N and K


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes (powers of two, at least 16) and launch options of the two compute launches. A tile wider than
    its dimension, or not dividing it, is halved until it divides (so no column or K mask is ever needed)."""
    block_m: int = 16           # pair rows a block (decode: 1-4 pairs an expert; 16 is tl.dot's minimum)
    gate_up_n: int = 32         # columns of I a program of launch 2 (I 512: 16 programs an expert)
    gate_up_k: int = 128        # H a step
    down_n: int = 64            # columns of H a program of launch 3 (H 2048: 32 programs an expert)
    down_k: int = 128           # I a step
    num_warps: int = 4
    num_stages: int = 4         # docs/decisions.md: moe-tiles

    def __post_init__(self):
        for name in ("block_m", "gate_up_n", "gate_up_k", "down_n", "down_k"):
            tile = getattr(self, name)
            if tile < _MIN_TILE or tile & (tile - 1):
                raise ValueError(f"{name} must be a power of two >= {_MIN_TILE}, got {tile}")


DEFAULT_TILES = MoeTiles()


@dataclass(frozen=True)
class CpuShare:
    """The buffers through which a mapped MoE call hands part of its misses to the CPU and takes the CPU's rows back,
    inside the forward (one set per layer and token count; the rule and the host's side: oled/runtime/cpu_share.py).
    The alignment (align_pairs) gives the CPU the c = min(table[m], m, d - capacity) highest ids of the m experts
    it would read from host memory (d: the experts the call computes; capacity: the layer's slots), marks their
    pairs in pair_on_cpu, stores the input rows of their tokens into x_rows, resets done and then stores the
    routing. The host computes those pairs into rows (row_of_pair[p]: the row of pair p) and sets done to 1; the
    combine (combine_pairs) waits for done, at most timeout_ns (then adds 1 to errors and takes whatever the rows
    hold: the caller must fail the forward), and takes those pairs' outputs from rows, rounded to the model's dtype
    as a GPU pair's output is."""
    table: torch.Tensor         # [E + 1] int32, on the device: CPU experts for m experts read from host memory
    x_rows: torch.Tensor        # [T, H] in x's dtype, pinned host memory: the inputs of tokens with a CPU pair
    pair_on_cpu: torch.Tensor   # [T * k] int32, on the device: 1 where a pair is computed on the CPU
    done: torch.Tensor          # [1] int32, pinned: 0 from the alignment on, 1 once the host wrote the rows
    row_of_pair: torch.Tensor   # [T * k] int32, pinned: the row of `rows` holding a CPU pair's output
    rows: torch.Tensor          # [R, H] fp32, pinned: the CPU's outputs
    errors: torch.Tensor        # [1] int32, pinned: combine programs that stopped waiting for done
    capacity: int = 0           # the layer's slots: only misses beyond what they can keep beside the hits go to the CPU
    timeout_ns: int = 500_000_000


def mapped_rows(mapped: bool) -> int:
    """Residency.mapped_rows of an engine with the default tiles: the pairs a block holds (a mapped blob is read
    once per block of its pairs) with mapped misses, 0 without."""
    return DEFAULT_TILES.block_m if mapped else 0


def padded_rows(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Rows of the aligned pair list: every slot with pairs pads at most block_m - 1 rows, and at most
    min(P, S) slots have pairs."""
    rows = num_pairs + min(num_pairs, num_slots) * (block_m - 1)
    return -(-rows // block_m) * block_m


def fused_swiglu_pairs(x: torch.Tensor, pair_slots: torch.Tensor, pool: torch.Tensor, hidden: int,
                       intermediate: int, out: torch.Tensor, *, slot_base: int = 0,
                       tiles: MoeTiles = DEFAULT_TILES, slot_map: torch.Tensor | None = None,
                       host: torch.Tensor | None = None, capture: torch.Tensor | None = None,
                       routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                       shared: torch.Tensor | None = None, cpu_share: CpuShare | None = None) -> None:
    """out[p] = SwiGLU expert of slot pair_slots[p] - slot_base applied to x[p // k], for every pair whose slot
    is in the pool; other rows of out untouched.

    x [T, H]; pair_slots [T * k] int64, token-major (-1: no slot; a slot outside slot_base .. slot_base + S - 1
    is skipped as well); pool [S, 3 * I * H] (rows contiguous, any row stride); out [T * k, H] (rows
    contiguous, any row stride), written in place. x, pool and out share a dtype (fp32, bf16 or fp16) and a
    device; or pool holds FP8 blobs ([S, fp8.blob_bytes(H, I)] uint8, host too; no shared). Raises ValueError for anything else. Three launches (see the module docstring), none when there are
    no pairs or no slots. With slot_map ([E] int64, the device slot map's row of the layer: expert -> slot or -1),
    pair_slots holds each pair's expert id instead, and the alignment looks the slot up (what index_select made
    before the call, one launch fewer). With host as well ([E, 3 * I * H], the layer's expert blobs in host memory:
    pinned, so a CUDA kernel reads it mapped, over PCIe), a pair whose expert has no slot in slot_map is computed
    from its blob there (a miss served without a copy or the host), so every pair is written; without slot_map, a
    pair slot slot_base + S + e names expert e's blob there. With capture as well ([R] int64: slots of the pool,
    absolute as slot_map's, -1 for none; free, or holding an expert the caller would evict next), the experts read
    from host memory, in increasing id, are written as their tiles are read into those of the slots that no pair of
    the call reads, in their order, so they are resident after the call without a copy; the caller makes slot_map
    say so (and drops the slots' old experts). With routing = (weights [T, k], dst) as well (slot_map given), the
    alignment also stores the call's ids and weights into dst for the host (align_pairs), no launch added.
    With shared ([3 * I * H], the shared expert's blob, laid out as a slot's, in pool's dtype on its device), the
    shared expert is computed in the same launches as T more pairs, one a token: out then has T * k + T rows, and
    row T * k + t gets shared(x[t]) (the same bits as a routed pair of those weights: one more bin, read once per
    block of its rows).
    With cpu_share (with host, slot_map and routing), the alignment gives part of the experts it would read from host
    memory to the CPU (CpuShare): their rows of out are left as they are, for combine_pairs to take from the CPU.
    """
    from .moe_kernel import down_kernel, gate_up_kernel

    x, pair_slots = _check(x, pair_slots, pool, hidden, intermediate, out, slot_base,
                           shared_rows=0 if shared is None else x.shape[0])
    _check_shared(shared, pool)
    check_device(gate_up_kernel, x, pair_slots, pool, out)
    is_fp8 = fp8.is_fp8_blob(pool)
    _check_host(host, slot_map, pool, gate_up_kernel)
    if capture is not None and (host is None or slot_map is None or capture.dim() != 1
                                or capture.dtype != torch.int64 or capture.device != pool.device):
        raise ValueError("capture needs slot_map and host, and is a [R] int64 tensor on the pool's device")
    num_slots = pool.shape[0]
    mapped = host is not None
    if pair_slots.shape[0] == 0 or (num_slots == 0 and not mapped and shared is None):
        return
    top_k = pair_slots.shape[0] // x.shape[0]
    block_m = tiles.block_m
    # the pool's slots, then one bin an expert on the host, then the shared expert's
    bins = num_slots + (host.shape[0] if mapped else 0) + (shared is not None)
    shared_bin = bins - 1 if shared is not None else bins
    sorted_pairs, block_slots, block_capture = align_pairs(
        pair_slots, bins, slot_base, block_m, slot_map, host_bin=num_slots, mapped=mapped and slot_map is not None,
        capture=capture, routing=routing, shared_tokens=0 if shared is None else x.shape[0], cpu_share=cpu_share,
        x=x)
    num_blocks = block_slots.shape[0]
    act = torch.empty(sorted_pairs.shape[0], intermediate, dtype=x.dtype, device=x.device)

    launch = dict(INTERPRETED=interpreted(gate_up_kernel), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                  MAPPED=mapped, CAPTURE=capture is not None, SHARED=shared is not None, FP8=is_fp8)
    host = host if mapped else pool                             # not read without MAPPED
    shared = pool if shared is None else shared                 # not read without SHARED
    n_up, k_up = _fit(tiles.gate_up_n, intermediate), _fit(tiles.gate_up_k, hidden)
    gate_up_kernel[(num_blocks, intermediate // n_up)](
        x, pool, host, shared, sorted_pairs, block_slots, block_capture, act, x.stride(0), pool.stride(0),
        host.stride(0), num_slots, shared_bin, pair_slots.shape[0], top_k,
        HIDDEN=hidden, INTER=intermediate, BLOCK_M=block_m, BLOCK_N=n_up, BLOCK_K=k_up, **launch)
    n_down, k_down = _fit(tiles.down_n, hidden), _fit(tiles.down_k, intermediate)
    down_kernel[(num_blocks, hidden // n_down)](
        act, pool, host, shared, sorted_pairs, block_slots, block_capture, out, pool.stride(0), host.stride(0),
        num_slots, shared_bin, out.stride(0),
        HIDDEN=hidden, INTER=intermediate, BLOCK_M=block_m, BLOCK_N=n_down, BLOCK_K=k_down, **launch)


def combine_pairs(y_pairs: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None,
                  cpu_share: CpuShare | None = None) -> torch.Tensor:
    """The MoE layer's output in one launch: out[t] = sum_j weights[t, j] * y_pairs[t * k + j] (fp32, routing order,
    rounded to y's dtype), + add[t] when given (the shared expert's output, a second rounding as torch's add).
    y_pairs [T * k, H], weights [T, k] (fp32, or the model dtype for LLaDA-MoE), add [T, H] -> [T, H]. The torch
    path (ExpertManager.combine) is five launches: the widening, the product, the sum, the cast back, the add.
    With cpu_share, the pairs its alignment gave the CPU are taken from its rows once the host has set done (a
    program with such a pair waits for it; see CpuShare)."""
    import triton

    from .moe_kernel import combine_kernel

    T, k = weights.shape
    if y_pairs.dim() != 2 or y_pairs.shape[0] != T * k or weights.dtype not in _DTYPES:
        raise ValueError(f"y_pairs must be [T * k, H] and weights [T, k] float, got {tuple(y_pairs.shape)} and "
                         f"{tuple(weights.shape)} {weights.dtype}")
    hidden = y_pairs.shape[1]
    if add is not None and (add.shape != (T, hidden) or add.dtype != y_pairs.dtype):
        raise ValueError(f"add must be [{T}, {hidden}] {y_pairs.dtype}, got {tuple(add.shape)} {add.dtype}")
    y_pairs = y_pairs if y_pairs.stride(-1) == 1 else y_pairs.contiguous()
    weights = weights.contiguous()
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    check_device(combine_kernel, y_pairs, weights, *([add] if add is not None else []))
    out = torch.empty(T, hidden, dtype=y_pairs.dtype, device=y_pairs.device)
    share = cpu_share
    if share is not None and (share.pair_on_cpu.shape != (T * k,) or share.rows.shape[1] != hidden
                              or share.rows.dtype != torch.float32 or share.row_of_pair.shape != (T * k,)):
        raise ValueError(f"cpu_share's pair_on_cpu and row_of_pair must be [{T * k}] and its rows [R, {hidden}] fp32")
    if T:
        block = min(triton.next_power_of_2(hidden), 1024)
        pair_on_cpu, done, row_of_pair, rows, errors = (
            (weights,) * 5 if share is None
            else (share.pair_on_cpu, share.done, share.row_of_pair, share.rows, share.errors))
        combine_kernel[(T, triton.cdiv(hidden, block))](
            y_pairs, weights, y_pairs if add is None else add, out, y_pairs.stride(0),
            0 if add is None else add.stride(0), out.stride(0), hidden,
            pair_on_cpu, done, row_of_pair, rows, errors, 0 if share is None else share.timeout_ns,
            TOP_K=k, BLOCK_H=block, HAS_ADD=add is not None, CPU_SHARE=share is not None,
            BLOCK_K2=triton.next_power_of_2(k), INTERPRETED=interpreted(combine_kernel), num_warps=4)
    return out


def align_pairs(pair_slots: torch.Tensor, num_slots: int, slot_base: int, block_m: int,
                slot_map: torch.Tensor | None = None, *, host_bin: int | None = None, mapped: bool = False,
                capture: torch.Tensor | None = None, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                shared_tokens: int = 0, cpu_share: CpuShare | None = None, x: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch 1: pair_slots [P] int64 (contiguous, P > 0; expert ids to look up in slot_map [E] int64 when given)
    -> (sorted_pairs [padded_rows] int32, block_slots [padded_rows / block_m] int32), as
    oled/kernels/moe_align_kernel.py lays them out. num_slots bins; with mapped (and slot_map), the pool's slots
    are the first host_bin of them and a pair whose expert has no slot goes to bin host_bin + its id. The third
    result, block_capture [padded_rows / block_m] int32, is each block's capture slot (relative to slot_base, -1 for
    none) with capture (the armed slots, see fused_swiglu_pairs), else block_slots itself (never read).
    routing = (weights, dst), with slot_map: weights [T, k] (any float dtype, T * k = P) and dst [T, 3 * k] int32
    (contiguous; for a compiled kernel pinned host memory, or on the pairs' device) get the call's routing as the
    kernel's docstring lays it out (the ids' int64 halves, then the weights' fp32 bits), in the same launch.
    shared_tokens T > 0: the last of the num_slots bins is the shared expert's, and T pairs P .. P + T - 1 (past
    pair_slots' P) are placed in it, one a token. cpu_share (with mapped and routing; x [T, H], the call's input):
    the CPU's part of the experts read from host memory, as CpuShare lays out."""
    import triton

    from .moe_align_kernel import align_pairs_kernel

    num_routed, device = pair_slots.shape[0], pair_slots.device
    num_pairs = num_routed + shared_tokens
    rows = padded_rows(num_pairs, num_slots, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_slots = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    block_s = triton.next_power_of_2(num_slots)
    cursor = torch.empty(block_s, dtype=torch.int32, device=device)
    block_capture = block_slots if capture is None else torch.empty_like(block_slots)
    # a decode call's pairs (T * k of a few hundred) in one pass: 1,024 pairs over 4 warps
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype != torch.int64 or slot_map.stride(0) != 1):
        raise ValueError(f"slot_map must be a contiguous [E] int64 row, got {tuple(slot_map.shape)} {slot_map.dtype}")
    weights, dst = routing if routing is not None else (pair_slots, pair_slots)     # not read without ROUTING
    top_k = 1
    if routing is not None:
        top_k = weights.shape[-1] if weights.dim() == 2 else 0
        if (slot_map is None or top_k == 0 or weights.numel() != num_routed or not weights.is_floating_point()
                or dst.dtype != torch.int32 or tuple(dst.shape) != (num_routed // top_k, 3 * top_k)
                or not dst.is_contiguous()):
            raise ValueError(f"routing must be (weights [T, k] float, dst [T, 3k] int32 contiguous) with slot_map "
                             f"for {num_routed} pairs, got {tuple(weights.shape)} {weights.dtype} and "
                             f"{tuple(dst.shape)} {dst.dtype}")
        if (not interpreted(align_pairs_kernel) and dst.device != device
                and not (dst.device.type == "cpu" and dst.is_pinned())):
            raise ValueError(f"routing's dst must be pinned host memory (or on {device}) for a compiled kernel")
        weights = weights.contiguous()
    share = cpu_share
    if share is not None and (not mapped or routing is None or x is None or share.x_rows.shape != x.shape
                              or share.pair_on_cpu.shape != (num_routed,) or share.table.dtype != torch.int32
                              or share.pair_on_cpu.dtype != torch.int32 or share.done.dtype != torch.int32
                              or x.stride(1) != 1 or not share.x_rows.is_contiguous()):
        raise ValueError("cpu_share needs mapped misses and the routing's store, x_rows shaped as x, pair_on_cpu "
                         f"[{num_routed}] int32 and int32 table and done")
    x_src = pair_slots if share is None else x           # not read without CPU_SHARE
    share_args = ((pair_slots,) * 4 if share is None
                  else (share.table, share.x_rows, share.pair_on_cpu, share.done))
    align_pairs_kernel[(1,)](
        pair_slots, pair_slots if slot_map is None else slot_map, sorted_pairs, block_slots, cursor,
        pair_slots if capture is None else capture, block_capture, weights, dst, share_args[0], x_src,
        share_args[1], share_args[2], share_args[3], num_pairs, num_routed,
        num_slots, slot_base, num_slots if host_bin is None else host_bin,
        num_slots - 1 if shared_tokens else num_slots, block_slots.shape[0],
        0 if capture is None else capture.shape[0], 0 if share is None else x.stride(0),
        0 if share is None else share.capacity,
        BLOCK_M=block_m, BLOCK_P=max(16, min(triton.next_power_of_2(num_pairs), 1024)), BLOCK_S=block_s,
        BLOCK_FILL=1024, LOOKUP=slot_map is not None, MAPPED=mapped, CAPTURE=capture is not None,
        BLOCK_R=max(2, triton.next_power_of_2(0 if capture is None else capture.shape[0])),
        ROUTING=routing is not None, TOP_K=top_k, SHARED=shared_tokens > 0, CPU_SHARE=share is not None,
        HIDDEN=0 if x is None else x.shape[1], BLOCK_K2=triton.next_power_of_2(max(top_k, 1)), num_warps=4)
    return sorted_pairs, block_slots, block_capture


def _check_host(host, slot_map, pool, kernel) -> None:
    """host: None, or the layer's blobs [E, 3 * I * H] in pool's dtype with contiguous rows (E: slot_map's experts
    where given); for a compiled kernel in pinned host memory (read mapped) or on pool's device."""
    if host is None:
        return
    if host.dim() != 2 or host.shape[1] != pool.shape[1] or host.stride(1) != 1 or host.dtype != pool.dtype:
        raise ValueError(f"host must be [E, {pool.shape[1]}] {pool.dtype} with contiguous rows, got "
                         f"{tuple(host.shape)} {host.dtype} strides {host.stride()}")
    if slot_map is not None and host.shape[0] != slot_map.shape[0]:
        raise ValueError(f"host holds {host.shape[0]} experts, slot_map {slot_map.shape[0]}")
    if not interpreted(kernel) and host.device != pool.device and not (host.device.type == "cpu" and host.is_pinned()):
        raise ValueError(f"host must be pinned host memory (or on {pool.device}) for a compiled kernel to read it")


def _fit(tile: int, dim: int) -> int:
    """The largest power of two <= tile that divides dim (dim is a multiple of 16, checked before)."""
    while dim % tile:
        tile //= 2
    return tile


def _check_shared(shared, pool) -> None:
    """shared: None, or the shared expert's blob [3 * I * H], contiguous, in pool's dtype on pool's device."""
    if shared is None:
        return
    if fp8.is_fp8_blob(pool):
        raise ValueError("shared: the shared expert stays bf16, and is not computed in an FP8 pool's launches")
    if (shared.dim() != 1 or shared.shape[0] != pool.shape[1] or shared.stride(0) != 1 or shared.dtype != pool.dtype
            or shared.device != pool.device):
        raise ValueError(f"shared must be a contiguous [{pool.shape[1]}] {pool.dtype} blob on {pool.device}, got "
                         f"{tuple(shared.shape)} {shared.dtype} on {shared.device}")


def _check(x, pair_slots, pool, hidden, intermediate, out, slot_base, shared_rows: int = 0):
    """Shapes, dtypes, devices and layouts, one ValueError each; returns x and pair_slots with unit inner
    stride (copied if needed: the kernels index them flat). out has shared_rows rows past the pairs'."""
    tensors = {"x": x, "pair_slots": pair_slots, "pool": pool, "out": out}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"x, pair_slots, pool and out must be on one device, got {sorted(map(str, devices))}")
    if hidden % _MIN_TILE or intermediate % _MIN_TILE or hidden <= 0 or intermediate <= 0:
        raise ValueError(f"hidden and intermediate must be positive multiples of {_MIN_TILE}, got {hidden}, "
                         f"{intermediate}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if pair_slots.dim() != 1 or pair_slots.dtype != torch.int64:
        raise ValueError(f"pair_slots must be [T * k] int64, got {tuple(pair_slots.shape)} {pair_slots.dtype}")
    tokens, num_pairs = x.shape[0], pair_slots.shape[0]
    if (tokens == 0) != (num_pairs == 0) or (tokens and num_pairs % tokens):
        raise ValueError(f"pair_slots must hold k pairs for each of the {tokens} tokens, got {num_pairs}")
    is_fp8 = fp8.is_fp8_blob(pool)
    row = fp8.blob_bytes(hidden, intermediate) if is_fp8 else 3 * intermediate * hidden
    if pool.dim() != 2 or pool.shape[1] != row or pool.stride(1) != 1:
        raise ValueError(f"pool must be [S, {row}] with contiguous rows, got "
                         f"{tuple(pool.shape)} strides {pool.stride()}")
    if out.shape != (num_pairs + shared_rows, hidden) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_pairs + shared_rows}, {hidden}] with contiguous rows, got "
                         f"{tuple(out.shape)} "
                         f"strides {out.stride()}")
    if x.dtype not in _DTYPES or (pool.dtype != x.dtype and not is_fp8) or out.dtype != x.dtype:
        raise ValueError(f"x, pool and out must share one of {[str(d) for d in _DTYPES]} (or the pool hold FP8 "
                         f"blobs, uint8), got {x.dtype}, {pool.dtype}, {out.dtype}")
    if not isinstance(slot_base, int) or slot_base < 0:
        raise ValueError(f"slot_base must be an int >= 0, got {slot_base!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if pair_slots.stride(0) != 1:
        pair_slots = pair_slots.contiguous()
    return x, pair_slots
