"""hcfjax: DeepSeek-V3/R1-class MoE inference in JAX and Pallas.

model = hcfjax.load("path/to/checkpoint")
out = hcfjax.generate(model, ["def fib(n):"], max_new_tokens=64)
print(out.text[0], out.stats)
"""

from hcfjax.api import DEFAULT_MODEL, load, save
from hcfjax.config import ModelConfig
from hcfjax.generate import GenerationResult, forward, generate
from hcfjax.model import Model
from hcfjax.options import Options
from hcfjax.sampling import SamplingParams
from hcfjax.speculative import SpeculativeConfig

__all__ = [
    "DEFAULT_MODEL",
    "GenerationResult",
    "Model",
    "ModelConfig",
    "Options",
    "SamplingParams",
    "SpeculativeConfig",
    "forward",
    "generate",
    "load",
    "save",
]
