"""CuTe DSL helpers that more than one kernel family uses.

Everything here is traced into the calling kernel (the DSL inlines @cute.jit
calls), so a helper costs nothing at run time and keeps the callers' device
code exactly what it was when each family carried its own copy.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

INT32_MAX = 2**31 - 1
WARP_SIZE = 32
LOG2E = math.log2(math.e)


def m16n8_acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an mma.sync m16n8 accumulator fragment ((2 cols, 2 rows), MMA_M,
    MMA_N) as (rows, cols), so that masks and row reductions can index it by
    the row and column they refer to."""
    shape, stride = acc.layout.shape, acc.layout.stride
    rows_cols = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
        stride=((stride[0][1], stride[1]), (stride[0][0], stride[2])),
    )
    return cute.make_tensor(acc.iterator, rows_cols)



def wgmma_acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a WGMMA accumulator fragment ((2 cols, 2 rows, N/8), MMA_M,
    MMA_N) as (rows, cols)."""
    shape, stride = acc.layout.shape, acc.layout.stride
    rows_cols = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        stride=((stride[0][1], stride[1]), (stride[0][0], stride[0][2], stride[2])),
    )
    return cute.make_tensor(acc.iterator, rows_cols)


def wgmma_acc_as_operand_a(layout):
    """((2, 2, N/8), 1, 1) accumulator layout -> ((2, 2, 2), 1, N/16) A
    operand layout: two neighbouring 8-column groups form one k16 slice. For
    16-bit types an m64nN accumulator holds, per thread, exactly the
    elements of the m64kN A fragment, so a GEMM's result (converted) feeds
    the next GEMM from registers without moving data between threads."""
    shape, stride = layout.shape, layout.stride
    return cute.make_layout(
        ((shape[0][0], shape[0][1], 2), shape[1], shape[0][2] // 2),
        stride=((stride[0][0], stride[0][1], stride[0][2]), stride[1], stride[0][2] * 2),
    )

@cute.jit
def segment_bounds_union(
    mBounds: cute.Tensor,
    sRange: cute.Tensor,
    batch,
    first_index,
    last_index,
    tidx,
    tile_rows: cutlass.Constexpr,
    num_warps: cutlass.Constexpr,
):
    """[min first, max last) of the per-row [first, last) ranges in
    mBounds[batch, first_index .. last_index]. Rows with an empty range add
    nothing. Each of the first tile_rows threads reads one row (so tile_rows
    must not exceed the CTA's threads); warps reduce by shuffles, then through
    sRange (2 Int32 per warp), so that every thread returns the union."""
    first = Int32(INT32_MAX)
    last = Int32(0)
    row = first_index + tidx
    if tidx < tile_rows and row <= last_index:
        b0 = mBounds[batch, row, 0]
        b1 = mBounds[batch, row, 1]
        if b1 > b0:
            first = b0
            last = b1
    for i in cutlass.range_constexpr(5):
        offset = 16 >> i
        first = cutlass.min(first, cute.arch.shuffle_sync_bfly(first, offset=offset))
        last = cutlass.max(last, cute.arch.shuffle_sync_bfly(last, offset=offset))
    warp_idx = tidx // WARP_SIZE
    if tidx % WARP_SIZE == 0:
        sRange[2 * warp_idx] = first
        sRange[2 * warp_idx + 1] = last
    cute.arch.barrier()
    for w in cutlass.range_constexpr(num_warps):
        first = cutlass.min(first, sRange[2 * w])
        last = cutlass.max(last, sRange[2 * w + 1])
    return first, last


@cute.jit
def zero_outside_key_window(acc_mn, tScS, m0, n0, q_len, kv_len, lo, hi, row_seg=None, col_seg=None,
                            value: cutlass.Constexpr = 0.0):
    """Zero the (rows, cols) accumulator entries whose (query i, key j) pair
    is not visible: i >= q_len, j >= kv_len, j - i outside [lo, hi], or (when
    row_seg / col_seg are given) different segment ids. The backward kernels
    compute P and dS from these, so a hidden pair must contribute exactly 0
    (value: -0.0 marks it for hidden_pairs.zero_where_hidden)."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = m0 + tScS[r, 0][0]
        # Visible keys of this row, as tile-local columns [col_lo, col_hi).
        col_lo = row + lo - n0
        col_hi = cutlass.min(kv_len, row + hi + 1) - n0
        if row >= q_len:
            col_hi = Int32(0)
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            col = tScS[r, c][1]
            if cutlass.const_expr(row_seg is not None):
                if col < col_lo or col >= col_hi or row_seg[r] != col_seg[c]:
                    acc_mn[r, c] = Float32(value)
            elif col < col_lo or col >= col_hi:
                acc_mn[r, c] = Float32(value)


def row_store_tile(dtype, cols: int, threads: int) -> cute.TiledCopy:
    """16-byte stores of whole rows of a (rows, cols) tile by `threads`
    threads, a row in 64-column (else 32-column) runs: for
    store_existing_rows."""
    vec = 128 // dtype.width
    thr_cols = (64 if cols % 64 == 0 else 32) // vec
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
        cute.make_ordered_layout((threads // thr_cols, thr_cols), order=(1, 0)),
        cute.make_layout((1, vec)),
    )


@cute.jit
def store_existing_rows(
    tiled_copy, sX, mX, block, seqlen, tidx, rows: cutlass.Constexpr, head_dim: cutlass.Constexpr, dtype
):
    """Store a (rows, head_dim) shared tile to block `block` of a [seqlen,
    head_dim] tensor, skipping the rows past seqlen (the tensor has no room
    for them)."""
    thr = tiled_copy.get_slice(tidx)
    tXsX = thr.partition_S(sX)
    tXgX = thr.partition_D(cute.local_tile(mX, (rows, head_dim), (block, 0)))
    tXcX = thr.partition_S(cute.make_identity_tensor((rows, head_dim)))
    tXrX = cute.make_fragment_like(tXsX, dtype)
    cute.autovec_copy(tXsX, tXrX)
    rows_left = seqlen - block * rows
    for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
        if tXcX[0, m, 0][0] < rows_left:
            cute.copy(tiled_copy, tXrX[None, m, None], tXgX[None, m, None])


@dsl_user_op
def red_add_v2_f32(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """Fire-and-forget fp32x2 reduction into global memory (8-byte aligned;
    the vector form needs sm_90, the scalar halves are what sm_80 would use)."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def logit_scales(scale: Float32, softcap: Float32):
    """(scale_log2, softcap_in) for the kernels' soft capping. Without a cap
    (softcap == 0) S = q.k and the softmax uses S * scale * log2(e). With one,
    the kernels replace S by tanh(S * softcap_in), softcap_in = scale /
    softcap, so the logit softcap * tanh(scale * q.k / softcap) is S * softcap
    and the softmax multiplier becomes softcap * log2(e)."""
    scale_log2 = scale * LOG2E
    softcap_in = Float32(0.0)
    if softcap > Float32(0.0):
        scale_log2 = softcap * LOG2E
        softcap_in = scale / softcap
    return scale_log2, softcap_in


@cute.jit
def tanh_by_exp2(x: Float32) -> Float32:
    """tanh(x) = 1 - 2 / (1 + 2^(2 x log2 e)) on ex2.approx and rcp.approx
    (overflow gives 1 and -1 exactly). Its absolute error, a few 1e-7, is
    what the softmax sees of a logit; the library tanh also evaluated a
    polynomial for small |x|, ten instructions more per score (the capped
    forward is bound by the issue of its softmax instructions)."""
    e = cute.math.exp2(x * Float32(2.0 * LOG2E), fastmath=True)
    return Float32(1.0) - Float32(2.0) * cute.arch.rcp_approx(Float32(1.0) + e)


@cute.jit
def cap_scores(acc: cute.Tensor, softcap_in: Float32):
    """S <- tanh(S * softcap_in) in place when soft capping is on."""
    if softcap_in > Float32(0.0):
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = tanh_by_exp2(acc[i] * softcap_in)


@cute.jit
def cap_scores_with_slope(acc: cute.Tensor, slope: cute.Tensor, softcap_in: Float32):
    """cap_scores, also writing d(logit)/d(scale * q.k) = 1 - tanh^2 into
    slope (the backward multiplies dS by it). Untouched without a cap."""
    if softcap_in > Float32(0.0):
        for i in cutlass.range_constexpr(cute.size(acc)):
            t = tanh_by_exp2(acc[i] * softcap_in)
            acc[i] = t
            slope[i] = Float32(1.0) - t * t


@cute.jit
def capped_score_slope(p: Float32, row_lse_log2: Float32, inv_scale_log2: Float32) -> Float32:
    """1 - tanh^2 of a capped score t = tanh(S * softcap_in), recovered from
    its probability p = exp2(t * scale_log2 - row_lse_log2), so that a
    backward keeps no fragment of t next to P. Where p is 0 (hidden pairs;
    rows without keys, whose lse in log2 is +inf, give NaN) the NaN-quiet
    clamp to [-1, 1] makes the slope 0."""
    t = (cute.math.log2(p, fastmath=True) + row_lse_log2) * inv_scale_log2
    t = cute.arch.fmin(cute.arch.fmax(t, Float32(-1.0)), Float32(1.0))
    return Float32(1.0) - t * t


@dsl_user_op
def ld_acquire_s32(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """ld.acquire.gpu of one int32 in global memory."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [ptr.toint(loc=loc, ip=ip).ir_value()],
            "ld.acquire.gpu.global.b32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def release_add_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """red.release.gpu.add of an int32: every write this thread has ordered
    before the call (through a CTA barrier, those of the whole CTA) is
    visible to whoever acquires the new value. (A release is a gpu-scope
    fence and the add; a fence of its own before it cost a second one.)"""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def wait_at_least(ptr: cute.Pointer, target: Int32):
    """Spin until the int32 at ptr is >= target (acquire)."""
    seen = ld_acquire_s32(ptr)
    while seen < target:
        seen = ld_acquire_s32(ptr)


@cute.jit
def wait_field_at_least(ptr: cute.Pointer, target: Int32, shift: cutlass.Constexpr):
    """Spin until the 16-bit count at bit `shift` of the int32 at ptr is >=
    target (acquire): two counters in one word, each raised by
    release_add_s32 of 1 << shift."""
    seen = (ld_acquire_s32(ptr) >> shift) & 0xFFFF
    while seen < target:
        seen = (ld_acquire_s32(ptr) >> shift) & 0xFFFF


@cute.jit
def first_kv_block_seeing(m_block, m_rows: cutlass.Constexpr, n_rows: cutlass.Constexpr, key_lo):
    """The first KV tile (n_rows keys) whose backward CTA visits query tile
    m_block (m_rows rows) when visible pairs satisfy j - i >= key_lo: the CTAs
    that visit a query tile are consecutive, so the deterministic backward
    numbers their turns from this one."""
    first_key = m_block * m_rows + key_lo
    first = Int32(0)
    if first_key > 0:
        first = first_key // n_rows
    return first


@cute.jit
def query_tile_of(it, kv_head, group, m_block_min, m_blocks, deterministic, rotation=None):
    """(query head, query tile) of iteration `it` of a backward CTA that walks
    `group` query heads x `m_blocks` query tiles from m_block_min.

    By default heads are outermost and tiles ascend. The deterministic orders
    take the heads innermost. Without `rotation` (the sm80 family) tiles go
    last to first: under a mask that hides the last keys from the first
    queries, a CTA then reaches each (head, tile) at the same iteration as
    the CTA of the KV tile before it, whose turn comes first, or later (the
    last tile a CTA visits never decreases from one KV tile to the next).
    With it (sm90) tiles ascend from the `rotation`-th, wrapping around: the
    CTA of the last KV tile that sees a query tile reaches it first
    (last_kv_block_seeing), and without a mask each CTA starts from its own
    tile (rotated_order), so that no two CTAs reach a tile together."""
    head = kv_head * group + it // m_blocks
    m_block = m_block_min + it % m_blocks
    if deterministic != 0:
        head = kv_head * group + it % group
        if cutlass.const_expr(rotation is None):
            m_block = m_block_min + m_blocks - 1 - it // group
        else:
            m_block = m_block_min + (it // group + rotation) % m_blocks
    return head, m_block


@cute.jit
def rotated_order(n_block, m_blocks, kv_len, n_rows: cutlass.Constexpr, key_lo, key_hi, seqlen_q, seqlen_k,
                  resident_ctas, chains):
    """(rotation, first, kv_blocks, chain, chain_count) of a deterministic
    backward CTA (n_rows keys) that walks m_blocks query tiles: it rotates
    with rotation for query_tile_of among the kv_blocks CTAs from KV tile
    first on (rotated_turn), adding into dQ accumulators chain to chain +
    chain_count - 1; kv_blocks = 0 for the unrotated order.

    Rotated, a CTA waits on the turns of CTAs launched after it, so it is
    used only without a mask (every CTA with work walks all the query tiles)
    and among CTAs that fit on the GPU at once (resident_ctas, which the
    launcher picks). A head of more KV tiles splits them into groups of
    consecutive tiles, launched together, each rotating on its own and
    adding into accumulators of its own, so that no CTA waits on another
    group. The caller sizes dq_accum (`chains` accumulators) for the groups
    of seqlen_k keys (launch.cc: jax_flash_bwd_sm90_deterministic_dq_chains);
    with fewer accumulators than groups the order stays unrotated."""
    rotation, first, kv_blocks = Int32(0), Int32(0), Int32(0)
    chain, chain_count = Int32(0), Int32(1)
    visible = (kv_len + n_rows - 1) // n_rows
    sized_groups = ((seqlen_k + n_rows - 1) // n_rows + resident_ctas - 1) // resident_ctas
    if key_hi >= seqlen_k - 1 and key_lo <= 1 - seqlen_q and m_blocks > 0 and sized_groups <= chains:
        groups = (visible + resident_ctas - 1) // resident_ctas
        size = (visible + groups - 1) // groups
        group = n_block // size
        first = group * size
        kv_blocks = cutlass.min(size, visible - first)
        rotation = (n_block - first) % m_blocks
        chain_count = chains // sized_groups
        chain = group * chain_count
    return rotation, first, kv_blocks, chain, chain_count


@cute.jit
def rotated_turn(n_block, tile, kv_blocks, m_blocks):
    """How many CTAs add to query tile `tile` (counted from 0) before the CTA
    of KV tile n_block, when each of kv_blocks CTAs walks all m_blocks tiles
    in the deterministic order with rotation n_block % m_blocks: in order of
    the iteration at which they reach the tile, then of n_block. (With no
    more KV tiles than query tiles, no two CTAs reach a tile at the same
    iteration, so in step they never wait.)"""
    step = (tile - n_block % m_blocks + m_blocks) % m_blocks  # when this CTA reaches it
    laps, rest = kv_blocks // m_blocks, kv_blocks % m_blocks
    # The CTAs reaching it at an earlier step t start at tile - t (mod
    # m_blocks): `laps` CTAs per start, one more for the starts below `rest`.
    first = tile - step + 1
    earlier = cutlass.max(0, cutlass.min(tile + 1, rest) - cutlass.max(first, 0))
    if first < 0:
        earlier += cutlass.max(0, rest - (m_blocks + first))
    return step * laps + earlier + n_block // m_blocks


@cute.jit
def last_kv_block_seeing(m_block, m_rows: cutlass.Constexpr, n_rows: cutlass.Constexpr, key_hi, q_len, kv_len):
    """The last KV tile (n_rows keys) whose backward CTA visits query tile
    m_block (m_rows rows) when visible pairs satisfy j - i <= key_hi, i <
    q_len and j < kv_len; only asked by a CTA that visits the tile, so the
    quotient is of a nonnegative number."""
    rows_end = cutlass.min(q_len, (m_block + 1) * m_rows)
    return cutlass.min((kv_len - 1) // n_rows, (rows_end + key_hi - 1) // n_rows)
