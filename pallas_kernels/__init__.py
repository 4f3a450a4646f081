"""Packed-varlen JAX ops for hybrid LMs: one folder per op, a pure-JAX reference and a Pallas kernel."""
