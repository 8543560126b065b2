"""Triton kernels: argmax and softmax probability of the argmax per row of LM-head logits, one pass over V.

Imports Triton unconditionally; only oled.kernels.triton_confidence imports this module, and only when Triton is
available. The launcher and the semantics are documented there.

Each program scans a span of one row with an online max/sum kept per lane (a vector of BLOCK running maxima,
sums of exp(x - max) and argmax positions): the loop body has no cross-lane reduction and one exp per element,
and the lanes are combined once at the end. A row may be split over several programs (partials, then
`combine_kernel`) so that a few rows still spread over every SM.
"""
import triton
import triton.language as tl

_NO_INDEX = tl.constexpr(2147483647)     # above every column: loses every lowest-index contest


@triton.jit
def _scan(row_ptr, start, num_cols, TILES: tl.constexpr, BLOCK: tl.constexpr):
    """Per-lane running (max, sum of exp(x - max), first position of the max, saw NaN/+Inf) over TILES tiles
    from column `start` of the row, clipped to num_cols.

    The trip count is a constexpr because Triton 3.6's interpreter cannot run a loop with a runtime bound under
    NumPy >= 2.4 (triton-lang/triton#9171); compiled, that costs one compilation per distinct tile count."""
    lane = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_at = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for tile in range(TILES):
        col = start + tile * BLOCK + lane
        x = tl.load(row_ptr + col, mask=col < num_cols, other=float("-inf"))   # -inf adds exp(-inf) = 0
        bad = bad | ((x != x) | (x == float("inf"))).to(tl.int32)
        # strictly greater: an equal value later in the lane keeps the earlier position (lowest index on ties)
        up = x > run_max
        hi = tl.where(up, x, run_max)
        lo = tl.where(up, run_max, x)
        # one exp either way: rescale the old sum when the max moves up, else add the new term;
        # a lane still at -inf adds 0 instead of exp(-inf - -inf) = NaN
        e = tl.where(hi == float("-inf"), 0.0, tl.exp(lo - hi))
        run_sum = tl.where(up, run_sum * e + 1.0, run_sum + e)
        run_at = tl.where(up, col, run_at)
        run_max = hi
    return run_max, run_sum, run_at, bad


@triton.jit
def _merge(run_max, run_sum, run_at, bad):
    """Lanes (or partials) of one row -> (max, sum of exp(x - max), lowest position of the max, any NaN/+Inf)."""
    top = tl.max(run_max, axis=0)
    scale = tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - top))
    total = tl.sum(run_sum * scale, axis=0)
    first = tl.min(tl.where(run_max == top, run_at, _NO_INDEX), axis=0)
    return top, total, first, tl.max(bad, axis=0)


@triton.jit
def _finish(x0_ptr, prob_ptr, row, top, total, first, bad):
    """What the torch reference gives: softmax of a row with a NaN or +Inf, or of an all -Inf row, is NaN
    everywhere, and argmax of an all-NaN row is 0. Otherwise softmax[argmax] = exp(0) / total."""
    invalid = (bad != 0) | (top == float("-inf"))
    tl.store(x0_ptr + row, tl.where(invalid, 0, first).to(tl.int64))
    tl.store(prob_ptr + row, tl.where(invalid, float("nan"), tl.math.div_rn(1.0, total)))


@triton.jit
def scan_kernel(
    logits_ptr, x0_ptr, prob_ptr, part_max_ptr, part_sum_ptr, part_at_ptr, part_bad_ptr,
    num_cols, row_stride,
    TILES: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
):
    """Grid (rows, splits): program (r, s) scans the TILES * BLOCK columns from s * TILES * BLOCK of row r. Unsplit, it
    writes x0 and its probability; split, it writes its partial to part_*[r, s] for combine_kernel."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    run_max, run_sum, run_at, bad = _scan(row_ptr, split * (TILES * BLOCK), num_cols, TILES, BLOCK)
    top, total, first, bad = _merge(run_max, run_sum, run_at, bad)
    if SPLIT:
        at = row * tl.num_programs(1) + split
        tl.store(part_max_ptr + at, top)
        tl.store(part_sum_ptr + at, total)
        tl.store(part_at_ptr + at, first)
        tl.store(part_bad_ptr + at, bad)
    else:
        _finish(x0_ptr, prob_ptr, row, top, total, first, bad)


@triton.jit
def combine_kernel(
    x0_ptr, prob_ptr, part_max_ptr, part_sum_ptr, part_at_ptr, part_bad_ptr,
    splits, BLOCK_SPLITS: tl.constexpr,
):
    """One program per row: merge the row's `splits` partials (ordered by column span, each with its own lowest
    position of its max) exactly as the lanes are merged."""
    row = tl.program_id(0)
    split = tl.arange(0, BLOCK_SPLITS)
    here = split < splits
    at = row * splits + split
    part_max = tl.load(part_max_ptr + at, mask=here, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + at, mask=here, other=0.0)
    part_at = tl.load(part_at_ptr + at, mask=here, other=_NO_INDEX)
    part_bad = tl.load(part_bad_ptr + at, mask=here, other=0)
    top, total, first, bad = _merge(part_max, part_sum, part_at, part_bad)
    _finish(x0_ptr, prob_ptr, row, top, total, first, bad)
