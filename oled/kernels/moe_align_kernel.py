"""Triton kernel: one MoE call's (token, expert) pairs grouped by slot into blocks of BLOCK_M rows, on the device.

Imports Triton unconditionally; only oled.kernels.triton_moe imports this module, and only when Triton is
available. The launcher and the layout are documented there.

One program does it all, so the alignment is one launch whatever the routing: a histogram of the slots, padded
offsets by a prefix sum, the block -> slot table, then each pair placed by an atomic increment of its slot's
cursor. A decode call's few hundred pairs are one pass of each. Loops are `while` loops with runtime bounds: a
shape change costs no compilation, and Triton 3.6's interpreter cannot run a `for` over a runtime range under
NumPy >= 2.4 (triton-lang/triton#9171).
"""
import triton
import triton.language as tl


@triton.jit
def _slot_of(pair_slots_ptr, slot_map_ptr, pair, num_pairs, num_routed, num_slots, slot_base, host_bin, shared_bin,
             LOOKUP: tl.constexpr, MAPPED: tl.constexpr, SHARED: tl.constexpr):
    """Each pair's bin (its slot relative to this pool), -1 for a pair without one (-1 in pair_slots, past the
    end, or a slot outside the pool, which is then never read). LOOKUP: pair_slots holds expert ids, and a pair's
    slot is slot_map[id] (the device slot map's row of the layer). MAPPED (with LOOKUP): a pair whose expert has
    no slot goes to bin host_bin + id, which the compute kernels read from the expert's blob in host memory (without
    LOOKUP, num_slots counts those bins too: a pair slot slot_base + host_bin + id names one directly). SHARED: the
    pairs num_routed .. num_pairs - 1 (one a token, past the routed ones) are the shared expert's, bin shared_bin."""
    slot = tl.load(pair_slots_ptr + pair, mask=pair < num_routed, other=-1)
    if LOOKUP:
        expert = slot
        slot = tl.load(slot_map_ptr + expert, mask=expert >= 0, other=-1)
        rel = slot - slot_base
        here = (slot >= 0) & (rel >= 0) & (rel < host_bin)
        if MAPPED:
            rel = tl.where(here, rel, host_bin + expert)
            here = expert >= 0
    else:
        rel = slot - slot_base
        here = (slot >= 0) & (rel >= 0) & (rel < num_slots)
    if SHARED:                  # a routed pair never lands in the shared expert's bin
        shared = (pair >= num_routed) & (pair < num_pairs)
        rel = tl.where(shared, shared_bin, rel)
        here = (here & (rel < shared_bin)) | shared
    return tl.where(here, rel, -1).to(tl.int32)


