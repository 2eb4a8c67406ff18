"""The forward's online softmax over one S tile held as (rows, cols)
register fragments: running row max and row sum, P = exp2(S * scale_log2 -
max), and the factor by which the output accumulator must be rescaled.

Every exp2 runs on the MUFU: moving a share of them to a cubic on the FMA
pipe was slower each time it was timed (docs/kernel-evidence.md).

The exp2s are cute.arch.exp2, an ex2.approx inline asm with side effects,
rather than the pure cute.math.exp2: LLVM sank and duplicated the pure calls
past the wait for the PV GEMM, which the side effects forbid. Same
instruction, same numerics, and faster at hd128 (docs/kernel-evidence.md).
"""

import operator

import cutlass
import cutlass.cute as cute

# FA4's conditional rescaling: O and the row sum are only rescaled when the
# running row max grows by more than this many powers of two; until then P is
# computed against the stale max, so its entries stay <= 2^8 (exact in fp32,
# no overflow in fp16/bf16) and the final 1/rowsum removes the offset.
# Faster than rescaling every tile at every length timed, once O's factor
# comes out exactly 1 for rows whose reference stayed (docs/kernel-evidence.md).
RESCALE_THRESHOLD_LOG2 = 8.0


@cute.jit
def online_softmax(acc_S_mn, row_max, row_sum, factor, scale_log2, conditional: cutlass.Constexpr,
                   partials: cutlass.Constexpr = 1):
    """Overwrite S with P = exp2(S * scale_log2 - m), update the running
    max m and row sums, and set factor to what O must be scaled by (exactly
    1 for a row whose reference max did not move). Each row's max and sum
    run as `partials` independent chains (reduce_row)."""
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        update_row(acc_S_mn, r, tile_row_max(acc_S_mn, r, partials), row_max, row_sum, factor,
                   scale_log2, conditional, partials)


def tile_row_max(acc_S_mn, r, partials: int):
    """The maximum of row r of the S tile, over the 4 lanes that hold it."""
    return quad_allreduce(reduce_row(acc_S_mn, r, cute.arch.fmax, partials), cute.arch.fmax)


@cute.jit
def update_row(acc_S_mn, r, tile_max, row_max, row_sum, factor, scale_log2,
               conditional: cutlass.Constexpr, partials: cutlass.Constexpr):
    """online_softmax's step for row r once its tile maximum is known (a
    kernel that splits a tile's keys between warpgroups combines their
    maxima first): the new reference max, factor, P and the row sum."""
    prev_max = row_max[r]
    new_max = cute.arch.fmax(prev_max, tile_max)
    if cutlass.const_expr(conditional):
        # Keep the stale reference unless it fell too far behind. From
        # -inf any finite max counts as growth; -inf to -inf does not.
        if (new_max - prev_max) * scale_log2 <= RESCALE_THRESHOLD_LOG2:
            new_max = prev_max
    # A row that has seen only masked keys keeps max -inf; subtracting
    # 0 instead keeps every exp2 at exactly 0 rather than NaN.
    max_scaled = cutlass.Float32(0.0)
    factor[r] = cutlass.Float32(1.0)
    if new_max != -cutlass.Float32.inf:
        max_scaled = new_max * scale_log2
        # The difference first: exactly 0, so a factor of exactly 1, where
        # the reference did not move. As prev_max * scale_log2 -
        # max_scaled, fused into one FMA, it was the product's rounding
        # error, and ex2 of that often fell just below 1, rescaling O
        # on most iterations (docs/kernel-evidence.md).
        factor[r] = cute.arch.exp2((prev_max - new_max) * scale_log2)
    row_max[r] = new_max
    for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
        acc_S_mn[r, c] = cute.arch.exp2(acc_S_mn[r, c] * scale_log2 - max_scaled)
    row_sum[r] = row_sum[r] * factor[r] + reduce_row(acc_S_mn, r, operator.add, partials)


@cute.jit
def rescale_rows(acc_O_mn, factor, conditional: cutlass.Constexpr):
    """O *= factor row by row (online_softmax's factor); with conditional
    rescaling only where some row of the warp moved its reference."""
    num_rows = cute.size(acc_O_mn, mode=[0])
    if cutlass.const_expr(conditional):
        # Skip the multiply when no row of the warp moved its reference
        # (factor < 1 exactly then); the vote keeps the branch warp-uniform.
        smallest = factor[0]
        for r in cutlass.range_constexpr(1, num_rows):
            smallest = cute.arch.fmin(smallest, factor[r])
        if cute.arch.vote_any_sync(smallest < 1.0):
            scale_rows(acc_O_mn, factor)
    else:
        scale_rows(acc_O_mn, factor)


@cute.jit
def scale_rows(acc_mn, factor):
    """acc[r, :] *= factor[r]."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = acc_mn[r, c] * factor[r]


def reduce_row(acc_mn, r, op, partials: int):
    """op over row r of acc_mn as `partials` interleaved chains combined
    pairwise at the end. ptxas keeps a single chain serial (it does not
    reassociate fmax or fadd): 32 dependent instructions per row at 128-key
    tiles, whose latency the softmax then waits out."""
    columns = cute.size(acc_mn, mode=[1])
    chains = [acc_mn[r, c] for c in range(min(partials, columns))]
    for c in range(len(chains), columns):
        chains[c % len(chains)] = op(chains[c % len(chains)], acc_mn[r, c])
    while len(chains) > 1:
        pairs = [op(chains[i], chains[i + 1]) for i in range(0, len(chains) - 1, 2)]
        chains = pairs + chains[len(pairs) * 2:]
    return chains[0]


def quad_allreduce(value, op):
    """Reduce over the 4 lanes that share an accumulator row."""
    value = op(value, cute.arch.shuffle_sync_bfly(value, offset=2))
    return op(value, cute.arch.shuffle_sync_bfly(value, offset=1))


@cute.jit
def store_converted(src, dst):
    """dst <- src in dst's 16-bit type. A fragment whose size is not a power
    of two (hd192's 48 floats per thread, hd256's 40) is converted 8 floats
    at a time: whole, LLVM converted it to bf16 one float at a time (fp16
    came out in pairs) and kept each P in a register of its own until the
    PV GEMM packed the pairs (PRMT), which cost registers and time
    (docs/kernel-evidence.md). Powers of two already came out as
    packed conversions, and keep their code."""
    size = cute.size(src)
    if cutlass.const_expr(size & (size - 1) == 0):
        dst.store(src.load().to(dst.element_type))
    else:
        flat_src = cute.make_tensor(src.iterator, cute.make_layout(size))
        flat_dst = cute.make_tensor(dst.iterator, cute.make_layout(size))
        chunks_src = cute.logical_divide(flat_src, cute.make_layout(8))
        chunks_dst = cute.logical_divide(flat_dst, cute.make_layout(8))
        for j in cutlass.range_constexpr(size // 8):
            chunks_dst[None, j].store(chunks_src[None, j].load().to(dst.element_type))
