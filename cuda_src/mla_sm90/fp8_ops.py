"""Device helpers of the FP8 MLA decode kernel (kernel_fp8.py): the
reciprocal the quantisation is defined with, 32-bit shared-memory words,
and the producer's transposition of a latent page into the K-major V tile
that FP8 WGMMA reads.

The transposition works on 4 x 4 byte blocks (4 keys x 4 columns): four
32-bit loads (one per key), eight byte permutes, four 32-bit stores (one
per column). The shared-memory addresses are computed here from the two
layouts, which kernel_fp8.py checks at trace time against what the WGMMA
helpers chose (PAGE_LAYOUT, V_LAYOUT), so that the two cannot drift apart.
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
KEY_QUADS = PAGE // 4
COLUMN_QUADS = LATENT // 4
BLOCKS = KEY_QUADS * COLUMN_QUADS
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


@cute.jit
def page_offset(key, column):
    """Byte offset of (key, column) in a latent page stage (PAGE_LAYOUT)."""
    linear = (key % 8) * 128 + (key // 8) * 1024 + column % 128 + (column // 128) * 8192
    return linear ^ (((linear >> 7) & 7) << 4)


@cute.jit
def v_offset(column, key):
    """Byte offset of (column, key) in a V tile stage (V_LAYOUT)."""
    linear = (column % 8) * 64 + (column // 8) * 512 + key
    return linear ^ (((linear >> 7) & 3) << 4)


@cute.jit
def nan_bytes(word):
    """0xFF in each byte of word that is an e4m3fn NaN, 0 elsewhere."""
    low = word & Uint32(FP8_NAN_LOW_BITS)
    top = (low + Uint32(0x01010101)) & Uint32(0x80808080)
    return (top >> 7) * Uint32(0xFF)


@cute.jit
def transpose_page(page_base, v_base, tid, threads: cutlass.Constexpr, first, shared_keys,
                   kv_len):
    """V tile <- the latent page transposed, by `threads` threads (a whole
    number of warps). In a page that holds keys not every query row sees
    (split-local keys after shared_keys), the codes of keys past kv_len
    become 0 and the NaN codes of the others past shared_keys too: a row
    that sees such a key is already NaN through S, and P = 0 times a NaN
    must not reach the rows that do not (docs/numerics.md).

    A warp takes 4 key quads x 8 column quads per step: its loads (one key
    row each) then fall into 16 banks, its stores (one column each) into 8."""
    partial = first + PAGE - 1 > shared_keys
    for i in cutlass.range(tid, BLOCKS, threads, unroll=1):
        lane, step = i % 32, i // 32
        quad = lane % 4 + 4 * (step % 4)
        column = 4 * (lane // 4 + 8 * (step // 4))
        key = 4 * quad
        w0 = ld_shared_u32(page_base + page_offset(key, column))
        w1 = ld_shared_u32(page_base + page_offset(key + 1, column))
        w2 = ld_shared_u32(page_base + page_offset(key + 2, column))
        w3 = ld_shared_u32(page_base + page_offset(key + 3, column))
        # Pairs of keys interleaved, then the pairs: output word j holds
        # column + j of the four keys, the first key in the lowest byte.
        t0 = byte_perm(w0, w1, 0x5140)
        t1 = byte_perm(w0, w1, 0x7362)
        t2 = byte_perm(w2, w3, 0x5140)
        t3 = byte_perm(w2, w3, 0x7362)
        out = (byte_perm(t0, t2, 0x5410), byte_perm(t0, t2, 0x7632),
               byte_perm(t1, t3, 0x5410), byte_perm(t1, t3, 0x7632))
        keep = Uint32(0xFFFFFFFF)
        band = Uint32(0)
        if partial:
            keep = Uint32(0)
            for r in cutlass.range_constexpr(4):
                if first + key + r < kv_len:
                    keep = keep | Uint32(0xFF << (8 * r))
                if first + key + r > shared_keys:
                    band = band | Uint32(0xFF << (8 * r))
        for j in cutlass.range_constexpr(4):
            word = out[j] & keep & ((nan_bytes(out[j]) & band) ^ Uint32(0xFFFFFFFF))
            st_shared_u32(v_base + v_offset(column + j, key), word)
