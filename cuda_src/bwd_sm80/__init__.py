"""The FlashAttention-2 style backward kernel (sm_80 and later) and its export."""
