"""The authorizer's settings as a section of the settings schema (auth/settings.py): `authorizer
serve`'s flags come from its fields, and each kind of bad value is refused in one line naming the
field. Pure: the parser is built, nothing serves."""

from __future__ import annotations

import math

import pytest

from agora.auth.policy import Floors
from agora.auth.settings import OPEN_ROLES, AuthorizerSettings
from agora.node.authorizer import LOCAL_RUN_FLAGS
from agora.node.cli import build_parser, main
from agora.pipeline.option_flags import options_from_args
from agora.pipeline.schema import ConfigError, leaves

SERVE = ["authorizer", "serve", "--state-dir", "unused"]
# Every flag `serve` has for its settings, and what each sets (a value other than the default).
FLAGS = {
    "--host": ("0.0.0.0", "host", "0.0.0.0"),
    "--port": ("7000", "port", 7000),
    "--public-host": ("auth.example.org", "public_host", "auth.example.org"),
    "--min-upload-mbit": ("10", "floors.min_upload_mbit", 10.0),
    "--min-download-mbit": ("20", "floors.min_download_mbit", 20.0),
    "--max-rtt-ms": ("inf", "floors.max_rtt_ms", math.inf),
    "--min-accelerator-gb": ("0", "floors.min_accelerator_gb", 0.0),
    "--min-ram-gb": ("1.5", "floors.min_ram_gb", 1.5),
    "--max-workers": ("3", "max_workers", 3),
    "--credential-lifetime": ("120", "credential_lifetime_s", 120.0),
    "--join-roles": ("worker,trainer", "join_roles", ("worker", "trainer")),
    "--queue-retry-after": ("1", "queue_retry_after_s", 1.0),
    "--preflight-bytes": ("262144", "preflight_bytes", 262144),
    "--latency-probes": ("3", "latency_probes", 3),
    "--join-rate": ("20", "join_rate_per_s", 20.0),
    "--join-burst": ("64", "join_burst", 64),
    "--network-join-rate": ("30", "network_join_rate_per_s", 30.0),
    "--network-join-burst": ("65", "network_join_burst", 65),
    "--challenges-per-network": ("8", "challenges_per_network", 8),
    "--renew-rate": ("21", "renew_rate_per_s", 21.0),
    "--renew-burst": ("66", "renew_burst", 66),
    "--max-concurrent-rpcs": ("100", "max_concurrent_rpcs", 100),
    "--max-calls-per-network": ("70", "max_calls_per_network", 70),
    "--ban-after-reports": ("0", "ban_after_reports", 0),
    "--report-window": ("60", "report_window_s", 60.0),
}


def settings(*argv: str) -> AuthorizerSettings:
    return options_from_args(AuthorizerSettings, build_parser().parse_args([*SERVE, *argv]), "authorizer")


def value(section: AuthorizerSettings, path: str):
    for part in path.split("."):
        section = getattr(section, part)
    return section


def test_no_flags_give_the_schemas_defaults():
    assert settings() == AuthorizerSettings()
    assert AuthorizerSettings().join_roles == OPEN_ROLES and AuthorizerSettings().floors == Floors()


def test_every_flag_sets_its_field():
    argv = [text for flag, (given, _, _) in FLAGS.items() for text in (flag, given)]
    parsed = settings(*argv, "--local-network")
    for flag, (_, path, expected) in FLAGS.items():
        assert value(parsed, path) == expected, flag
    assert parsed.local_network and not settings().local_network


def test_the_flags_are_the_schemas_and_nothing_else():
    """Each flagged field of the section is a flag of `serve`, and the table above names them all."""
    flagged = {item.short_flag: item.path for item in leaves(AuthorizerSettings) if item.short_flag}
    assert flagged == {**{flag: path for flag, (_, path, _) in FLAGS.items()}, "--local-network": "local_network"}


def test_roles_are_one_comma_separated_word_or_several():
    assert settings("--join-roles", "worker,", " monitor").join_roles == ("worker", "monitor")
    assert settings("--join-roles", "client", "--join-roles", "trainer").join_roles == ("client", "trainer")
    assert AuthorizerSettings(join_roles="worker,client").join_roles == ("worker", "client")


def test_a_local_run_widens_the_limits():
    local = settings(*LOCAL_RUN_FLAGS)
    assert local.local_network and (local.join_rate_per_s, local.join_burst, local.renew_burst) == (20.0, 64, 64)


@pytest.mark.parametrize("argv, refusal", [
    # a bound
    (["--join-rate", "0"], "authorizer.join_rate_per_s: must be > 0, got 0.0"),
    (["--join-burst", "0"], "authorizer.join_burst: must be >= 1, got 0"),
    (["--port", "65536"], "authorizer.port: must be < 65536, got 65536"),
    (["--credential-lifetime", "4"], "authorizer.credential_lifetime_s: must be >= 5, got 4.0"),
    (["--max-workers", "0"], "authorizer.max_workers: must be >= 1, got 0"),
    (["--preflight-bytes", "0"], "authorizer.preflight_bytes: must be >= 1, got 0"),
    (["--max-concurrent-rpcs", "3"], "authorizer.max_concurrent_rpcs: must be >= 4, got 3"),
    # a bound of a nested section: NaN is no number of the range
    (["--min-ram-gb", "-1"], "authorizer.floors.min_ram_gb: must be >= 0, got -1.0"),
    (["--max-rtt-ms", "nan"], "authorizer.floors.max_rtt_ms: must be >= 0, got nan"),
    (["--report-window", "nan"], "authorizer.report_window_s: must be > 0, got nan"),
    # a value no field takes
    (["--join-roles", "worker,operator"],
     "authorizer.join_roles: expected some of worker, trainer, monitor, client (operator is not one), got "
     "['worker,operator']"),
    (["--join-roles", ","], "authorizer.join_roles: expected some of worker, trainer, monitor, client, got [',']"),
    # a rule across fields
    (["--max-concurrent-rpcs", "8", "--max-calls-per-network", "7"],
     "authorizer.max_calls_per_network: 7 is above 6, three quarters of max_concurrent_rpcs=8"),
    (["--challenges-per-network", "4097"], "authorizer.challenges_per_network: 4097 is above max_challenges=4096"),
])
def test_a_bad_value_is_one_line_naming_the_field(argv, refusal):
    with pytest.raises(ConfigError) as refused:
        settings(*argv)
    assert str(refused.value) == refusal


def test_a_wrong_type_and_an_unknown_field_name_the_field():
    with pytest.raises(ValueError, match="latency_probes"):
        AuthorizerSettings(latency_probes="3")
    with pytest.raises(ValueError, match="download_bytes"):
        AuthorizerSettings(download_bytes=1)


def test_a_flag_that_is_not_a_number_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stopped:
        settings("--join-burst", "many")
    assert stopped.value.code == 2 and "expected a whole number, got 'many'" in capsys.readouterr().err


def test_serve_refuses_a_bad_setting_with_exit_code_2_before_it_creates_anything(tmp_path, capsys):
    state = tmp_path / "auth"
    assert main(["authorizer", "serve", "--state-dir", str(state), "--run-id", "r", "--renew-burst", "0"]) == 2
    assert "authorizer.renew_burst: must be >= 1, got 0" in capsys.readouterr().err
    assert not state.exists()
