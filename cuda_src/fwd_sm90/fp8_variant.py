"""The FP8 variant of the Hopper forward (FlashFwdSm90 with dtype
Float8E4M3FN, docs/fp8.md): its entry point, its shared memory, its
descales and its P. What changes against the 16-bit kernel:

* Q, K and V are e4m3, V transposed to [batch, heads_kv, head_dim_v, keys]
  with its keys renamed within 32-key slices (fp8_operands.py); O is bf16
  or fp16 in a buffer of its own (Q's holds half its bytes).
* The logits are acc * scale * q_descale * k_descale (one scalar per CTA:
  per (batch, head) descales) and O is scaled by v_descale with the 1 / l
  of the softmax.
* P is requantised to e4m3 for the PV GEMM; the row sums add the float32 P.
* No in-kernel V checks (value_check.py reads 16-bit tiles): the caller
  zeroes V past each sequence's key length, so unseen positions never
  reach a result; a NaN code at a position some row sees also reaches the
  other rows of its query tile that see none of its KV tile's NaNs
  (docs/fp8.md, Limits).
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from .fp8_operands import FP8, store_p_fp8
from .online_softmax import store_converted


class Fp8Variant:
    """FlashFwdSm90's FP8 entry point and helpers (they read its fp8,
    dtype, out_dtype, consumers, kv_stages and tile_n)."""

    @cute.jit
    def call_fp8(
        self, mQ: cute.Tensor, mK: cute.Tensor,
        mVt: cute.Tensor,  # [B, Nkv, Hv, S'] e4m3, S' >= S a multiple of 32 (module docstring)
        mO: cute.Tensor, mLSE: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        scale: cutlass.Float32, diag_offset: cutlass.Int32, window_left: cutlass.Int32,
        window_right: cutlass.Int32, stream: cuda.CUstream,
        mQDescale: cute.Tensor,  # [B, Nq] float32
        mKDescale: cute.Tensor,  # [B, Nkv] float32
        mVDescale: cute.Tensor,  # [B, Nkv] float32
    ):
        """Entry point of the FP8 variant: no softcap, sinks or segments."""
        self._launch(mQ, mK, mVt, mO, mLSE, mQLens, mKVLens, scale, cutlass.Float32(0.0),
                     diag_offset, window_left, window_right, stream, None, None, None, None,
                     descales=(mQDescale, mKDescale, mVDescale))

    @staticmethod
    def _output_type(dtype, out_dtype, plain: bool):
        """(whether the inputs are FP8, O's type) for FlashFwdSm90's
        arguments; FP8 has the plain kernel only (plain: no segments,
        multicast, pages, or CTAs sharing an SM)."""
        fp8 = dtype is FP8
        out_dtype = out_dtype or dtype
        if fp8 != (out_dtype is not dtype) or out_dtype is FP8:
            raise ValueError(f"FlashFwdSm90: out_dtype={out_dtype} with dtype={dtype}: FP8 inputs "
                             "need a 16-bit out_dtype, 16-bit inputs write their own type")
        if fp8 and not plain:
            raise ValueError("FlashFwdSm90: the FP8 variant is the plain kernel only")
        return fp8, out_dtype

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The CTA's shared memory: barriers, Q, the K / V stages and, for
        FP8, O (in the 16-bit kernels O reuses Q's buffer); with an FP8
        cache its stages (paged_fp8.py)."""

        def aligned(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]

        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * self.consumers],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages],
            "sQ": aligned(self.dtype, sQ_layout),
            "sK": aligned(self.dtype, sK_layout),
            "sV": aligned(self.dtype, sV_layout),
        }
        if self.fp8:
            fields["sO"] = aligned(self.out_dtype, sO_layout)
        if self.fp8_cache:
            fields.update(self._fp8_cache_fields())
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def _descaled(self, scale, mQDescale, mKDescale, mVDescale, batch, head_q, head_kv):
        """(the logits' scale, O's scale) of this CTA's (batch, query head)."""
        return (scale * mQDescale[batch, head_q] * mKDescale[batch, head_kv],
                mVDescale[batch, head_kv])

    @cute.jit
    def _store_p(self, acc_S, rP):
        """P (acc_S after the softmax) into the PV GEMM's A registers."""
        if cutlass.const_expr(self.fp8):
            store_p_fp8(acc_S, rP, self.tile_n)
        else:
            store_converted(acc_S, rP)
