"""bench/idle_cpu.py --profile: each Python process of the swarm profiles its main thread between two
SIGUSR2s and writes `<name>-<pid>.prof` into $AGORA_BENCH_PROFILE_DIR (read them with `python -m pstats`).

Loaded through PYTHONPATH by the interpreter's `site`, in every process the bench starts: the demo's
launcher imports it before it forks the roles, and hivemind's DHT and averager processes are forks of
those, so each inherits the handler. The clock is the thread's CPU time, not the wall: on a shared
machine a wall clock charges a function for the time its thread waited for a core.
"""

import os

_directory = os.environ.get("AGORA_BENCH_PROFILE_DIR")
if _directory:
    import cProfile
    import signal
    import time

    _profiler = None

    def _toggle(signum, frame):
        global _profiler
        if _profiler is None:
            _profiler = cProfile.Profile(time.thread_time)
            _profiler.enable()
            return
        _profiler.disable()
        with open(f"/proc/{os.getpid()}/comm") as comm:
            name = comm.read().strip()
        _profiler.dump_stats(os.path.join(_directory, f"{name}-{os.getpid()}.prof"))
        _profiler = None

    signal.signal(signal.SIGUSR2, _toggle)