@triton.jit
def _store_routing(pair_slots_ptr, weights_ptr, routing_ptr, pair, num_routed, TOP_K: tl.constexpr):
    """The routing of `pair`s (a lane vector) into routing [T, 3 * TOP_K] int32: ids as two int32 halves, then the
    weights' fp32 bits."""
    inside = pair < num_routed
    expert = tl.load(pair_slots_ptr + pair, mask=inside, other=0)
    weight = tl.load(weights_ptr + pair, mask=inside, other=0.0).to(tl.float32)
    row = (pair // TOP_K) * (3 * TOP_K)
    col = pair % TOP_K
    tl.store(routing_ptr + row + 2 * col, expert.to(tl.int32), mask=inside)
    tl.store(routing_ptr + row + 2 * col + 1, (expert >> 32).to(tl.int32), mask=inside)
    tl.store(routing_ptr + row + 2 * TOP_K + col, weight.to(tl.int32, bitcast=True), mask=inside)


@triton.jit(do_not_specialize=["num_pairs", "num_routed", "num_slots", "slot_base", "host_bin", "shared_bin",
                               "num_blocks", "num_capture", "x_row_stride", "cpu_capacity"])
def align_pairs_kernel(
    pair_slots_ptr, slot_map_ptr, sorted_pairs_ptr, block_slots_ptr, cursor_ptr, capture_ptr, block_capture_ptr,
    weights_ptr, routing_ptr, cpu_table_ptr, x_ptr, x_rows_ptr, pair_on_cpu_ptr, done_ptr,
    num_pairs, num_routed, num_slots, slot_base, host_bin, shared_bin, num_blocks, num_capture, x_row_stride,
    cpu_capacity,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_FILL: tl.constexpr,
    LOOKUP: tl.constexpr, MAPPED: tl.constexpr, CAPTURE: tl.constexpr, BLOCK_R: tl.constexpr,
    ROUTING: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    CPU_SHARE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_K2: tl.constexpr,
):
    """pair_slots [num_pairs] (or expert ids, with LOOKUP) -> sorted_pairs [num_blocks * BLOCK_M] int32,
    block_slots [num_blocks] int32 (cursor [BLOCK_S] int32 is scratch). num_slots counts the bins: the pool's
    slots (host_bin of them), with MAPPED one bin an expert after them, and with SHARED the last one, shared_bin,
    the shared expert's: pair_slots holds the num_routed routed pairs, and the pairs num_routed .. num_pairs - 1
    are one a token of the shared expert (shared_bin is num_slots, no bin, without SHARED).

    Bins own consecutive rows, those of the experts read from host memory (bins host_bin .. shared_bin - 1) first,
    then the others, each group in bin order: a bin's pairs, then -1 up to a multiple of BLOCK_M. The order of a
    slot's pairs is the atomics' (pair order under the interpreter, any order on a GPU), which no result depends on:
    every row is computed on its own. block_slots[b] is the slot of rows b*BLOCK_M .. b*BLOCK_M + BLOCK_M - 1, or -1
    for a block past the used rows (the compute kernels' programs for it return at once; its rows of sorted_pairs
    are never written or read).

    CAPTURE (with MAPPED): capture [num_capture <= BLOCK_R] int64 holds slots of the pool (absolute, as
    slot_map's; -1 for none): free ones, or ones whose expert the host would evict next. A slot is usable if no pair
    of this call is computed from it. The experts read from host memory, in increasing id, take the usable slots in
    their order: the i-th one's first block gets block_capture = (i-th usable slot) - slot_base, every other block
    -1, and the compute kernels of that block write the tiles they read into that slot, so the expert is resident
    after the call with no copy (and the slot's old expert, which this call did not read, is gone).

    ROUTING (with LOOKUP): the call's routing is stored as well, for the host, into routing [T, 3 * TOP_K] int32
    (T = num_pairs / TOP_K): row t holds the ids of pairs t * TOP_K .. as int64 (two int32 halves each, low first),
    then their weights (weights [num_pairs], any float dtype) as fp32 bits. On a GPU routing is pinned host memory
    written through its mapped address: the read-back with no copy node and no concatenation.

    CPU_SHARE (with MAPPED and ROUTING): part of the experts read from host memory are computed on the CPU instead,
    inside the forward. With m such experts (bins with pairs) among d experts the call computes (every bin with
    pairs but the shared expert's), the c = min(cpu_table[m], m, d - cpu_capacity) of highest id are the CPU's
    (only misses the layer's cpu_capacity slots could not keep beside its hits): their bins get no rows (nothing
    of the call computes them, nor captures them: the capture ranks the others), pair_on_cpu [num_routed] int32
    gets 1 for each of their pairs (0 for every other), and the input rows x [T, HIDDEN] (row stride x_row_stride)
    of every token with such a pair are stored into x_rows [T, HIDDEN] (pinned host memory: the CPU's input). Then
    done [1] int32 (pinned; the host sets it once the CPU's rows are written, the combine waits for it) is set to 0
    by a system-scope acquire-release exchange, and only then is the routing stored: a host that sees the routing
    sees the input rows and done's reset before it. The host learns the CPU's experts from the routing by the same
    rule (oled/runtime/cpu_share.py).
    """
    lane = tl.arange(0, BLOCK_P)
    slots = tl.arange(0, BLOCK_S)
    fill = tl.arange(0, BLOCK_FILL)

    counts = tl.zeros([BLOCK_S], tl.int32)
    start = 0
    while start < num_pairs:
        if ROUTING and not CPU_SHARE:
            _store_routing(pair_slots_ptr, weights_ptr, routing_ptr, start + lane, num_routed, TOP_K)
        slot = _slot_of(pair_slots_ptr, slot_map_ptr, start + lane, num_pairs, num_routed, num_slots, slot_base,
                        host_bin, shared_bin, LOOKUP, MAPPED, SHARED)
        # masked-out lanes are 0, not -1: the interpreter's masked histogram takes them back off bin 0
        counts += tl.histogram(tl.where(slot >= 0, slot, 0), BLOCK_S, mask=slot >= 0)
        start += BLOCK_P
    to_cpu = slots < 0                          # no bin, unless CPU_SHARE gives some to the CPU
    if CPU_SHARE:
        mapped_bins = (slots >= host_bin) & (slots < shared_bin) & (counts > 0)
        num_mapped = tl.sum(mapped_bins.to(tl.int32), axis=0)
        demanded = tl.sum(((counts > 0) & (slots < shared_bin)).to(tl.int32), axis=0)
        num_cpu = tl.minimum(tl.minimum(tl.load(cpu_table_ptr + num_mapped), num_mapped),
                             tl.maximum(demanded - cpu_capacity, 0))
        mapped_rank = tl.cumsum(mapped_bins.to(tl.int32), axis=0) - 1
        to_cpu = mapped_bins & (mapped_rank >= num_mapped - num_cpu)
        counts = tl.where(to_cpu, 0, counts)    # no rows, no blocks, no capture
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    # the experts read from host memory first: their blocks are launched first, so their PCIe-bound reads start before
    # the pool's blocks rather than after them (no gain measured in an isolated call: the reads are bound by PCIe's
    # bandwidth, not by when they start)
    on_pcie = (slots >= host_bin) & (slots < shared_bin)
    padded_pcie = tl.where(on_pcie, padded, 0)
    padded_rest = padded - padded_pcie
    pcie_rows = tl.sum(padded_pcie, axis=0)
    starts = tl.where(on_pcie, tl.cumsum(padded_pcie, axis=0) - padded_pcie,
                      pcie_rows + tl.cumsum(padded_rest, axis=0) - padded_rest)
    used_rows = tl.sum(padded, axis=0)

    # a CPU bin's cursor starts far below 0, so its pairs' rows (the atomics' old values) stay negative: not placed
    tl.store(cursor_ptr + slots, tl.where(to_cpu, -(1 << 30), starts))
    blocks = padded // BLOCK_M
    most = tl.max(blocks, axis=0)
    j = 0
    while j < most:
        tl.store(block_slots_ptr + starts // BLOCK_M + j, slots, mask=j < blocks)
        j += 1
    first = used_rows // BLOCK_M
    while first < num_blocks:
        tl.store(block_slots_ptr + first + fill, tl.full([BLOCK_FILL], -1, tl.int32), mask=first + fill < num_blocks)
        first += BLOCK_FILL
    first = 0
    while first < used_rows:
        tl.store(sorted_pairs_ptr + first + fill, tl.full([BLOCK_FILL], -1, tl.int32), mask=first + fill < used_rows)
        first += BLOCK_FILL
    if CAPTURE:
        first = 0
        while first < num_blocks:
            tl.store(block_capture_ptr + first + fill, tl.full([BLOCK_FILL], -1, tl.int32),
                     mask=first + fill < num_blocks)
            first += BLOCK_FILL
    tl.debug_barrier()          # cursors and padding written before any thread places a pair
    if CAPTURE:
        armed = tl.arange(0, BLOCK_R)
        cap = tl.load(capture_ptr + armed, mask=armed < num_capture, other=-1)
        cap_bin = (cap - slot_base).to(tl.int32)                                  # a pool slot is its own bin
        readers = tl.sum(tl.where(slots[None, :] == cap_bin[:, None], counts[None, :], 0), axis=1)
        usable = (cap >= 0) & (readers == 0)
        usable_rank = tl.cumsum(usable.to(tl.int32), axis=0) - 1
        # bins host_bin + id, in increasing expert id (not the shared expert's, after them)
        on_host = (slots >= host_bin) & (slots < shared_bin) & (counts > 0)
        rank = tl.cumsum(on_host.to(tl.int32), axis=0) - 1
        match = on_host[:, None] & usable[None, :] & (usable_rank[None, :] == rank[:, None])
        slot_of_bin = tl.sum(tl.where(match, cap_bin[None, :] + 1, 0), axis=1) - 1   # -1: no usable slot left
        tl.store(block_capture_ptr + starts // BLOCK_M, slot_of_bin, mask=slot_of_bin >= 0)

    start = 0
    while start < num_pairs:
        pair = start + lane
        slot = _slot_of(pair_slots_ptr, slot_map_ptr, pair, num_pairs, num_routed, num_slots, slot_base, host_bin,
                        shared_bin, LOOKUP, MAPPED, SHARED)
        placed = slot >= 0
        row = tl.atomic_add(cursor_ptr + tl.where(placed, slot, 0), 1, mask=placed, sem="relaxed")
        tl.store(sorted_pairs_ptr + row, pair, mask=placed & (row >= 0))
        if CPU_SHARE:
            tl.store(pair_on_cpu_ptr + pair, (placed & (row < 0)).to(tl.int32), mask=pair < num_routed)
        start += BLOCK_P
    if CPU_SHARE:
        tl.debug_barrier()      # pair_on_cpu written before it is read back below
        # the rows in tiles of 16 tokens x 1,024 columns (a tile without a CPU token skipped): a few iterations of
        # independent loads, where a loop a token and 1,024 columns waited on a load per iteration
        num_tokens = num_routed // TOP_K
        toks = tl.arange(0, 16)
        ks = tl.arange(0, BLOCK_K2)
        cols = tl.arange(0, 1024)
        t = 0
        while t < num_tokens:
            tok = t + toks
            marks = tl.load(pair_on_cpu_ptr + tok[:, None] * TOP_K + ks[None, :],
                            mask=(tok[:, None] < num_tokens) & (ks[None, :] < TOP_K), other=0)
            on_cpu = tl.sum(marks, axis=1) > 0
            if tl.sum(on_cpu.to(tl.int32), axis=0) > 0:
                h = 0
                while h < HIDDEN:
                    here = on_cpu[:, None] & (h + cols[None, :] < HIDDEN)
                    v = tl.load(x_ptr + tok[:, None].to(tl.int64) * x_row_stride + h + cols[None, :], mask=here)
                    tl.store(x_rows_ptr + tok[:, None].to(tl.int64) * HIDDEN + h + cols[None, :], v, mask=here)
                    h += 1024
            t += 16
        # the input rows and the reset of done land before the routing, which tells the host they are there
        tl.atomic_xchg(done_ptr, 0, sem="acq_rel", scope="sys")
        start = 0
        while start < num_routed:
            _store_routing(pair_slots_ptr, weights_ptr, routing_ptr, start + lane, num_routed, TOP_K)
            start += BLOCK_P
