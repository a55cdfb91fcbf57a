"""A scenario file's schema: defaults, and one line naming the field for every mistake."""

import pytest

from agora.node.simulate.scenario import load_scenario, scenario_from_dict
from agora.pipeline.schema import ConfigError


def test_an_empty_scenario_is_the_defaults():
    scenario = scenario_from_dict({})
    assert scenario.run.stages == len(scenario.compute.ms)
    assert scenario.link("") is scenario.links[0]


@pytest.mark.parametrize("values, message", [
    ({"run": {"stages": 0}}, "run.stages: must be >= 1, got 0"),
    ({"run": {"stages": 1}, "compute": {"ms": [1.0]}}, "run.stages: a pipeline needs 2"),
    ({"dht": {"cpu_ms_at": [[16.0, 40.0], [8.0, 30.0]]}}, "dht.cpu_ms_at: node counts must be >= 1 and increasing"),
    ({"dht": {"get_ms_at": [[8.0, -1.0]]}}, "dht.get_ms_at: every value must be >= 0"),
    ({"links": [{"name": "a", "up_mbit": 1.0, "down_mbit": 1.0, "slow_start_after_idle": "yes"}]},
     "links[0].slow_start_after_idle: "),
    ({"run": {"seconds": "long"}}, "run.seconds: expected a number, got 'long'"),
    ({"run": {"seconds": 10.0, "warmup_s": 10.0}}, "run.warmup_s: 10.0 leaves nothing"),
    ({"compute": {"ms": [10.0, 10.0]}}, "compute.ms: 2 stages given, run.stages is 3"),
    ({"compute": {"ms": [10.0, 0.0, 10.0]}}, "compute.ms: every stage's compute must be > 0"),
    ({"links": [{"name": "a", "up_mbit": 0.0, "down_mbit": 1.0}]}, "links[0].up_mbit: must be > 0, got 0.0"),
    ({"links": [{"name": "a", "up_mbit": 1.0}]}, "links[0].down_mbit: field required"),
    ({"links": [{"name": "a", "up_mbit": 1.0, "down_mbit": 1.0}] * 2}, "links: names must differ"),
    ({"trainers": {"link": "dsl"}}, "trainers.link: no link named 'dsl' (known: lan)"),
    ({"trainers": {"count": 0}}, "trainers.count: must be > 0, got 0"),
    ({"workers": {"slowdown": [1.0, -2.0]}}, "workers.slowdown: every factor must be > 0"),
    ({"averaging": {"method": "diloco"}}, "averaging.method: expected one of sparta or none, got 'diloco'"),
    ({"churn": {"arrivals": 3}}, "churn.arrivals: unknown field (known: admission_s, arrivals_per_hour"),
    ({"wires": {}}, "wires: unknown field"),
])
def test_a_bad_field_is_one_line_naming_it(values, message):
    with pytest.raises(ConfigError) as error:
        scenario_from_dict(values)
    text = str(error.value)
    assert text.startswith(message)
    assert "\n" not in text


def test_a_file_names_itself_with_the_field(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[run]\nstages = 3\n[trainers]\ncpu_ms = -1.0\n")
    with pytest.raises(ConfigError, match=r"^.*s\.toml: trainers\.cpu_ms: must be >= 0, got -1\.0$"):
        load_scenario(path)
    path.write_text("[run\n")
    with pytest.raises(ConfigError, match=r"s\.toml: not valid TOML"):
        load_scenario(path)
    with pytest.raises(ConfigError, match=r"cannot read the scenario"):
        load_scenario(tmp_path / "missing.toml")


def test_a_file_gives_its_values(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[run]\nstages = 2\n[compute]\nms = [5, 7.5]\n'
                    '[[links]]\nname = "dsl"\nup_mbit = 20\ndown_mbit = 100\nrtt_ms = 40\n')
    scenario = load_scenario(path)
    assert scenario.compute.ms == (5.0, 7.5)
    assert scenario.links[0].rtt_ms == 40.0


def test_the_command_prints_the_result_and_refuses_a_bad_file(tmp_path, capsys):
    from agora.node.cli import main

    path = tmp_path / "s.toml"
    path.write_text('[run]\nseconds = 2.0\nstages = 2\n[compute]\nms = [10.0, 10.0]\n[averaging]\nmethod = "none"\n')
    assert main(["simulate", "--scenario", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "bottleneck: " in out
    path.write_text("[run]\nstages = 0\n")
    assert main(["simulate", "--scenario", str(path)]) == 2
    assert "run.stages: must be >= 1, got 0" in capsys.readouterr().err


def test_the_shipped_example_scenario_is_valid():
    from pathlib import Path

    scenario = load_scenario(Path(__file__).resolve().parents[2] / "bench" / "scenarios" / "pluralis_8b_mixed.toml")
    assert scenario.run.stages == len(scenario.compute.ms) == 7
