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

    def config_of(*argv):
        return run_config(build_parser().parse_args(["join", "--stage", "0", *argv]))

    train = config_of("--batch-size", "32", "--microbatches", "8").train
    assert (train.batch_size, train.microbatches, train.microbatch_size) == (32, 8, 4)
    assert config_of("--train.batch-size", "32", "--train.microbatches", "8").train == train
    with pytest.raises(ConfigError, match="train.microbatches: 8 does not divide batch_size=30"):
        config_of("--batch-size", "30", "--microbatches", "8")


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


def test_every_process_of_a_demo_runs_the_config_its_flags_make():
    """The demo hands each setting it was given to every child, the authorizer's served config
    included: the children's configs and fingerprints are the demo's own."""
    from agora.node.cli import build_parser
    from agora.node.run_flags import run_config
    from agora.node.demo.demo import DemoOptions
    from agora.pipeline.fingerprint import run_fingerprint

    argv = ["--averaging", "diloco", "--averaging-every", "4", "--aggregation", "mean", "--microbatches", "8",
            "--model.rank", "none", "--optim.betas", "0.8", "0.9", "--model.qk-norm", "true", "--seed", "3",
            "--optimizer-sync-steps", "5", "--device", "cpu"]
    demo_args = build_parser().parse_args(["demo", *argv])
    expected = run_config(demo_args)
    assert (expected.sync.method, expected.sync.every_steps, expected.model.rank, expected.optim.betas,
            expected.model.qk_norm, expected.seed, expected.sync.optimizer_sync_steps) == (
        "diloco", 4, None, (0.8, 0.9), True, 3, 5)
    flags = DemoOptions.from_args(demo_args).run_flags()
    configs = [run_config(build_parser().parse_args(role + flags)) for role in (
        ["join", "--stage", "0"], ["trainer"], ["authorizer", "serve", "--state-dir", "s", "--run-id", "r"])]
    assert configs == [expected] * 3
    assert {run_fingerprint(c).text() for c in configs} == {run_fingerprint(expected).text()}


def test_machine_local_settings_are_outside_the_fingerprint():
    """A joiner's warm-up, the device and the token cache are each machine's own: processes that
    differ only in them serve one run. Everything else is the run's."""
    from dataclasses import replace

    from agora.pipeline.config import config_with, run_settings
    from agora.pipeline.fingerprint import run_fingerprint

    tiny = PRESETS["tiny"]
    local = config_with(tiny, {"sync.optimizer_sync_steps": 3, "runtime.device": "cpu", "data.cache_dir": "/x"})
    assert run_fingerprint(local) == run_fingerprint(tiny)
    assert {s.path for s in run_settings() if s.local} == {
        "data.cache_dir", "sync.optimizer_sync_steps", "runtime.device", "runtime.dtype", "runtime.weights",
        "runtime.compile", "evals.every", "evals.heldout_batches", "evals.tasks", "evals.include_path",
        "evals.limit"}
    evaluating = config_with(tiny, {"evals.every": 5, "evals.tasks": ("agora_code_mc",)})
    assert run_fingerprint(evaluating) == run_fingerprint(tiny)  # a trainer that evaluates serves the same run
    assert run_fingerprint(config_with(tiny, {"sync.quorum": 2})) != run_fingerprint(tiny)
    assert run_fingerprint(replace(tiny, model=replace(tiny.model, init_std=0.03))) != run_fingerprint(tiny)


def test_every_setting_has_a_flag_with_the_schema_help():
    from agora.node.cli import build_parser
    from agora.node.run_flags import explicit_settings
    from agora.pipeline.config import run_settings

    parser = build_parser()
    join = parser._subparsers._group_actions[0].choices["join"]
    flags = {option: action for action in join._actions for option in action.option_strings}
    for setting in run_settings():
        if setting.path in ("name", "seed"):  # the config's name; --seed
            continue
        action = flags[setting.flag]
        assert action.dest == setting.path and setting.help in action.help
    args = parser.parse_args(["join", "--stage", "0", "--sync.every-steps", "7", "--model.layer-split", "4", "2"])
    assert explicit_settings(args) == {"sync.every_steps": 7, "model.layer_split": (4, 2)}
    assert explicit_settings(parser.parse_args(["join", "--stage", "0"])) == {}


