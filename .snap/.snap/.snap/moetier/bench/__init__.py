"""Benchmark tooling: random checkpoints with real model shapes (``moetier make-bench-model``)."""
