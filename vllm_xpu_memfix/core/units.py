"""Byte units."""

MiB = 1024**2
GiB = 1024**3
