"""Device helpers of the FP8 MLA decode kernel (kernel_fp8.py): the
reciprocal the quantisation is defined with, 32-bit shared-memory words,
and the producer's transposition of a latent page into the K-major V tile
that FP8 WGMMA reads.

The transposition works on 4 x 4 byte blocks (4 keys x 4 columns): four
32-bit loads (one per key), eight byte permutes, four 32-bit stores (one
per column), a warp's 32 lanes a step of 32 blocks, STEPS_IN_FLIGHT at a time.
The shared-memory addresses are computed here from the two layouts, which
kernel_fp8.py checks at trace time against what the WGMMA helpers chose
(PAGE_LAYOUT, V_LAYOUT), so that the two cannot drift apart.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

PAGE = 64  # keys of a page
LATENT = 512  # latent columns (bytes of a key's codes)
# The latent page as TMA writes it for the S product (K-major B operand,
# 128-byte swizzle) and the V tile of the P V product (keys contiguous,
# 64-byte swizzle), one stage each, as cute prints them.
PAGE_LAYOUT = "S<3,4,3> o 0 o ((8,8),(128,4),(1,2)):((128,1024),(1,8192),(0,32768))"
V_LAYOUT = "S<2,4,3> o 0 o ((8,64),(64,1),(1,2)):((64,512),(1,0),(0,32768))"
STAGE_BYTES = PAGE * LATENT
# A step of the transposition moves 32 blocks of 4 keys x 4 columns.
STEPS = PAGE * LATENT // (16 * 32)
# Steps a warp has in flight, all their loads first, so that the later
# steps' loads overlap the first's latency (the page and the V tile never
# alias): 2 ran FP8 decode 6% faster than 1 at 16 and 128 heads (H200).
STEPS_IN_FLIGHT = 2
FP8_NAN_LOW_BITS = 0x7F7F7F7F  # e4m3fn: S.1111.111 is NaN, there is no Inf


@dsl_user_op
def rcp_rn(x, *, loc=None, ip=None):
    """1 / x rounded to nearest (IEEE), as quantize_rows' 1 / scale."""
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def ld_shared_u32(addr, *, loc=None, ip=None):
    return Uint32(llvm.inline_asm(
        T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.b32 $0, [$1];", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def st_shared_u32(addr, value, *, loc=None, ip=None):
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)],
        "st.shared.b32 [$0], $1;", "r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def byte_perm(a, b, selector: int, *, loc=None, ip=None):
    """prmt.b32: byte i of the result is byte selector[i] of (b:a)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def byte_perm_by(a, b, selector, *, loc=None, ip=None):
    """byte_perm with the selector in a register."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip),
                  Uint32(selector).ir_value(loc=loc, ip=ip)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def interleave_selector(first):
    """The prmt selector of (a, b) -> [a.c, b.c, a.c', b.c'] for bytes c =
    first % 4 and c' = (first + 1) % 4: 0x5140 for first 0, 0x7362 for 2."""
    c0, c1 = first & 3, (first + 1) & 3
    return c0 | ((c0 + 4) << 4) | (c1 << 8) | ((c1 + 4) << 12)


# The offsets below take non-negative indices, so shifts and masks stand for
# // and % (which on signed integers cost sign fix-ups).


@cute.jit
def page_offset(key, column):
    """Byte offset of (key, column) in a latent page stage (PAGE_LAYOUT):
    (key % 8) * 128 + (key // 8) * 1024 + column % 128 + (column // 128) *
    8192, 16-byte chunks swizzled by bits 7-9."""
    linear = ((key & 7) << 7) + ((key >> 3) << 10) + (column & 127) + ((column >> 7) << 13)
    return linear ^ (((linear >> 7) & 7) << 4)


@cute.jit
def v_offset(column, key):
    """Byte offset of (column, key) in a V tile stage (V_LAYOUT): (column %
    8) * 64 + (column // 8) * 512 + key, 16-byte chunks swizzled by bits 7-8."""
    linear = ((column & 7) << 6) + ((column >> 3) << 9) + key
    return linear ^ (((linear >> 7) & 3) << 4)


@cute.jit
def nan_bytes(word):
    """0xFF in each byte of word that is an e4m3fn NaN, 0 elsewhere."""
    low = word & Uint32(FP8_NAN_LOW_BITS)
    top = (low + Uint32(0x01010101)) & Uint32(0x80808080)
    return (top >> 7) * Uint32(0xFF)


@cute.jit
def step_offsets(step):
    """(page, V tile) offset terms of step `step` of transpose_page: a step
    moves a lane's block by 16 keys x (step & 3) and 32 columns x (step >>
    2). The fields they touch lie outside the bits that the swizzles read or
    flip, and outside the lane's own, so that each offset is the lane's
    step-0 offset XOR these (checked for every lane and step in numpy)."""
    keys, columns = step & 3, step >> 2
    page = (keys << 11) ^ ((columns & 3) << 5) ^ ((columns >> 2) << 13)
    v = (keys << 4) ^ ((columns & 3) << 11) ^ ((columns >> 2) << 13)
    return page, v


