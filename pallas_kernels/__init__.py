"""Pallas kernels for Hopper (Mosaic GPU), each beside its pure-jnp reference and benchmark."""
