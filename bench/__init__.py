"""Benchmarks and the suite behind `agora-bench` (installed as agora.bench).

Each script also runs on its own (`python bench/<name>.py`); `bench/suite.py` gathers them into
one results table, bench/RESULTS.md. bench/wan/ is the WAN emulation harness.
"""

__all__ = ["SUITE_ROWS"]

# The rows `agora-bench` measures, in order (row 6 comes from row 5's runs, row 8 from
# bench/gpu.py). Here, not in bench/suite.py, so that bench/cli.py can offer them without importing torch.
SUITE_ROWS = ("1", "2", "3", "4", "5", "7", "relay")