@cute.jit
def transpose_page(page_base, v_base, warp, lane, warps: cutlass.Constexpr, first, shared_keys,
                   kv_len):
    """V tile <- the latent page transposed, by `warps` warps. In a page
    that holds keys not every query row sees (split-local keys after
    shared_keys), the codes of keys past kv_len become 0 and the NaN codes
    of the others past shared_keys too: a row that sees such a key is
    already NaN through S, and P = 0 times a NaN must not reach the rows
    that do not (docs/numerics.md).

    Each of the 64 steps moves 32 blocks: lane l takes key quad l % 4 of
    the step's 4 and column quad l / 4 of its 8, so that a warp's loads (one
    key row each) fall into 16 banks; each quarter of the warp stores its
    four columns in a rotated order (the first permutes start at column
    lane / 8 of the block), so that its stores fall into all 32 (a numpy
    emulation of these addresses and permutes checked both and the
    transpose)."""
    if first + PAGE - 1 > shared_keys:
        _transpose_steps(page_base, v_base, warp, lane, warps, first, shared_keys, kv_len, True)
    else:
        _transpose_steps(page_base, v_base, warp, lane, warps, first, shared_keys, kv_len, False)


@cute.jit
def _transpose_steps(page_base, v_base, warp, lane, warps: cutlass.Constexpr, first, shared_keys,
                     kv_len, clean: cutlass.Constexpr):
    """transpose_page's loop; `clean`: the page holds keys not every row
    sees (its own copy of the loop, so that whole pages pay nothing for it)."""
    key0 = (lane & 3) << 2
    column0 = (lane >> 2) << 2
    rotation = lane >> 3
    page_offsets = [page_offset(key0 + r, column0) for r in range(4)]
    # Output word j of a block holds column column0 + (j + rotation) % 4.
    v_offsets = [v_offset(column0 + ((j + rotation) & 3), key0) for j in range(4)]
    low_pairs, high_pairs = interleave_selector(rotation), interleave_selector(rotation + 2)
    for step0 in cutlass.range(warp, STEPS, STEPS_IN_FLIGHT * warps, unroll=1):
        # Steps past the last load a step that exists and store nothing.
        steps = [cutlass.min(step0 + i * warps, STEPS - 1) for i in range(STEPS_IN_FLIGHT)]
        words = []
        for step in steps:
            page_step, _ = step_offsets(step)
            words.append([ld_shared_u32(page_base + (page_offsets[r] ^ page_step)) for r in range(4)])
        outs = [_block_columns(w, low_pairs, high_pairs) for w in words]
        _store_block(v_base, v_offsets, steps[0], outs[0], first, key0, shared_keys, kv_len, clean)
        for i in cutlass.range_constexpr(1, STEPS_IN_FLIGHT):
            if step0 + i * warps < STEPS:
                _store_block(v_base, v_offsets, steps[i], outs[i], first, key0, shared_keys, kv_len,
                             clean)


@cute.jit
def _block_columns(w, low_pairs, high_pairs):
    """A block's four key words w as its four column words (the first key
    in the lowest byte), in the lane's rotated column order."""
    # Pairs of keys interleaved, then the pairs.
    t0 = byte_perm_by(w[0], w[1], low_pairs)
    t1 = byte_perm_by(w[0], w[1], high_pairs)
    t2 = byte_perm_by(w[2], w[3], low_pairs)
    t3 = byte_perm_by(w[2], w[3], high_pairs)
    return (byte_perm(t0, t2, 0x5410), byte_perm(t0, t2, 0x7632),
            byte_perm(t1, t3, 0x5410), byte_perm(t1, t3, 0x7632))


@cute.jit
def _store_block(v_base, v_offsets, step, out, first, key0, shared_keys, kv_len,
                 clean: cutlass.Constexpr):
    """Stores a block's column words at step `step`, cleaned (see
    transpose_page) where `clean`."""
    _, v_step = step_offsets(step)
    keep = Uint32(0xFFFFFFFF)
    band = Uint32(0)
    if cutlass.const_expr(clean):
        key = first + key0 + ((step & 3) << 4)
        keep = Uint32(0)
        for r in cutlass.range_constexpr(4):
            if key + r < kv_len:
                keep = keep | Uint32(0xFF << (8 * r))
            if key + r > shared_keys:
                band = band | Uint32(0xFF << (8 * r))
    for j in cutlass.range_constexpr(4):
        word = out[j]
        if cutlass.const_expr(clean):
            word = word & keep & ((nan_bytes(word) & band) ^ Uint32(0xFFFFFFFF))
        st_shared_u32(v_base + (v_offsets[j] ^ v_step), word)
