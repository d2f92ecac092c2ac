"""Benchmarks of the Pallas kernels: scripts that print one table (results in RESULTS.md beside them)."""
