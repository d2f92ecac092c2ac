"""Prefill/decode disaggregation: prefill and decode workers as separate processes behind a router, with the
latent KV cache of each request moved from the prefill worker to the decode rank that owns it.

    transport/    KV pieces from a prefill worker to a decode worker: in-process, host-staged socket, jax transfer
    prefill.py    the prefill worker: whole prompts under the prefill plan, KV sent whole or layer by layer
    decode.py     the decode worker: the engine with remote prefill (pages reserved at admission)
    router.py     the user-facing gRPC front end: places requests, streams tokens, health-checks the workers
"""
