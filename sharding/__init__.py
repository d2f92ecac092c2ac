"""Sharding plans: meshes, partition rules, EP dispatch, DP-attention padding, EPLB, multi-host start-up."""
