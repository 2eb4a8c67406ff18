"""The Hopper (sm_90a) forward kernel and its export."""
