"""A replica of one stage: its compute thread, the stash of inputs and kept graphs, the weight
versions a Backward needs, the ledger of work done, the bounds on what a caller may send, and its
checkpoints. No sockets: the gRPC service (node/worker/) drives it."""
