"""kvpool: a node-local KV-cache sharing pool for LLM serving."""

__version__ = "0.1.0"
