"""Benchmarks, run by hand: ``python -m tests.bench.<name>``; pytest does not collect them."""
