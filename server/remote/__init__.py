"""Pools on other nodes, through NIXL: the agent, the reads, and the endpoints peers call."""
