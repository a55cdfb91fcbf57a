"""`ApiKeys`: the bearer keys `agora-node serve --api-key-file F` accepts.

The file (read once, at start):

    # one key per line; '#' starts a comment, to the end of the line
    3f9c0a7e5b1d4c2a8e6f0b9d7c5a3e1f   # alice
    sk-team-b-7d2e9a4c1f8b6e3d0a5c      # team b

Design choices:
- A key is 16 to 256 printable ASCII characters without spaces or '#' (what an `Authorization:
  Bearer` header carries); `openssl rand -hex 32` makes one. A shorter key, a duplicate, or a file
  without any key is refused at start naming the line: an empty file would refuse every request,
  and a short key is guessable. A file others may read is served with a warning.
- Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every key without
  stopping at a match, so the time of a check tells nothing of how much of a key was right nor
  which key it was; only the digests stay in memory.
- A key is known by its line (`key on line 3`): what logs and the per-key limit name, never the
  key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from agora.pipeline.config import ConfigError

__all__ = ["ApiKeys", "parse_api_keys", "load_api_keys", "MIN_KEY_CHARS", "MAX_KEY_CHARS"]

logger = logging.getLogger("agora.node.inference")

MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 256


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys' digests and names (`key on line N`)."""

    digests: tuple[bytes, ...]
    names: tuple[str, ...]

    def match(self, presented: str) -> Optional[str]:
        """The name of the key `presented` is, or None; the same work whatever it is (module docstring)."""
        digest = _digest(presented)
        found: Optional[str] = None
        for known, name in zip(self.digests, self.names):
            if hmac.compare_digest(known, digest):
                found = name
        return found


def _key_of(line: str) -> str:
    return line.split("#", 1)[0].strip()


def parse_api_keys(text: str, source: str) -> ApiKeys:
    """The keys of a key file's text; ConfigError naming `source` and the line of the first bad one."""
    digests: dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        key = _key_of(line)
        if not key:
            continue
        where = f"--api-key-file {source}, line {number}"
        if not (key.isascii() and key.isprintable()) or " " in key:
            raise ConfigError(f"{where}: a key is printable ASCII without spaces (a comment starts with '#')")
        if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
            raise ConfigError(f"{where}: a key of {len(key)} characters; use {MIN_KEY_CHARS} to {MAX_KEY_CHARS} "
                              "(`openssl rand -hex 32` makes one)")
        digest = _digest(key)
        if digest in digests:
            raise ConfigError(f"{where}: the same key as {digests[digest]}")
        digests[digest] = f"key on line {number}"
    if not digests:
        raise ConfigError(f"--api-key-file {source}: no key in it (every request would be refused); add one per "
                          "line, or drop --api-key-file to serve without keys")
    return ApiKeys(tuple(digests), tuple(digests.values()))


def load_api_keys(path: str | os.PathLike) -> ApiKeys:
    """Read and parse a key file; ConfigError for one that cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--api-key-file {path}: cannot read it: {getattr(error, 'strerror', None) or error}") \
            from None
    keys = parse_api_keys(text, str(path))
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("--api-key-file %s: others on this machine may read it (mode %o); chmod 600 it", path,
                       stat.S_IMODE(mode))
    return keys
