"""The local demo swarm: `agora-node demo` and the child processes it spawns."""
