"""The Hopper (sm_90a) MLA decoding kernels, one per cache format, and their export."""
