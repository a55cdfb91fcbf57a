"""`agora-node serve`'s API key file (node/inference/api_keys.py) and its access settings
(`ServeOptions`): parsed or refused in one line naming the line or the field. Pure: no sockets."""

from __future__ import annotations

import argparse
import logging

import pytest

from agora.node.inference.api_keys import load_api_keys, parse_api_keys
from agora.node.inference.options import ServeOptions
from agora.pipeline.config import ConfigError
from agora.pipeline.option_flags import add_option_flags, options_from_args

ALICE = "3f9c0a7e5b1d4c2a8e6f0b9d7c5a3e1f"
BOB = "sk-team-b-7d2e9a4c1f8b6e3d0a5c"


def test_keys_are_read_one_per_line_with_comments_and_known_by_their_line():
    keys = parse_api_keys(f"# the team's keys\n\n  {ALICE}   # alice\n{BOB}\n# {ALICE[::-1]} (revoked)\n", "keys")
    assert keys.names == ("key on line 3", "key on line 4")
    assert keys.match(ALICE) == "key on line 3" and keys.match(BOB) == "key on line 4"
    for wrong in ("", ALICE[:-1], ALICE + "0", ALICE.upper(), ALICE[::-1], "é" * 20):
        assert keys.match(wrong) is None, wrong
    assert ALICE not in repr(keys)  # only digests are kept


@pytest.mark.parametrize("text, message", [
    ("short-key\n", "line 1: a key of 9 characters; use 16 to 256"),
    (f"{ALICE}\n# again:\n{ALICE}  # alice's laptop\n", "line 3: the same key as key on line 1"),
    (f"{ALICE} {BOB}\n", "line 1: a key is printable ASCII without spaces"),
    ("clé-avec-accent-0123456789\n", "line 1: a key is printable ASCII"),
    ("# nothing but comments\n\n", "no key in it"),
])
def test_a_bad_key_file_is_refused_naming_the_line(text, message):
    with pytest.raises(ConfigError, match=message) as refused:
        parse_api_keys(text, "keys.txt")
    assert "--api-key-file keys.txt" in str(refused.value)


def test_an_unreadable_file_is_refused_and_one_others_may_read_is_served_with_a_warning(tmp_path, caplog):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_api_keys(tmp_path / "missing")
    path = tmp_path / "keys"
    path.write_text(ALICE + "\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, "agora.node.inference"):
        assert load_api_keys(path).match(ALICE)
    assert "chmod 600" in caplog.text
    caplog.clear()
    path.chmod(0o600)
    load_api_keys(path)
    assert "chmod" not in caplog.text


def serve_options(*argv: str) -> ServeOptions:
    parser = argparse.ArgumentParser()
    add_option_flags(parser, ServeOptions)
    return options_from_args(ServeOptions, parser.parse_args(list(argv)), "serve")


def test_serve_options_default_to_an_open_api_with_half_the_completions_per_key():
    assert serve_options() == ServeOptions()
    assert ServeOptions().api_key_file is None and ServeOptions().requests_per_key == 8
    options = serve_options("--api-key-file", "k", "--max-concurrent-requests", "5")
    assert options.api_key_file == "k" and options.requests_per_key == 3
    with pytest.raises(ConfigError, match="serve.max_requests_per_key: 6 is above max_concurrent_requests=5"):
        serve_options("--max-concurrent-requests", "5", "--max-requests-per-key", "6")
    with pytest.raises(ConfigError, match="serve.max_concurrent_requests"):
        serve_options("--max-concurrent-requests", "0")
