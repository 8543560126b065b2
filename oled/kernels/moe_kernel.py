"""Triton kernels: SwiGLU experts over slot-aligned blocks of (token, expert) pairs, straight from the slot pool.

Imports Triton unconditionally; only oled.kernels.triton_moe imports this module, and only when Triton is
available. The launcher, the layout and the rounding are documented there.

Both kernels take a grid of (row block, column tile). A program owns BLOCK_M rows of one slot (from
oled/kernels/moe_align_kernel.py) and BLOCK_N output columns, and walks the whole reduction dimension in
BLOCK_K steps in one fixed order; a row's result depends only on its own input row and its slot's weights,
never on the other rows of its block, so it does not depend on which other pairs or experts share the call.
With MAPPED, a block whose bin is host_bin or more is an expert without a slot: its weights are read from its blob
in (pinned, mapped) host memory, host_ptr's row bin - host_bin, by the same loads in the same order, so a pair
gives the same bits from host memory as from a slot.
With SHARED, the block whose bin is shared_bin reads the shared expert's blob (gate | up | down, as a slot's), and
its pairs, past the routed ones, are one a token.
With CAPTURE, block_capture[block] >= 0 names a slot of the pool (one no pair of the call reads) that the block's
programs copy the weight tiles they read into (the first block of an expert read from host memory: the alignment
chose it), so that the expert ends up resident, its bytes having crossed PCIe once.
With FP8, the pool, the host blobs and the capture slots hold FP8 blobs (oled/fp8.py: bytes, e4m3 weights then one
fp32 scale per output channel): a weight tile is read as e4m3 and widened to the activations' dtype (exact), the
tile's fp32 sums multiplied by their columns' scales (powers of two: exact), so a pair gets the bits the same kernel
gives over the dequantised weights in bf16 or fp32; a capture copies the tiles' bytes and the scales.
HIDDEN and INTER are constexprs (one compilation per model shape): the K loops have static trip counts, which
Triton software-pipelines, and which the interpreter can run (not a runtime-bound `for`, triton-lang/triton#9171).
"""
import triton
import triton.language as tl

from .kernel_math import exact_dot, round_to, silu


@triton.jit
def _now_ns():
    """The GPU's global timer in ns (PTX %globaltimer): a wait's bound."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _weights(pool_ptr, host_ptr, shared_ptr, slot, pool_row_stride, host_row_stride, host_bin, shared_bin,
             MAPPED: tl.constexpr, SHARED: tl.constexpr):
    """The start of the blob of a block's bin: a slot of the pool, with MAPPED an expert's row in host memory, with
    SHARED the shared expert's blob (bin shared_bin)."""
    blob = pool_ptr + slot.to(tl.int64) * pool_row_stride
    if MAPPED:
        if slot >= host_bin:
            blob = host_ptr + (slot - host_bin).to(tl.int64) * host_row_stride
    if SHARED:
        if slot == shared_bin:
            blob = shared_ptr
    return blob


@triton.jit
def _matrices(blob, FP8: tl.constexpr):
    """Where a blob's weights start, typed: its bytes as e4m3 with FP8, else the blob as it is."""
    if FP8:
        w = blob.to(tl.pointer_type(tl.float8e4nv))
    else:
        w = blob
    return w


@triton.jit
def _scales(blob, HIDDEN: tl.constexpr, INTER: tl.constexpr):
    """An FP8 blob's fp32 scales, after its 3 * INTER * HIDDEN weight bytes: gate's INTER, up's INTER, down's HIDDEN."""
    return (blob + 3 * INTER * HIDDEN).to(tl.pointer_type(tl.float32))


@triton.jit
def _gate_up_loop(x_ptrs, gate_ptrs, up_ptrs, has_pair, cap_ptrs, up_offset,
                  HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  INTERPRETED: tl.constexpr, STORE: tl.constexpr):
    """The gate and up accumulators over the whole hidden dimension; with STORE each weight tile read is also
    written at cap_ptrs (the capture slot's gate rows; up rows up_offset after them)."""
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        xs = tl.load(x_ptrs + k0, mask=has_pair, other=0.0)
        gate_w = tl.load(gate_ptrs + k0)
        up_w = tl.load(up_ptrs + k0)
        if STORE:
            tl.store(cap_ptrs + k0, gate_w)
            tl.store(cap_ptrs + up_offset + k0, up_w)
        acc_gate = exact_dot(xs, gate_w.to(xs.dtype), acc_gate, INTERPRETED)      # FP8: widened (exact)
        acc_up = exact_dot(xs, up_w.to(xs.dtype), acc_up, INTERPRETED)
    return acc_gate, acc_up


