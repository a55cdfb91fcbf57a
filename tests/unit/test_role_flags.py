"""Every command's flags come from schema sections (`JoinOptions`, `MonitorOptions`, `SwarmOptions`
for the run and its peers; the admission, metrics and process flags every role shares; the
authorizer's, the bootstrap's, `export`'s and `generate`'s): the names and defaults users know, and
a bad value refused in one line naming the field, before admission starts anything. Pure: the
parser is built and the commands stop at their options."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from agora.auth.admission import JoinFile
from agora.dht.bootstrap import BootstrapOptions
from agora.dht.key_families import MAX_HEARTBEAT_S
from agora.monitor.options import MonitorOptions
from agora.monitor.swarm_view import StaticTarget
from agora.node.admission import AdmissionOptions
from agora.node.authorizer_options import AuthorityFolder, AuthorizerServeOptions, IssueOptions
from agora.node.cli import ProcessOptions, build_parser, main
from agora.node.export import ExportHfOptions, ExportOptions
from agora.node.inference.options import ClientOptions, GenerateOptions
from agora.node.observability import MetricsOptions
from agora.node.swarm_options import SwarmOptions
from agora.node.trainer.options import TrainerOptions
from agora.node.worker.join_options import JoinOptions
from agora.pipeline.option_flags import options_from_args
from agora.pipeline.schema import ConfigError, leaves

pytestmark = pytest.mark.timeout(60)


@functools.cache
def _parser():
    """One parser for the module: building it reads every command's option sections (about a tenth
    of a second), and parsing leaves it as it was."""
    return build_parser()


def parsed(*argv: str):
    return _parser().parse_args(list(argv))


def refusal(capsys, *argv: str) -> str:
    """The one line a command that refuses its flags prints (exit code 2)."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_join_keeps_its_flag_names_and_defaults():
    options = options_from_args(JoinOptions, parsed("join"), "join", run_id="r")
    assert (options.stage, options.dht_host, options.dht_port, options.heartbeat_s) == (None, "127.0.0.1", 0, 5.0)
    assert (options.ready_file, options.checkpoint_dir, options.checkpoint_every, options.resume_step,
            options.stats_file) == (None,) * 5
    assert options.memory_check and options.rebalance and options.sync_phases
    given = options_from_args(JoinOptions, parsed(
        "join", "--stage", "1", "--dht-host", "0.0.0.0", "--dht-port", "4100", "--heartbeat", "2.5",
        "--no-memory-check", "--ready-file", "r.txt", "--checkpoint-dir", "ck", "--checkpoint-every", "0",
        "--resume-step", "40", "--stats-file", "s.json", "--no-rebalance", "--no-sync-phases"), "join", run_id="r")
    assert given == JoinOptions(run_id="r", stage=1, dht_host="0.0.0.0", dht_port=4100, heartbeat_s=2.5,
                                memory_check=False, ready_file="r.txt", checkpoint_dir="ck", checkpoint_every=0,
                                resume_step=40, stats_file="s.json", rebalance=False, sync_phases=False)


def test_the_run_and_its_peers_are_one_declaration_for_every_swarm_peer():
    for command in (["join"], ["trainer"], ["monitor"], ["export", "--out", "d"], ["generate", "--prompt", "p"],
                    ["serve"]):
        args = parsed(*command, "--run-id", "r1", "--initial-peers", "/ip4/1.2.3.4/tcp/1", "--initial-peers", "/x")
        assert options_from_args(SwarmOptions, args, "swarm") == SwarmOptions("r1", ("/ip4/1.2.3.4/tcp/1", "/x"))
        assert options_from_args(SwarmOptions, parsed(*command), "swarm") == SwarmOptions("agora", ())


