r"""The serving engine: continuous batching over the paged latent cache.

    engine = Engine(hcfjax.load(), EngineConfig(max_slots=16))
    engine.start()                                   # the step loop runs on a background thread
    req = engine.submit("def fib(n):", max_new_tokens=32, sampling=SamplingParams(0.7), seed=1, stop=["\n\n"])
    for out in engine.stream(req):                   # Output events: token_ids, text delta, finish, usage
        print(out.text, end="")
    engine.shutdown()

Files, one job each: request.py (lifecycle, Output events), pages.py (page allocator with reference counts),
scheduler.py (chunked prefill, shortest-prompt-first, decode admission, preemption), balance.py (DP rank choice),
runner.py (the jitted step and its device state), config.py (EngineConfig), engine.py (the loop, streaming,
overlap of host and device).
Requests are checked and encoded by hcfjax.frontdoor; their text and stop strings are streamed by
hcfjax.detokenize.
"""

from hcfjax.engine.config import EngineConfig, EngineStopped, QueueFull
from hcfjax.engine.engine import Engine
from hcfjax.engine.request import FinishReason, Output, Request, Status, Usage
from hcfjax.frontdoor import InvalidRequest

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "FinishReason",
    "InvalidRequest",
    "Output",
    "QueueFull",
    "Request",
    "Status",
    "Usage",
]
