"""Benchmarks that fill the writeup: memory, communication, step time, scaling (see benchmarks/README.md)."""
