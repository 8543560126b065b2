"""OLED-MoE: offloaded inference for Mixture-of-Experts diffusion LLMs (LLaDA2.0, LLaDA-MoE)."""
__version__ = "0.1.0"       # before the imports: a module they reach may read it

from .config import EngineConfig
from .decoding.params import DecodeParams
from .llm import LLM, Output

__all__ = ["LLM", "Output", "EngineConfig", "DecodeParams"]