@triton.jit
def _down_loop(act_ptrs, down_ptrs, cap_ptrs, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, STORE: tl.constexpr):
    """The down accumulator over the whole intermediate; with STORE each weight tile read is also written at
    cap_ptrs (the capture slot's down rows)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        down_w = tl.load(down_ptrs + k0)
        if STORE:
            tl.store(cap_ptrs + k0, down_w)
        act = tl.load(act_ptrs + k0)
        acc = exact_dot(act, down_w.to(act.dtype), acc, INTERPRETED)
    return acc


@triton.jit
def _capture_slot(block_capture_ptr, block, CAPTURE: tl.constexpr):
    """The block's capture slot (relative to the pool), -1 for none (always without CAPTURE)."""
    cap = -1
    if CAPTURE:
        cap = tl.load(block_capture_ptr + block)
    return cap


@triton.jit
def gate_up_kernel(
    x_ptr, pool_ptr, host_ptr, shared_ptr, sorted_pairs_ptr, block_slots_ptr, block_capture_ptr, act_ptr,
    x_row_stride, pool_row_stride, host_row_stride, host_bin, shared_bin, num_routed, top_k,
    HIDDEN: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
    MAPPED: tl.constexpr, CAPTURE: tl.constexpr, SHARED: tl.constexpr, FP8: tl.constexpr,
):
    """act[row, n] = silu(x[token] . gate[n]) * (x[token] . up[n]) for the block's rows and BLOCK_N columns n of
    the intermediate, in one pass over the hidden dimension (gate and up tiles read side by side).

    Rows are in sorted_pairs' order; act has num_blocks * BLOCK_M rows of INTER (padding rows get zeros). A routed
    pair p < num_routed is token p // top_k's; with SHARED a pair p >= num_routed is the shared expert's on token
    p - num_routed.
    """
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    if slot < 0:                # past the last slot's rows: the static grid's spare blocks
        return
    row = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + row)
    has_pair = (pair >= 0)[:, None]
    token = pair // top_k
    if SHARED:
        token = tl.where(pair >= num_routed, pair - num_routed, token)
    token = tl.where(pair >= 0, token, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)

    # the blob's gate rows [INTER, HIDDEN] then up rows: tile [BLOCK_K, BLOCK_N] of gate^T and of up^T
    blob = _weights(pool_ptr, host_ptr, shared_ptr, slot, pool_row_stride, host_row_stride, host_bin, shared_bin,
                    MAPPED, SHARED)
    gate_ptrs = _matrices(blob, FP8) + n[None, :] * HIDDEN + k[:, None]
    up_ptrs = gate_ptrs + INTER * HIDDEN
    x_ptrs = x_ptr + token[:, None] * x_row_stride + k[None, :]
    # a block that captures runs the loop that also stores the tiles; every other block the plain one
    cap = _capture_slot(block_capture_ptr, block, CAPTURE)
    cap_blob = pool_ptr + tl.maximum(cap, 0).to(tl.int64) * pool_row_stride
    cap_ptrs = _matrices(cap_blob, FP8) + n[None, :] * HIDDEN + k[:, None]
    if cap >= 0:
        acc_gate, acc_up = _gate_up_loop(x_ptrs, gate_ptrs, up_ptrs, has_pair, cap_ptrs, INTER * HIDDEN, HIDDEN,
                                         BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED, True)
    else:
        acc_gate, acc_up = _gate_up_loop(x_ptrs, gate_ptrs, up_ptrs, has_pair, cap_ptrs, INTER * HIDDEN, HIDDEN,
                                         BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED, False)
    if FP8:         # the columns' scales on the sums (and into the capture slot with the tiles)
        scales = _scales(blob, HIDDEN, INTER)
        gate_scale = tl.load(scales + n)
        up_scale = tl.load(scales + INTER + n)
        acc_gate = acc_gate * gate_scale[None, :]
        acc_up = acc_up * up_scale[None, :]
        if cap >= 0:
            cap_scales = _scales(cap_blob, HIDDEN, INTER)
            tl.store(cap_scales + n, gate_scale)
            tl.store(cap_scales + INTER + n, up_scale)

    # the torch path's rounding points: h = x @ gate_up^T in x's dtype, silu(h_gate) in x's dtype, then the
    # product rounded once more (no-ops in fp32)
    dtype = act_ptr.dtype.element_ty
    gate = round_to(acc_gate, dtype, INTERPRETED)
    act = round_to(silu(gate, INTERPRETED), dtype, INTERPRETED) * round_to(acc_up, dtype, INTERPRETED)
    tl.store(act_ptr + row[:, None] * INTER + n[None, :], round_to(act, dtype, INTERPRETED).to(dtype))


