"""The Hopper (sm_90a) backward kernel and its export."""
