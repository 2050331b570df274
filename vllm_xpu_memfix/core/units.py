"""Byte units, and the host staging of one on-the-fly int4 layer, shared by fixes and tools."""

MiB = 1024**2
GiB = 1024**3
# Host bytes staged per parameter of a sym_int4 layer: bf16 copy, fp32 upcast, int4, scales.
STAGING_BYTES_PER_PARAM = 2 + 4 + 0.5 + 2 / 128
