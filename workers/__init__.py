"""Prefill and decode worker processes, the paged Llama model they run, and ``kvpool demo`` (docs/workers.md)."""
