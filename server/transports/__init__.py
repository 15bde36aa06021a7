"""How calls reach the control plane: the HTTP app, the fast channel, and a pool in this process."""
