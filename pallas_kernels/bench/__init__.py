"""Benchmarks of the Pallas kernels: scripts that print one table (results in docs/results.md)."""