def test_join_refuses_a_bad_value_naming_the_field(capsys):
    join = ("join", "--insecure", "--stage", "0")
    assert refusal(capsys, *join, "--heartbeat", "0").endswith("join.heartbeat_s: must be > 0, got 0.0")
    assert refusal(capsys, *join, "--heartbeat", "61").endswith(
        f"join.heartbeat_s: must be <= {MAX_HEARTBEAT_S:g}, got 61.0")
    assert refusal(capsys, *join, "--dht-port", "70000").endswith("join.dht_port: must be < 65536, got 70000")
    assert refusal(capsys, *join, "--resume-step", "-1").endswith("join.resume_step: must be >= 0, got -1")
    assert refusal(capsys, "join", "--insecure", "--stage", "-2").endswith("join.stage: must be >= 0, got -2")
    assert "swarm.run_id" in refusal(capsys, *join, "--run-id", "")


def test_monitor_keeps_its_flag_names_and_defaults():
    options = options_from_args(MonitorOptions, parsed("monitor"), "monitor")
    assert options == MonitorOptions(host="127.0.0.1", port=9400, poll_s=2.0, targets=(), trainer_hosts=(),
                                     ready_file=None, ledger=None)
    given = options_from_args(MonitorOptions, parsed(
        "monitor", "--host", "0.0.0.0", "--port", "0", "--poll", "0.5", "--target", "authorizer=10.0.0.2:9100",
        "--target", "bootstrap=10.0.0.3:9101", "--trainer-host", "[::1]", "--ready-file", "m.txt",
        "--ledger", "l.sqlite"), "monitor")
    assert given.static_targets == (StaticTarget("authorizer", "10.0.0.2:9100"),
                                    StaticTarget("bootstrap", "10.0.0.3:9101"))
    assert (given.host, given.port, given.poll_s, given.trainer_hosts) == ("0.0.0.0", 0, 0.5, ("::1",))
    assert (given.ready_file, given.ledger) == ("m.txt", "l.sqlite")


def test_monitor_refuses_a_bad_value_naming_the_field(capsys):
    monitor = ("monitor", "--insecure")
    assert refusal(capsys, *monitor, "--poll", "0").endswith("monitor.poll_s: must be > 0, got 0.0")
    assert refusal(capsys, *monitor, "--port", "65536").endswith("monitor.port: must be < 65536, got 65536")
    assert refusal(capsys, *monitor, "--target", "authorizer=10.0.0.2:9100", "--target", "10.0.0.2:9100").endswith(
        "monitor.targets[1]: expected ROLE=HOST:PORT (e.g. authorizer=10.0.0.2:9100), got '10.0.0.2:9100'")
    assert refusal(capsys, *monitor, "--trainer-host", "0.0.0.0").endswith(
        "monitor.trainer_hosts[0]: a wildcard address (every interface) is not a host trainers run on, got '0.0.0.0'")


def test_every_flagged_field_is_a_flag_of_its_command():
    actions = {command: {flag for action in sub._actions for flag in action.option_strings}
               for command, sub in build_parser()._subparsers._group_actions[0].choices.items()}
    for command, sections in (("join", (JoinOptions, SwarmOptions)), ("monitor", (MonitorOptions, SwarmOptions))):
        flags = {item.short_flag for section in sections for item in leaves(section) if item.short_flag}
        assert flags <= actions[command], flags - actions[command]


