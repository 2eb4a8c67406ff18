"""NaN and Inf in the GPU kernels' 16-bit shared-memory tiles (docs/numerics.md,
"NaN and Inf"): tests on packed 16-bit values, a barrier that ORs a flag
over its threads, and a 16-byte walk over a tile that checks or zeroes the
non-finite values in it.

The tests look at bits, not at float comparisons, so they say the same
whatever the compiler assumes about NaN.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

VECTOR_BITS = 128  # one shared-memory load or store per thread
WORD_BITS = 32
F32_EXPONENT = 0x7F800000
# Bit 15 of both 16-bit halves of a word.
HALF_TOP_BITS = 0x80008000


def _exponent(dtype):
    """(exponent bits, their lowest bit) of a 16-bit float type."""
    if dtype is cutlass.BFloat16:
        return 0x7F80, 0x0080
    if dtype is cutlass.Float16:
        return 0x7C00, 0x0400
    raise TypeError(f"a 16-bit float type, not {dtype}")


@cute.jit
def nonfinite_halves(word: Uint32, dtype: cutlass.Constexpr) -> Uint32:
    """Bit 15 (31) set where the low (high) 16-bit value packed in word is
    NaN or Inf, i.e. has every exponent bit set: adding the exponent's lowest
    bit to the exponent carries into bit 15 exactly then, and never into the
    other half."""
    bits, low = _exponent(dtype)
    return ((word & Uint32(bits | bits << 16)) + Uint32(low | low << 16)) & Uint32(HALF_TOP_BITS)


@cute.jit
def finite_halves(word: Uint32, dtype: cutlass.Constexpr) -> Uint32:
    """word with its NaN and Inf halves replaced by zeros."""
    bad = nonfinite_halves(word, dtype) >> 15  # bit 0 / 16 per bad half
    return word & (Uint32(0xFFFFFFFF) ^ (bad * Uint32(0xFFFF)))


@cute.jit
def is_nonfinite(x: Float32) -> cutlass.Boolean:
    """Whether x is NaN or Inf."""
    return (x.bitcast(Uint32) & Uint32(F32_EXPONENT)) == Uint32(F32_EXPONENT)


@dsl_user_op
def barrier_any(flag: Int32, barrier_id: Int32, threads: Int32, *, loc=None, ip=None) -> Int32:
    """Named barrier `barrier_id` of `threads` threads that also ORs their
    flags (bar.red.or): 1 in every one of them if any passed a nonzero flag,
    else 0."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(flag).ir_value(loc=loc, ip=ip), Int32(barrier_id).ir_value(loc=loc, ip=ip),
             Int32(threads).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, $1, 0;\n\tbar.red.or.pred q, $2, $3, p;\n"
            "\tselp.u32 $0, 1, 0, q;\n}",
            "=r,r,r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def vector_copy(dtype, tile_shape, threads: int) -> cute.TiledCopy:
    """`threads` threads walking a (contiguous, rows) shared tile 16 bytes at
    a time: neighbouring threads take neighbouring vectors along mode 0 (the
    contiguous one, within a swizzle atom), the rest of them the next rows."""
    vec = VECTOR_BITS // dtype.width
    along = math.gcd(tile_shape[0] // vec, threads)
    across = threads // along
    if tile_shape[0] % vec or tile_shape[1] % across:
        raise ValueError(f"a {tile_shape} tile does not split into 16-byte vectors over {threads} threads")
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=VECTOR_BITS),
        cute.make_layout((along, across)),
        cute.make_layout((vec, 1)),
    )


@cute.jit
def _thread_vectors(tile, tiled_copy, tidx):
    """(shared vectors, their coordinates): this thread's 16-byte vectors of
    tile as (values, vector index), and the flat (mode 0, mode 1)
    coordinates of their values (a shared tile's modes are nested, swizzle
    atoms; the same elements in the same order)."""
    thr = tiled_copy.get_slice(tidx)
    src = thr.partition_S(tile)
    coords = thr.partition_S(cute.make_identity_tensor(cute.product_each(tile.shape)))
    return cute.group_modes(src, 1, cute.rank(src)), cute.group_modes(coords, 1, cute.rank(coords))


@cute.jit
def _load_words(vector):
    """A shared 16-byte vector into registers, as (values, 32-bit words)."""
    frag = cute.make_fragment_like(vector)
    cute.autovec_copy(vector, frag)
    return frag, cute.recast_tensor(frag, Uint32)


@cute.jit
def any_nonfinite(tile, tiled_copy, tidx, rows_valid, dtype: cutlass.Constexpr,
                  row_mode: cutlass.Constexpr = 1) -> Int32:
    """Nonzero if one of this thread's vectors of tile (vector_copy, or any
    tiled copy of 16-byte vectors) in a row below rows_valid (rows: tile's
    mode row_mode) holds a NaN or Inf. A vector at a time (a loop, not
    unrolled): the callers run it beside their accumulators."""
    vectors, coords = _thread_vectors(tile, tiled_copy, tidx)
    bits, low = _exponent(dtype)
    # Sums of the exponents, ORed, tested once at the end.
    sums = Uint32(0)
    for v in cutlass.range(cute.size(vectors, mode=[1]), unroll=1):
        _, words = _load_words(vectors[None, v])
        if coords[0, v][row_mode] < rows_valid:
            for k in cutlass.range_constexpr(cute.size(words)):
                sums = sums | ((words[k] & Uint32(bits | bits << 16)) + Uint32(low | low << 16))
    return Int32((sums & Uint32(HALF_TOP_BITS)) != Uint32(0))


@cute.jit
def zero_nonfinite(tile, tiled_copy, tidx, rows_valid, dtype: cutlass.Constexpr,
                   row_mode: cutlass.Constexpr = 1):
    """Zero this thread's vectors of tile (as in any_nonfinite) in rows from
    rows_valid on and the NaN and Inf values of the others, a vector at a
    time. The caller makes the stores visible (to the async proxy, to other
    threads)."""
    vectors, coords = _thread_vectors(tile, tiled_copy, tidx)
    for v in cutlass.range(cute.size(vectors, mode=[1]), unroll=1):
        frag, words = _load_words(vectors[None, v])
        keep = coords[0, v][row_mode] < rows_valid
        for k in cutlass.range_constexpr(cute.size(words)):
            words[k] = finite_halves(words[k], dtype) if keep else Uint32(0)
        cute.autovec_copy(frag, vectors[None, v])


@cute.jit
def zero_nonfinite_everywhere(tile, tidx, threads: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """Zero the NaN and Inf values of a whole shared tile, `threads` threads
    taking its 16-byte vectors in turn. Every value is visited, so the
    vectors are taken in memory order, the swizzle that maps the tile's
    coordinates onto them ignored: no index arithmetic beyond a pointer."""
    per_vec = VECTOR_BITS // WORD_BITS
    vectors = cute.cosize(tile.layout) * dtype.width // VECTOR_BITS
    words = cute.make_tensor(cute.recast_ptr(tile.iterator, swizzle_=None, dtype=Uint32),
                             cute.make_layout((per_vec, vectors)))
    for v in cutlass.range(tidx, vectors, threads, unroll=1):
        frag = cute.make_rmem_tensor(per_vec, Uint32)
        cute.autovec_copy(words[None, v], frag)
        for k in cutlass.range_constexpr(per_vec):
            frag[k] = finite_halves(frag[k], dtype)
        cute.autovec_copy(frag, words[None, v])

