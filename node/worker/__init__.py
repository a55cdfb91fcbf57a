"""The contributor side: the stage worker (gRPC runtime, compute thread, forward stash) and the `join` daemon."""