def test_the_option_modules_import_neither_torch_nor_hivemind():
    script = ("import sys\nimport agora.node.worker.join_options, agora.monitor.options, agora.node.swarm_options\n"
              "import agora.node.authorizer_options, agora.node.inference.options\n"
              "print(sorted(name for name in ('torch', 'hivemind') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_trainers_files_and_evaluation_are_fields_of_its_section():
    assert options_from_args(TrainerOptions, parsed("trainer"), "trainer", run_id="r") == TrainerOptions(run_id="r")
    given = options_from_args(TrainerOptions, parsed("trainer", "--log-json", "t.jsonl", "--summary-json", "s.json",
                                                     "--no-eval"), "trainer", run_id="r")
    assert (given.log_json, given.summary_json, given.evaluate) == ("t.jsonl", "s.json", False)


def test_the_inference_clients_options_name_their_field(capsys):
    assert refusal(capsys, "serve", "--insecure", "--port", "70000").endswith("serve.port: must be < 65536, got 70000")
    assert refusal(capsys, "generate", "--insecure", "--prompt", "p", "--call-timeout", "0").endswith(
        "client.call_timeout_s: must be > 0, got 0.0")
    assert options_from_args(JoinOptions, parsed("join", "--serve-only", "--checkpoint", "ck"), "join",
                             run_id="r").serve_checkpoint == "ck"


def test_the_doctor_checks_a_stage_as_join_declares_it(capsys):
    admission = ("--authorizer", "127.0.0.1:9", "--ca-fingerprint", "0" * 64)
    assert refusal(capsys, "doctor", *admission, "--stage", "-1").endswith("doctor.stage: must be >= 0, got -1")


def test_every_role_reads_its_metrics_flags_from_one_section(capsys):
    for command in (["join"], ["trainer"], ["bootstrap"], ["authorizer", "serve", "--state-dir", "s"]):
        assert options_from_args(MetricsOptions, parsed(*command), "metrics") == MetricsOptions()
        given = parsed(*command, "--metrics-port", "auto", "--metrics-host", "0.0.0.0", "--metrics-file", "m.txt")
        assert options_from_args(MetricsOptions, given, "metrics") == MetricsOptions("auto", "0.0.0.0", "m.txt")
        assert options_from_args(MetricsOptions, parsed(*command, "--metrics-port", "9100"), "metrics").port == 9100
    assert refusal(capsys, "join", "--insecure", "--stage", "0", "--metrics-port", "70000").endswith(
        "metrics.port: must be <= 65535, got 70000")
    assert refusal(capsys, "trainer", "--insecure", "--metrics-file", "m.txt").endswith(
        "metrics.file: needs a metrics server (--metrics-port P or auto)")


def test_every_admitted_role_reads_the_admission_flags_from_one_section(capsys):
    fingerprint = "AB" * 32
    for command in (["join"], ["trainer"], ["monitor"], ["export", "--out", "d"], ["generate", "--prompt", "p"],
                    ["serve"], ["doctor"]):
        assert options_from_args(AdmissionOptions, parsed(*command), "admission") == AdmissionOptions()
        given = parsed(*command, "--authorizer", "10.0.0.2:7000", "--ca-fingerprint", fingerprint, "--state-dir", "d",
                       "--join-file", "j.json")
        assert options_from_args(AdmissionOptions, given, "admission") == AdmissionOptions(
            join_file="j.json", authorizer="10.0.0.2:7000", root_fingerprint=fingerprint.lower(), state_dir="d")
        assert options_from_args(AdmissionOptions, parsed(*command, "--insecure"), "admission").insecure
    assert refusal(capsys, "join", "--authorizer", "10.0.0.2:7000", "--ca-fingerprint", "abc").endswith(
        "admission.root_fingerprint: expected the 64 hex digits of a SHA-256, got 'abc'")
    assert refusal(capsys, "trainer", "--authorizer", "10.0.0.2:7000").endswith(
        "admission.authorizer: --authorizer and --ca-fingerprint go together (or give --join-file)")
    assert refusal(capsys, "monitor", "--insecure", "--join-file", "j.json").endswith(
        "admission.insecure: runs without an authorizer; drop --authorizer/--ca-fingerprint/--join-file")


def test_a_join_file_fills_in_the_authorizer_and_a_flag_wins_over_it(tmp_path):
    JoinFile(authorizer="10.0.0.2:7000", root_fingerprint="cd" * 32, run_id="r1").write(tmp_path / "join.json")
    resolved = AdmissionOptions(join_file=str(tmp_path / "join.json")).resolved()
    assert (resolved.authorizer, resolved.root_fingerprint, resolved.run_id) == ("10.0.0.2:7000", "cd" * 32, "r1")
    flagged = AdmissionOptions(join_file=str(tmp_path / "join.json"), authorizer="127.0.0.1:9").resolved()
    assert (flagged.authorizer, flagged.root_fingerprint) == ("127.0.0.1:9", "cd" * 32)


def test_export_keeps_its_flags_and_refuses_a_bad_value_naming_the_field(capsys):
    assert options_from_args(ExportOptions, parsed("export", "--out", "d"), "export", run_id="r") == ExportOptions(
        out="d", run_id="r", timeout_s=480.0)
    given = parsed("export", "--out", "d", "--timeout", "60")
    assert options_from_args(ExportOptions, given, "export", run_id="r").timeout_s == 60.0
    with pytest.raises(SystemExit):  # --out is required
        parsed("export")
    assert capsys.readouterr().err.endswith("error: the following arguments are required: --out\n")
    assert refusal(capsys, "export", "--insecure", "--out", "d", "--timeout", "0").endswith(
        "export.timeout_s: must be > 0, got 0.0")
    hf = options_from_args(ExportHfOptions, parsed("export-hf", "--checkpoint", "ck", "--out", "hf"), "export_hf")
    assert hf == ExportHfOptions(checkpoint="ck", out="hf")
    with pytest.raises(ConfigError, match="^export_hf.checkpoint: string should have at least 1 character, got ''$"):
        options_from_args(ExportHfOptions, parsed("export-hf", "--checkpoint", "", "--out", "hf"), "export_hf")


def test_generate_keeps_its_sampling_flags_beside_the_runs_seed(capsys):
    args = parsed("generate", "--prompt", "p")
    assert options_from_args(GenerateOptions, args, "generate") == GenerateOptions(64, 0.0, 1.0, 0)
    args = parsed("generate", "--prompt", "p", "--max-new-tokens", "8", "--temperature", "0.7", "--top-p", "0.9",
                  "--seed", "5", "--run-seed", "3")
    assert options_from_args(GenerateOptions, args, "generate") == GenerateOptions(8, 0.7, 0.9, 5)
    assert args.seed == 3  # the run's seed keeps its own destination
    for command in (["generate", "--prompt", "p"], ["serve"]):
        assert options_from_args(ClientOptions, parsed(*command, "--checkpoint", "ck"), "client").checkpoint == "ck"
    generate = ("generate", "--insecure", "--prompt", "p")
    assert refusal(capsys, *generate, "--top-p", "0").endswith("generate.top_p: must be > 0, got 0.0")
    assert refusal(capsys, *generate, "--temperature", "101").endswith(
        "generate.temperature: must be <= 100, got 101.0")
    assert refusal(capsys, *generate, "--seed", "-1").endswith("generate.seed: must be >= 0, got -1")
    assert refusal(capsys, *generate, "--max-new-tokens", "-1").endswith(
        "generate.max_new_tokens: must be >= 0, got -1")
    assert refusal(capsys, *generate, "--checkpoint", "ck", "--config", "tiny").endswith(
        "--checkpoint and --config both name the run config: give one")


def test_the_authorizers_actions_keep_their_flags(capsys):
    for action in (["serve"], ["list"], ["ban", "PEER"], ["unban", "PEER"],
                   ["issue", "--role", "trainer", "--out", "o"]):
        args = parsed("authorizer", *action, "--state-dir", "s")
        assert options_from_args(AuthorityFolder, args, "authorizer") == AuthorityFolder("s")
        with pytest.raises(SystemExit):  # --state-dir is required
            parsed("authorizer", *action)
        assert "the following arguments are required: --state-dir" in capsys.readouterr().err
    serve = parsed("authorizer", "serve", "--state-dir", "s", "--run-id", "r-1", "--ready-file", "r.txt",
                   "--join-file", "j.json", "--initial-peers", "/a", "/b", "--initial-peers", "/c")
    assert options_from_args(AuthorizerServeOptions, serve, "authorizer") == AuthorizerServeOptions(
        "r-1", "r.txt", "j.json", ("/a", "/b", "/c"))
    assert options_from_args(AuthorizerServeOptions, parsed("authorizer", "serve", "--state-dir", "s"),
                             "authorizer") == AuthorizerServeOptions()
    issue = parsed("authorizer", "issue", "--role", "worker", "--stage", "1", "--out", "o", "--lifetime", "600",
                   "--run-id", "early", "--state-dir", "s")
    assert options_from_args(IssueOptions, issue, "issue") == IssueOptions("worker", "o", 1, 600.0, "early")
    assert options_from_args(IssueOptions, parsed("authorizer", "issue", "--role", "client", "--out", "o",
                                                  "--state-dir", "s"), "issue").lifetime_s == 3600.0


def test_the_authorizers_actions_refuse_a_bad_value_naming_the_field(capsys, tmp_path):
    state = ("--state-dir", str(tmp_path / "state"))
    assert refusal(capsys, "authorizer", "serve", *state, "--run-id", "bad id!").endswith(
        "authorizer.run_id: letters, digits, '_' and '-' only (1-64 characters), got 'bad id!'")
    issue = ("authorizer", "issue", "--out", str(tmp_path / "out"), *state)
    assert refusal(capsys, *issue, "--role", "worker", "--stage", "-1").endswith("issue.stage: must be >= 0, got -1")
    assert refusal(capsys, *issue, "--role", "client", "--lifetime", "0").endswith(
        "issue.lifetime_s: must be > 0, got 0.0")
    assert not (tmp_path / "state").exists() and not (tmp_path / "out").exists()  # refused before any key
    with pytest.raises(SystemExit):
        parsed(*issue, "--role", "wizard")
    assert "argument --role: invalid choice: 'wizard'" in capsys.readouterr().err


def test_the_process_flags_before_the_command_are_one_section(capsys):
    assert options_from_args(ProcessOptions, parsed("plan"), "process") == ProcessOptions("INFO", "text", None)
    given = parsed("--log-level", "warning", "--log-format", "json", "--threads", "2", "plan")
    assert options_from_args(ProcessOptions, given, "process") == ProcessOptions("WARNING", "json", 2)
    assert refusal(capsys, "--threads", "0", "plan") == "agora-node: error: process.threads: must be > 0, got 0"
    with pytest.raises(SystemExit):
        parsed("--log-level", "loud", "plan")
    assert "argument --log-level: invalid choice: 'loud'" in capsys.readouterr().err


def test_the_bootstrap_keeps_its_flags_and_refuses_a_bad_value_naming_the_field(capsys):
    assert options_from_args(BootstrapOptions, parsed("bootstrap"), "bootstrap") == BootstrapOptions()
    given = parsed("bootstrap", "--host", "::", "--port", "4000", "--initial-peers", "/a", "--initial-peers", "/b",
                   "--ready-file", "r.txt", "--state-dir", "d")
    assert options_from_args(BootstrapOptions, given, "bootstrap") == BootstrapOptions(
        host="::", port=4000, initial_peers=("/a", "/b"), ready_file="r.txt", state_dir="d")
    assert options_from_args(BootstrapOptions, parsed("bootstrap", "--insecure", "--identity-path", "k"),
                             "bootstrap") == BootstrapOptions(identity_path="k", insecure=True)
    assert refusal(capsys, "bootstrap", "--insecure", "--port", "70000").endswith(
        "bootstrap.port: must be <= 65535, got 70000")
    assert refusal(capsys, "bootstrap", "--insecure", "--host", "localhost").endswith(
        "bootstrap.host: expected an IPv4 or IPv6 address, got 'localhost'")
    assert refusal(capsys, "bootstrap", "--insecure", "--state-dir", "d").endswith(
        "bootstrap.insecure: an open peer has no credential; drop --state-dir (or --insecure)")
