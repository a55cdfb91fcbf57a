"""The suite's split over two workers (tests/conftest.py): every module that builds network namespaces
with the WAN harness is in the one unit of work that takes turns with the host's network settings."""

from pathlib import Path

from conftest import HOST_NETWORK_MODULES

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_gated_on_the_wan_harness_takes_turns_with_the_others():
    gated = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
             if path.name != Path(__file__).name and "harness_available()" in path.read_text()}
    assert gated == HOST_NETWORK_MODULES