@pytest.mark.parametrize("argv, message", [
    (["--sync.every-steps", "0"], "sync.every_steps: must be > 0, got 0"),
    (["--sync.request-s", "5"], "sync.request_s: 5 must be below matchmaking_s=3"),
    (["--optim.betas", "0.9", "1.5"], r"optim.betas\[1\]: must be < 1, got 1.5"),
    (["--optim.betas", "0.9"], "optim.betas"),
    (["--runtime.device", "tpu"], "runtime.device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--runtime.weights", "bf16"], "runtime.weights: bf16 weights need runtime.dtype = bf16"),
    (["--model.layer-split", "3", "2"], r"model.layer_split: \[3, 2\] must sum to n_layers=6"),
    (["--stages", "9"], "stages: need 1..6 stages for 6 blocks, got 9"),
    (["--evals.every", "-1"], "evals.every: must be >= 0, got -1"),
    (["--evals.every", "5", "--evals.heldout-batches", "0"],
     "evals.every: evaluations every 5 global batches need heldout_batches > 0 or a task"),
    (["--evals.limit", "0"], "evals.limit: must be > 0, got 0"),
])
def test_a_bad_flag_value_names_the_setting_and_the_value(argv, message):
    from agora.node.cli import build_parser
    from agora.node.run_flags import run_config

    with pytest.raises(ConfigError, match=message):
        run_config(build_parser().parse_args(["config", "show", *argv]))


