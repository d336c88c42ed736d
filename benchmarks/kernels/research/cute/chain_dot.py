"""The consumers' arithmetic in the persistent GEMV chain (`stream_chain.py`): one warp
reduces a ring stage's whole weight rows against the phase input in shared memory.

Why two kinds: the CUDA-core dot (`row_dot`) is the plain form; the tensor-core form
(`unit_mma`) takes a lane's 16-byte weight chunk as a whole m16n8k16 A fragment, which cut a
warp's time per 16 KB stage from ~2.9 to ~1.2 us (NOTES.md).
"""

# No `from __future__ import annotations`: CuTe DSL reads the kernels' annotations at trace time.

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32


@cute.jit
def consume_unit(atom, ring: cute.Tensor, xs: cute.Tensor, acc: cute.Tensor, s, acc0,
                  rows: cutlass.Constexpr, vpr: cutlass.Constexpr, sets: cutlass.Constexpr, lane,
                  chunk_el: cutlass.Constexpr, consume: cutlass.Constexpr,
                  mma: cutlass.Constexpr, row_sum: cutlass.Constexpr,
                  rolled: cutlass.Constexpr = False):  # fmt: skip
    """One warp reduces the unit in stage s against the input: its rows' sums land in
    acc[acc0 ..] (tensor cores: `unit_mma`; CUDA cores: one row at a time)."""
    if cutlass.const_expr(consume and mma):
        unit_mma(atom, ring, xs, acc, s * (chunk_el // 8), acc0, rows, vpr, sets, lane,
                  row_sum, rolled)  # fmt: skip
    if cutlass.const_expr(consume and not mma):
        for r in cutlass.range_constexpr(rows):
            part = row_dot(ring, xs, s * (chunk_el // 8) + r * vpr, vpr, lane)
            part = cute.arch.warp_reduction_sum(part, threads_in_group=32)
            if lane == 0:
                acc[acc0 + r] = part


@cute.jit
def row_dot(ring: cute.Tensor, xs: cute.Tensor, wvec0, vpr: cutlass.Constexpr, lane):
    """This lane's part of one row's dot product: ring vectors wvec0 + lane + 32 c (8 bf16
    each) against xs vectors lane + 32 c (8 bf16), c < vpr / 32, in an 8-wide accumulator."""
    frag = cute.make_rmem_tensor(cute.make_layout(8), Float32)
    frag.fill(0.0)
    a8 = frag.load()
    for c in cutlass.range_constexpr(vpr // 32):
        w = cute.local_tile(ring, (8,), (wvec0 + c * 32 + lane,)).load().to(Float32)
        a8 = a8 + w * cute.local_tile(xs, (8,), (c * 32 + lane,)).load().to(Float32)
    return a8.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


@cute.jit
def unit_mma(atom, ring: cute.Tensor, xs: cute.Tensor, acc: cute.Tensor, wvec0, acc0,
              rows: cutlass.Constexpr, vpr: cutlass.Constexpr, sets: cutlass.Constexpr,
              lane, row_sum: cutlass.Constexpr = "atomic",
              rolled: cutlass.Constexpr = False):  # fmt: skip
    """A unit's dot products on the tensor cores, no conversions and no shuffles.

    Only the sum over a row's products matters, so a lane's 16-byte weight chunk w0..w7 is
    taken as its whole A fragment of an m16n8k16 MMA: A rows g and g + 8 (g = lane / 4), k
    slots {2t, 2t+1, 2t+8, 2t+9} (t = lane % 4). B column n = x values of the chunks that lanes
    of group n hold: MMA 1 takes their x0, x1, x4, x5 (pairing with A row n), MMA 2 their
    x2, x3, x6, x7 (pairing with A row n + 8). Then D1[n][n] + D2[n + 8][n], held by lane
    4n + n / 2, is group n's share; the other entries are never read. Group n reads chunks of
    row n (8+ rows per unit, 8 rows at a time) or a column share of row n % rows. `sets`
    independent accumulator pairs take the steps in turn (the MMAs' dependency chains).
    `row_sum`: "atomic" adds each group's share into acc with a shared-memory atomic;
    "store" sums a row's groups with shuffles and stores it once. `rolled`: the row blocks and
    the steps (`sets` at a time) as runtime loops: a 32 KB unit fully unrolled took minutes
    to compile.
    """
    per_row = 8 // rows if rows < 8 else 1  # groups sharing a row
    blocks = rows // 8 if rows >= 8 else 1
    if cutlass.const_expr(rolled):
        for rb in range(blocks):
            _row_block(atom, ring, xs, acc, wvec0, acc0, rb, rows, vpr, sets, lane, row_sum,
                       per_row, True)  # fmt: skip
    else:
        for rb in cutlass.range_constexpr(blocks):
            _row_block(atom, ring, xs, acc, wvec0, acc0, rb, rows, vpr, sets, lane, row_sum,
                       per_row, False)  # fmt: skip


@cute.jit
def _row_block(atom, ring: cute.Tensor, xs: cute.Tensor, acc: cute.Tensor, wvec0, acc0, rb,
               rows: cutlass.Constexpr, vpr: cutlass.Constexpr, sets: cutlass.Constexpr, lane,
               row_sum: cutlass.Constexpr, per_row: cutlass.Constexpr,
               rolled: cutlass.Constexpr):  # fmt: skip
    """`unit_mma`'s row block rb (8 rows, or the whole unit below 8 rows)."""
    g = lane // 4
    t = lane % 4
    steps = vpr // (4 * per_row)  # chunk steps per group and row block
    if cutlass.const_expr(rolled and steps % sets):
        raise ValueError(f"rolled: {steps} steps per row block, not a multiple of sets={sets}")
    d1 = []
    d2 = []
    for _ in cutlass.range_constexpr(sets):
        a1 = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), Float32)
        a2 = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            a1[i] = Float32(0.0)
            a2[i] = Float32(0.0)
        d1.append(a1)
        d2.append(a2)
    row = rb * 8 + g
    sub = 0
    if cutlass.const_expr(rows < 8):
        row = g // per_row
        sub = g % per_row
    if cutlass.const_expr(rolled):
        for c0 in range(steps // sets):
            for h in cutlass.range_constexpr(sets):
                _mma_step(atom, ring, xs, d1[h], d2[h], wvec0 + row * vpr,
                          ((c0 * sets + h) * per_row + sub) * 4 + t)  # fmt: skip
    else:
        for c in cutlass.range_constexpr(steps):
            _mma_step(atom, ring, xs, d1[c % sets], d2[c % sets], wvec0 + row * vpr,
                      (c * per_row + sub) * 4 + t)  # fmt: skip
    if cutlass.const_expr(row_sum == "atomic"):
        if t == g // 2:
            v = group_share(d1, d2, sets, g)
            cute.arch.atomic_add((acc.iterator + acc0 + row).llvm_ptr, v, scope="cta")
    else:
        # A unit holds whole rows and one warp takes the unit: every row's sum is made
        # here, so a store replaces the shared-memory float atomic (a CAS loop on sm_90,
        # 8 lanes contending for a row of 7168).
        v = group_share(d1, d2, sets, g)
        if t != g // 2:
            v = Float32(0.0)
        if cutlass.const_expr(rows >= 8):
            if t == g // 2:
                acc[acc0 + row] = v
        else:  # the groups of a row are 32 / rows consecutive lanes
            v = cute.arch.warp_reduction_sum(v, threads_in_group=32 // rows)
            if lane % (32 // rows) == 0:
                acc[acc0 + row] = v


@cute.jit
def _mma_step(atom, ring: cute.Tensor, xs: cute.Tensor, d1, d2, wrow, chunk):
    """One step of `unit_mma`: the lane's 16-byte weight chunk `chunk` of the row starting at
    ring vector `wrow` against the matching x values, into the accumulator pair d1, d2."""
    wf = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
    wf.store(cute.local_tile(ring, (8,), (wrow + chunk,)).load())
    xf = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
    xf.store(cute.local_tile(xs, (8,), (chunk,)).load())
    a = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, 1)), BFloat16)
    for i in cutlass.range_constexpr(8):
        a[i] = wf[i]
    b1 = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), BFloat16)
    b2 = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), BFloat16)
    for i in cutlass.range_constexpr(2):
        b1[i] = xf[i]
        b1[2 + i] = xf[4 + i]
        b2[i] = xf[2 + i]
        b2[2 + i] = xf[6 + i]
    cute.gemm(atom, d1, a, b1, d1)
    cute.gemm(atom, d2, a, b2, d2)


@cute.jit
def group_share(d1: list, d2: list, sets: cutlass.Constexpr, g):
    """Group g's share of its row: D1[g][g] + D2[g + 8][g] summed over the accumulator sets,
    held by lane 4 g + g / 2 (entry 0 / 2 of its fragments for even g, 1 / 3 for odd g)."""
    odd = g % 2
    v = Float32(0.0)
    for h in cutlass.range_constexpr(sets):
        if odd == 1:  # noqa: SIM108 (a runtime branch in the DSL)
            v = v + d1[h][1] + d2[h][3]
        else:
            v = v + d1[h][0] + d2[h][2]
    return v
