"""The trainer side: the swarm trainer, worker routing and discovery, and the client for stage workers."""
