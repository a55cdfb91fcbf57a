"""A replica's membership of its stage: the sync phases a joiner goes through, the state download
and the donor side that serves it, and rebalancing to a stage short of replicas."""
