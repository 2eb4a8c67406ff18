"""The FlashAttention-2 style forward kernel (sm_80 and later) and its export."""
