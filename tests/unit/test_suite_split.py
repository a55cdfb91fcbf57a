"""The suite's split over two workers (tests/conftest.py): every module that builds network namespaces
with the WAN harness is in the one unit of work run one module after another, so they take turns
with the host's network settings."""

from pathlib import Path

from conftest import serial_scope

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_gated_on_the_wan_harness_is_in_the_serial_unit():
    gated = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
             if path.name != Path(__file__).name and "harness_available()" in path.read_text()}
    assert len(gated) >= 3  # bench_quick, dht_scale_swarm, wan_harness at least
    assert {serial_scope(module) for module in gated} == {serial_scope("tests/system/test_swarm.py")}
    assert serial_scope("tests/unit/test_suite_split.py") == "tests/unit/test_suite_split.py"
