"""Fused GPU kernels (Triton) for the hot, launch-bound parts of decode; each has an eager reference."""
