"""Client API keys: several OpenAI-style bearer keys from one file, reloaded when it changes.

The file (`--api-keys-file PATH`) holds one key per line; blank lines and lines starting
with `#` are ignored. Each key is checked as a bearer token (visible ASCII, no spaces). The
file is looked at again (one stat) on every check, and read again when its modification
time, size or inode changed, so keys are added or revoked without a restart: write the new
file aside and rename it over the old one. A file that cannot be read, or holds no key,
at start is an error naming it; later, the last good keys stay in force (logged), so a
half-finished edit never locks every client out nor lets everyone in.

Must never: log or print a key, or keep a key in memory other than as its SHA-256 digest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from pdserve.common.auth import TokenError, check_token

logger = logging.getLogger(__name__)

FLAG = "--api-keys-file"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def parse_keys(text: str, source: str) -> frozenset[bytes]:
    """The SHA-256 digests of the keys in `text`; TokenError naming `source` and the line."""
    digests = set()
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        digests.add(_digest(check_token(key, f"{source} line {number}").encode()))
    if not digests:
        raise TokenError(f"{source}: holds no API key (one a line; '#' starts a comment)")
    return frozenset(digests)


class ApiKeys:
    """The keys a client may present; `valid` is thread-safe (the gRPC and HTTP fronts share it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp, self._digests = self._read()  # raises TokenError: a bad file stops the start

    def _read(self) -> tuple[tuple[int, int, int], frozenset[bytes]]:
        source = f"{FLAG} {self.path}"
        try:
            info = os.stat(self.path)
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenError(f"{source}: cannot read it ({exc})") from exc
        return (info.st_mtime_ns, info.st_size, info.st_ino), parse_keys(text, source)

    def _refresh(self) -> frozenset[bytes]:
        try:
            info = os.stat(self.path)
            stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        except OSError:
            stamp = None
        with self._lock:
            if stamp is None or stamp == self._stamp:
                return self._digests
            try:
                self._stamp, self._digests = self._read()
                logger.info("%s %s reloaded: %d keys", FLAG, self.path, len(self._digests))
            except TokenError as exc:
                self._stamp = stamp  # not read again until it changes again
                logger.warning("%s; the previous %d keys stay in force", exc, len(self._digests))
            return self._digests

    def valid(self, presented: bytes) -> bool:
        """Is `presented` (the key itself, without "Bearer ") one of the file's keys now?"""
        return _digest(presented) in self._refresh()

    def __len__(self) -> int:
        return len(self._refresh())
