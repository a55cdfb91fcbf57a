"""Inference through the swarm: the workers' session caches and service, the client that routes a
generation through one worker per stage, and the OpenAI-compatible HTTP front."""
