"""A clock a test sets by hand, for the pure parts that take `clock=` (flow control, stashes, compute)."""


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
