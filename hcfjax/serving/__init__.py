"""gRPC serving over the engine (hcfjax.engine).

hcfjax.proto (package hcfjax.v1: Generate, Tokenize) with its generated hcfjax_pb2*.py (`make proto`),
server.py (the Generation service, Health, reflection, graceful shutdown on SIGINT/SIGTERM), metrics.py (Prometheus)
and client.py (a small client for the CLI, the tests and benchmarks). `hcfjax serve` (command.py: its arguments
and its run) and `hcfjax client` run them; config.py turns `hcfjax serve`'s arguments into the engine's and the PD
prefill worker's configs.

The server side is imported from hcfjax.serving.server, so that a client does not load the engine.
"""
