"""Benchmarks and the suite behind `agora-node bench` (installed as agora.bench).

Each script also runs on its own (`python bench/<name>.py`); `bench/suite.py` gathers them into
one results table, bench/RESULTS.md. bench/wan/ is the WAN emulation harness.
"""
