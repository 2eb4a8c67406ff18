"""The Hopper (sm_90a) MLA decoding kernel and its export."""
