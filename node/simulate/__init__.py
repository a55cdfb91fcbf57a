"""A discrete-event simulation of a swarm that calls the project's own decisions (`agora-node simulate`)."""
