"""What the pool tells the outside: KV events in vLLM's format, their publisher, and Prometheus metrics."""
