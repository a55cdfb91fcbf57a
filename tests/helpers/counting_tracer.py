"""`CountingTracer`: a tracer that counts the spans it is asked for, to show that code which should
make none (tracing off, a share of 0) asks for none."""

from __future__ import annotations

__all__ = ["CountingTracer"]


class CountingTracer:
    def __init__(self, tracer):
        self._tracer, self.asked = tracer, 0

    def start_span(self, *args, **kwargs):
        self.asked += 1
        return self._tracer.start_span(*args, **kwargs)

    def start_as_current_span(self, *args, **kwargs):
        self.asked += 1
        return self._tracer.start_as_current_span(*args, **kwargs)