@triton.jit
def down_kernel(
    act_ptr, pool_ptr, host_ptr, shared_ptr, sorted_pairs_ptr, block_slots_ptr, block_capture_ptr, out_ptr,
    pool_row_stride, host_row_stride, host_bin, shared_bin, out_row_stride,
    HIDDEN: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
    MAPPED: tl.constexpr, CAPTURE: tl.constexpr, SHARED: tl.constexpr, FP8: tl.constexpr,
):
    """out[pair, n] = act[row] . down[n] for the block's rows that hold a pair and BLOCK_N columns n of the
    hidden dimension: written straight to the pair's row of out, every other row of out untouched."""
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    if slot < 0:
        return
    row = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + row)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)

    # the blob's down matrix [HIDDEN, INTER] after gate and up: tile [BLOCK_K, BLOCK_N] of down^T
    blob = _weights(pool_ptr, host_ptr, shared_ptr, slot, pool_row_stride, host_row_stride, host_bin, shared_bin,
                    MAPPED, SHARED)
    down_ptrs = _matrices(blob, FP8) + 2 * INTER * HIDDEN + n[None, :] * INTER + k[:, None]
    act_ptrs = act_ptr + row[:, None] * INTER + k[None, :]
    cap = _capture_slot(block_capture_ptr, block, CAPTURE)
    cap_blob = pool_ptr + tl.maximum(cap, 0).to(tl.int64) * pool_row_stride
    cap_ptrs = _matrices(cap_blob, FP8) + 2 * INTER * HIDDEN + n[None, :] * INTER + k[:, None]
    if cap >= 0:
        acc = _down_loop(act_ptrs, down_ptrs, cap_ptrs, INTER, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED, True)
    else:
        acc = _down_loop(act_ptrs, down_ptrs, cap_ptrs, INTER, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED, False)
    if FP8:
        down_scale = tl.load(_scales(blob, HIDDEN, INTER) + 2 * INTER + n)
        acc = acc * down_scale[None, :]
        if cap >= 0:
            tl.store(_scales(cap_blob, HIDDEN, INTER) + 2 * INTER + n, down_scale)

    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * out_row_stride + n[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptrs, round_to(acc, dtype, INTERPRETED).to(dtype), mask=(pair >= 0)[:, None])


@triton.jit
def combine_kernel(
    y_ptr, weights_ptr, add_ptr, out_ptr, y_row_stride, add_row_stride, out_row_stride, hidden,
    pair_on_cpu_ptr, done_ptr, row_of_pair_ptr, cpu_rows_ptr, errors_ptr, timeout_ns,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ADD: tl.constexpr, CPU_SHARE: tl.constexpr,
    BLOCK_K2: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Grid (tokens, column tiles): out[t] = sum_j weights[t, j] * y[t * TOP_K + j] in fp32 (weights widened from
    their dtype), in routing order j = 0, 1, ..., rounded to out's dtype; with HAS_ADD, + add[t] (the shared
    expert's output) and rounded again, as torch's add of the two.
    CPU_SHARE: a pair p with pair_on_cpu[p] set was computed on the CPU: its y is row row_of_pair[p] of cpu_rows
    (pinned, fp32, rows of `hidden`), rounded to out's dtype as the GPU's pair output is, read once the host has set
    done (pinned). A program with such a pair polls done (volatile loads: each crosses PCIe) for at most
    timeout_ns; past that it adds 1 to errors (pinned) and goes on, and the host fails the forward. Under the
    interpreter the host has set done before the launch (one thread runs both)."""
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    here = col < hidden
    dtype = out_ptr.dtype.element_ty
    if CPU_SHARE:
        ks = tl.arange(0, BLOCK_K2)
        any_cpu = tl.sum(tl.load(pair_on_cpu_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=0), axis=0) > 0
        if any_cpu:
            seen = tl.load(done_ptr, volatile=True)
            if not INTERPRETED:
                start = _now_ns()
                while (seen == 0) & (_now_ns() - start < timeout_ns):
                    seen = tl.load(done_ptr, volatile=True)
            if seen == 0:
                tl.atomic_add(errors_ptr, 1, sem="relaxed", scope="sys")
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(TOP_K):
        w = tl.load(weights_ptr + t * TOP_K + j).to(tl.float32)
        y = tl.load(y_ptr + (t * TOP_K + j) * y_row_stride + col, mask=here, other=0.0).to(tl.float32)
        if CPU_SHARE:
            if tl.load(pair_on_cpu_ptr + t * TOP_K + j) != 0:
                row = tl.load(row_of_pair_ptr + t * TOP_K + j, volatile=True).to(tl.int64)
                y = round_to(tl.load(cpu_rows_ptr + row * hidden + col, mask=here, other=0.0, volatile=True),
                             dtype, True)
        acc += y * w
    acc = round_to(acc, dtype, True)
    if HAS_ADD:
        extra = tl.load(add_ptr + t * add_row_stride + col, mask=here, other=0.0).to(tl.float32)
        acc = round_to(acc + extra, dtype, True)
    tl.store(out_ptr + t * out_row_stride + col, acc.to(dtype), mask=here)
