"""The backward kernels' mark of a hidden (query, key) pair: P = -0.0, which
exp2 never gives (a visible pair's P underflows to +0.0), set by their masks
and read where dS meets the mask (docs/numerics.md, "NaN and Inf"): dS = P
(dP - delta) is NaN at a hidden pair whose dP or delta is, and must be 0."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

HIDDEN = -0.0
HIDDEN_BITS = 0x80000000


@cute.jit
def zero_where_hidden(dS, P):
    """dS = 0 where a mask marked P hidden (HIDDEN, also in a 16-bit copy):
    delta or dP may be NaN at a hidden pair. dS and P: fragments of one
    layout, both fp32 or both 16-bit (then a word holds two values)."""
    if cutlass.const_expr(P.element_type.width == 32):
        for i in cutlass.range_constexpr(cute.size(dS)):
            hidden = P[i].bitcast(Uint32) == Uint32(HIDDEN_BITS)
            dS[i] = Float32(0.0) if hidden else dS[i]
    else:
        dS_words, P_words = cute.recast_tensor(dS, Uint32), cute.recast_tensor(P, Uint32)
        for i in cutlass.range_constexpr(cute.size(dS_words)):
            p = P_words[i]
            low = Uint32(0xFFFF) if p & Uint32(0xFFFF) == Uint32(HIDDEN_BITS >> 16) else Uint32(0)
            high = Uint32(0xFFFF0000) if p >> Uint32(16) == Uint32(HIDDEN_BITS >> 16) else Uint32(0)
            dS_words[i] = dS_words[i] & (Uint32(0xFFFFFFFF) ^ (low | high))
