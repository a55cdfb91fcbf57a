"""Run configuration: presets, TOML files, and readable errors naming the field."""

import pytest

from agora.pipeline.config import PRESETS, ConfigError, config_from_dict, config_to_dict, load_config, split_layers


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid_configs(name):
    assert load_config(name) == PRESETS[name]


def test_toml_fills_typed_fields_over_a_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\nseed = 3\n[model]\nrank = 8\nlayer_split = [3, 3]\n'
                    '[optim]\nlr = 1\n[train]\nbatch_size = 4\n')
    config = load_config(path)
    assert config.seed == 3 and config.model.rank == 8 and config.model.layer_split == (3, 3)
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.model.d_model == PRESETS["tiny"].model.d_model


@pytest.mark.parametrize("text, field", [
    ("[model]\nwidth = 3\n", "model.width"),
    ("[model]\nd_model = 'big'\n", "model.d_model"),
    ("[model]\nlayer_split = [1, 1]\n", "model.layer_split"),
    ("[train]\nmicrobatches = 3\n", "train.microbatches"),
    ("[optim]\nbetas = [0.9]\n", "optim.betas"),
    ("preset = 'huge'\n", "preset"),
    ("[model\n", "invalid TOML"),
    ("[train]\nseq_len = 100000\n", "train.seq_len"),
])
def test_bad_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(path)


def test_missing_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config("/no/such/file.toml")


def test_round_trip_through_plain_values():
    for config in PRESETS.values():
        assert config_from_dict(config_to_dict(config)) == config


def test_split_layers():
    assert split_layers(6, 3) == (2, 2, 2)
    assert split_layers(7, 3) == (3, 2, 2)
    with pytest.raises(ConfigError):
        split_layers(2, 3)


def test_run_flags_set_the_schedule_and_the_averaging_cadence():
    from agora.node.cli import build_parser
    from agora.node.run_flags import run_config

    def config_of(*argv):
        return run_config(build_parser().parse_args(["join", "--stage", "0", *argv]))

    tiny = PRESETS["tiny"]
    assert config_of("--steps", "50").optim.total_steps == tiny.optim.total_steps  # a shorter run keeps the schedule
    assert config_of("--steps", "5000").optim.total_steps == 5000  # a longer one stretches it
    assert config_of("--steps", "50", "--schedule-steps", "50").optim.total_steps == 50
    sync = config_of("--averaging", "sparta", "--averaging-every", "2", "--averaging-fraction", "0.5").sync
    assert (sync.method, sync.every_steps, sync.n_slices) == ("sparta", 2, 2)
    with pytest.raises(ConfigError, match="total_steps"):
        config_of("--schedule-steps", "0")


def test_batch_flags_set_the_global_batch_and_refuse_a_split_that_does_not_divide():
    from agora.node.cli import build_parser
    from agora.node.run_flags import run_config
    from agora.node.demo.demo import DemoOptions

    def config_of(*argv):
        return run_config(build_parser().parse_args(["join", "--stage", "0", *argv]))

    train = config_of("--batch-size", "32", "--microbatches", "8").train
    assert (train.batch_size, train.microbatches, train.microbatch_size) == (32, 8, 4)
    with pytest.raises(ConfigError, match="does not divide batch_size=30"):
        config_of("--batch-size", "30", "--microbatches", "8")
    # The demo hands the same flags to every process it starts.
    demo = DemoOptions.from_args(build_parser().parse_args(["demo", "--batch-size", "32", "--microbatches", "8"]))
    flags = demo.run_flags()
    assert flags[flags.index("--batch-size") + 1] == "32" and flags[flags.index("--microbatches") + 1] == "8"


def test_the_demo_hands_its_children_a_config_file_by_its_absolute_path(tmp_path, monkeypatch):
    """Each child runs in a working folder of its own: `demo --config wide.toml` from the user's
    folder must reach them as a path they can open (before, the authorizer exited 2 on it)."""
    from agora.node.demo.demo import DemoOptions

    (tmp_path / "wide.toml").write_text('preset = "tiny"\n[train]\nbatch_size = 32\nmicrobatches = 32\n')
    monkeypatch.chdir(tmp_path)
    flags = DemoOptions(config="wide.toml").run_flags()
    assert flags[flags.index("--config") + 1] == str(tmp_path / "wide.toml")
    for config in ("tiny", "no-such-file.toml"):  # a preset by name; a typo left for the one-line error
        flags = DemoOptions(config=config).run_flags()
        assert flags[flags.index("--config") + 1] == config


def test_the_sync_settings_are_run_flags_every_process_shares():
    """They are in the run's fingerprint: the demo hands them to the authorizer and trainers too (before,
    only workers got them, and `demo --averaging diloco` refused every worker at the door)."""
    from agora.node.cli import build_parser
    from agora.node.run_flags import run_config
    from agora.node.demo.demo import DemoOptions
    from agora.pipeline.fingerprint import run_fingerprint

    argv = ["--averaging", "diloco", "--averaging-every", "4", "--aggregation", "mean"]
    demo = DemoOptions.from_args(build_parser().parse_args(["demo", *argv]))
    flags = demo.run_flags()
    assert all(flag in flags for flag in argv) and not set(argv) & set(demo.worker_flags())
    configs = [run_config(build_parser().parse_args(role + flags)) for role in (
        ["join", "--stage", "0"], ["trainer"], ["authorizer", "serve", "--state-dir", "s", "--run-id", "r"])]
    assert {run_fingerprint(c).text() for c in configs} == {run_fingerprint(configs[0]).text()}
    assert (configs[0].sync.method, configs[0].sync.every_steps, configs[0].sync.aggregation) == ("diloco", 4, "mean")


def test_pinned_weights_reach_the_worker_and_the_demo_hands_them_on():
    from agora.node.cli import _worker_options, build_parser
    from agora.node.demo.demo import DemoOptions
    from agora.node.worker.worker import WorkerOptions

    def options_of(*argv):
        return _worker_options(build_parser().parse_args(["join", "--stage", "0", *argv]))

    assert options_of().pinned_weights == WorkerOptions().pinned_weights == 2
    assert options_of("--pinned-weights", "0").pinned_weights == 0
    with pytest.raises(ConfigError, match="worker.pinned_weights: must be >= 0, got -1"):
        options_of("--pinned-weights", "-1")
    demo = DemoOptions.from_args(build_parser().parse_args(["demo", "--pinned-weights", "0"]))
    assert demo.validate().pinned_weights == 0
    with pytest.raises(ConfigError, match="--pinned-weights: must be >= 0, got -1"):
        DemoOptions(pinned_weights=-1).validate()
