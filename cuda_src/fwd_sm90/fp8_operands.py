"""The FP8 (e4m3) pieces of the Hopper forward (FlashFwdSm90 with
dtype Float8E4M3FN): P converted from the S accumulator to an FP8 WGMMA A
operand, and the order of the keys that V's transposed copy must follow.

FP8 WGMMA (m64nNk32) reads both operands K-major. For S = Q K^T, Q and K
are K-major as stored. For O = P V the reduction runs over the keys, so V
must be [head_dim_v, keys] with the keys contiguous: jax_flash/_fp8_kernel.py
writes that transposed copy before the call (one XLA pass over V, a few
percent of the kernel's time at 8k; FlashAttention-3 transposes in shared
memory instead, which is the measured alternative still to build).

P from registers. The f32 accumulator of an m64nN WGMMA gives lane l of a
warp, per 8-column group g, the columns 8g + 2(l % 4) + {0, 1} of two rows.
The 8-bit A fragment of an m64k32 WGMMA wants, per 32-column slice, the
columns 4(l % 4) + {0..3} and 16 + 4(l % 4) + {0..3} of the same two rows:
the same count, other columns. Instead of exchanging values between lanes,
the kernel lets each lane keep its own values and renames the keys: within
every 32-key slice, S column c = 8j + 2q + e (j < 4, q < 4, e < 2) becomes
A column key_slot(c) = 16(j // 2) + 4q + 2(j % 2) + e. P V sums over the
keys, so the product is unchanged when V's rows follow the same renaming:
the transposed V holds key c of a slice at column key_slot(c)
(jax_flash/_fp8_kernel.py: value_transposed). Lane-local, the conversion is
a permutation of bytes within each thread's registers.
"""

import cutlass
import cutlass.cute as cute

FP8 = cutlass.Float8E4M3FN
MMA_K = 32  # the K extent of one FP8 WGMMA: keys per slice of P


def key_slot(c: int) -> int:
    """The A-operand column of S column c within a 32-key slice (module
    docstring); a bijection of range(32). The Python mirror of the layouts
    below, for the transposed V and the tests."""
    j, q, e = c // 8, (c % 8) // 2, c % 2
    return 16 * (j // 2) + 4 * q + 2 * (j % 2) + e


def p_fragments(acc_S_shape, tile_n: int):
    """(rP, tOrP): the FP8 registers of P in the A fragment's value order,
    as the target of the conversion (shape matching p_source) and as the PV
    GEMM's A operand ((4, 2, 2) values, one M tile, tile_n / 32 K tiles).

    A fragment value (v0, v1, v2) of K tile k holds row half v1 and column
    4q + v0 + 16 v2 of the slice: in S's numbering column 8(2 v2 + v0 // 2)
    + 2q + v0 % 2, i.e. accumulator entry (v0 % 2) + 2 v1 + 4(4k + 2 v2 +
    v0 // 2). Splitting v0 into (v0 % 2, v0 // 2) gives p_source's layout."""
    if tile_n % MMA_K:
        raise ValueError(f"FP8 P needs tile_n a multiple of {MMA_K}, got {tile_n}")
    slices = tile_n // MMA_K
    rP = cute.make_rmem_tensor(
        cute.make_layout((((2, 2), 2, 2), 1, slices), stride=(((1, 2), 4, 8), 0, 16)), FP8)
    tOrP = cute.make_tensor(
        rP.iterator, cute.make_layout(((4, 2, 2), 1, slices), stride=((1, 4, 8), 0, 16)))
    return rP, tOrP


def p_source(acc_S, tile_n: int):
    """acc_S (a compact ((2, 2, tile_n / 8), 1, 1) f32 fragment) viewed in
    rP's value order (p_fragments)."""
    layout = cute.make_layout((((2, 2), 2, 2), 1, tile_n // MMA_K), stride=(((1, 4), 2, 8), 0, 16))
    return cute.make_tensor(acc_S.iterator, layout)


@cute.jit
def store_p_fp8(acc_S, rP, tile_n: cutlass.Constexpr):
    """rP <- e4m3(P) in the A operand's order. P <= 2^8 (online_softmax's
    threshold) lies inside e4m3's range (448); rounding to nearest even."""
    rP.store(p_source(acc_S, tile_n).load().to(FP8))