@pytest.mark.parametrize("text, message", [
    ("[sync]\nevery_steps = true\n", "sync.every_steps: expected an integer, got True"),
    ("[sync]\nmethod = 'gossip'\n", "sync.method: expected one of sparta, diloco or none, got 'gossip'"),
    ("[optim]\nlr = '1e-3'\n", "optim.lr: expected a number, got '1e-3'"),
    ("[sync]\nevry_steps = 3\n", r"sync.evry_steps: unknown field \(known: .*every_steps"),
    ("sync = 3\n", "sync: expected a table, got 3"),
    ("[evals]\ntasks = 'agora_code_mc'\n", "evals.tasks: expected a list, got 'agora_code_mc'"),
    ("[evals]\ntasks = ['']\n", r"evals.tasks\[0\]: string should have at least 1 character, got ''"),
    ("[evals]\ninclude_path = 'tasks/'\n", "evals.include_path: given without tasks to run from it"),
    ("[evals]\nevery = 4\nperplexity = 2\n", r"evals.perplexity: unknown field \(known: every, heldout_batches"),
])
def test_a_bad_file_value_names_the_setting_and_the_value(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n' + text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_config_show_prints_a_file_that_loads_back_with_each_source(tmp_path, capsys):
    """`agora-node config show` is the effective config as every role computes it: saved, it is a
    config file for the same run (TOML has no null: an unset rank is written "none")."""
    import json

    from agora.node.cli import main
    from agora.pipeline.fingerprint import run_fingerprint

    base = tmp_path / "base.toml"
    base.write_text('preset = "small"\n[train]\nmicrobatches = 8\n')
    argv = ["config", "show", "--config", str(base), "--stages", "2", "--averaging-every", "3", "--model.rank", "none"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in text.splitlines() if "=" in line and line[0] != "#"}
    assert lines["every_steps"].endswith("# --sync.every-steps") and lines["rank"].startswith('rank = "none"')
    assert lines["microbatches"].endswith(f"# file {base}") and lines["d_model"].endswith("# preset small")
    assert lines["layer_split"].endswith("# --stages") and lines["arch"].endswith("# default")
    assert lines["device"].endswith("# default; this machine's")
    saved = tmp_path / "saved.toml"
    saved.write_text(text)
    assert main(["config", "show", "--json", "--config", str(saved)]) == 0
    shown = json.loads(capsys.readouterr().out)
    again = load_config(saved)
    assert (again.train.microbatches, again.model.rank, again.layer_split, again.sync.every_steps) == (
        8, None, (4, 4), 3)
    assert config_from_dict(shown["config"]) == again and shown["sources"]["sync.every_steps"] == f"file {saved}"
    assert text.startswith(f"# agora-node run config; fingerprint {run_fingerprint(again).text()}")
    assert main(["config", "show", "--microbatches", "3"]) == 2  # one line, exit 2
    assert "train.microbatches: 3 does not divide batch_size=8" in capsys.readouterr().err


def test_pinned_weights_reach_the_worker_and_the_demo_hands_them_on():
    from agora.node.cli import build_parser
    from agora.node.demo.demo import DemoOptions
    from agora.node.worker.worker import WorkerOptions
    from agora.pipeline.option_flags import options_from_args

    def options_of(*argv):
        return options_from_args(WorkerOptions, build_parser().parse_args(["join", "--stage", "0", *argv]), "worker")

    assert options_of().pinned_weights == WorkerOptions().pinned_weights == 2
    assert options_of("--pinned-weights", "0").pinned_weights == 0
    with pytest.raises(ConfigError, match="worker.pinned_weights: must be >= 0, got -1"):
        options_of("--pinned-weights", "-1")
    demo = DemoOptions.from_args(build_parser().parse_args(["demo", "--pinned-weights", "0"]))
    assert demo.pinned_weights == 0 and "--pinned-weights" in demo.worker_flags()
    assert DemoOptions.from_args(build_parser().parse_args(["demo"])).pinned_weights is None  # the workers' own
    with pytest.raises(ConfigError, match="demo.pinned_weights: must be >= 0, got -1"):
        DemoOptions.from_args(build_parser().parse_args(["demo", "--pinned-weights", "-1"]))


def test_role_options_come_from_their_sections_and_are_checked_before_anything_starts():
    """Each role's flags are its options section's fields: a bad value is one line naming it, and the
    demo's rules across its options (one route for --sync) hold on the command line."""
    from agora.node.cli import build_parser, main
    from agora.node.demo.demo import DemoOptions
    from agora.node.trainer.options import TrainerOptions
    from agora.pipeline.option_flags import options_from_args

    def trainer(*argv):
        return options_from_args(TrainerOptions, build_parser().parse_args(["trainer", *argv]), "trainer", run_id="r")

    assert trainer("--max-staleness", "4", "--trainers", "3", "--trainer-index", "2", "--lease", "7").lease_s == 7.0
    assert trainer().gradient_check_share == 0.05 and trainer("--gradient-check-share", "0").gradient_check_share == 0
    for argv, message in [(["--max-staleness", "0"], "trainer.max_staleness: must be > 0, got 0"),
                          (["--trainers", "2", "--trainer-index", "2"], "trainer.trainer_index: 2 out of range"),
                          (["--time-budget", "-1"], "trainer.time_budget_s: must be > 0, got -1"),
                          (["--gradient-check-share", "2"], "trainer.gradient_check_share: must be <= 1, got 2")]:
        with pytest.raises(ConfigError, match=message):
            trainer(*argv)
    demo = DemoOptions.from_args(build_parser().parse_args(
        ["demo", "--join-at", "3", "--join-at", "5", "7", "--chaos", "20", "--no-monitor", "--no-sync-phases"]))
    assert (demo.join_at, demo.chaos_s, demo.monitor, demo.sync_phases, demo.trainer_lease_s) == (
        (3, 5, 7), 20.0, False, False, 5.0)
    for argv, message in [(["--sync", "--replicas", "2"], "demo.sync: --sync needs --replicas 1"),
                          (["--credential-lifetime", "5"], "demo.credential_lifetime: must be >= 10, got 5"),
                          (["--resume"], "demo.resume: give the --workdir")]:
        with pytest.raises(ConfigError, match=message):
            DemoOptions.from_args(build_parser().parse_args(["demo", *argv]))
    assert main(["trainer", "--insecure", "--max-in-flight", "0"]) == 2  # before any DHT or admission
