"""API keys: one per line in a file, checked with constant-time comparison, reloaded on change.

In Kubernetes the file is a mounted Secret. The kubelet updates it in place by writing a new
timestamped folder and swapping a ``..data`` symlink to it, so the path's own mtime never
changes: the watch compares what ``os.stat`` sees through the symlinks (device, inode, mtime,
size), which changes on that swap and on an ordinary rewrite alike.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MAX_KEYS_FILE_BYTES = 1_048_576  # a keys file is small; refuse to read a runaway one
FileIdentity = tuple[int, int, int, int]


class ApiKeysError(Exception):
    """The keys file cannot be read, or holds no key; the message says which file and why."""


def parse_api_keys(text: str, source: str) -> frozenset[str]:
    """One key per line; blank lines and lines starting with # are ignored.

    A file without any key is an error, not "authentication off": an empty Secret is almost
    always a mistake, and failing open would let anyone in.
    """
    keys = frozenset(
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    )
    if not keys:
        raise ApiKeysError(f"API keys file {source} holds no key (empty or only comments)")
    return keys


def file_identity(path: Path) -> FileIdentity:
    """What changes when the file (or the target of any symlink on its path) is replaced."""
    stat = os.stat(path)  # follows symlinks: the kubelet's ..data swap gives a new inode
    return (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)


def read_api_keys(path: Path) -> tuple[frozenset[str], FileIdentity]:
    try:
        identity = file_identity(path)
        if identity[3] > MAX_KEYS_FILE_BYTES:
            raise ApiKeysError(f"API keys file {path} is larger than {MAX_KEYS_FILE_BYTES} bytes")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeysError(f"cannot read API keys file {path}: {exc}") from exc
    return parse_api_keys(text, str(path)), identity


class ApiKeys:
    """The keys in force now; empty (no file) means every caller is accepted."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.keys: frozenset[str] = frozenset()
        self._identity: FileIdentity | None = None
        if path is not None:
            self.keys, self._identity = read_api_keys(path)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def accepts(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (as a bearer)."""
        scheme, _, token = authorization.partition(" ")
        token_bytes = token.strip().encode()
        # Compare against every key (no early exit), so timing says nothing about which matched.
        matches = [hmac.compare_digest(token_bytes, key.encode()) for key in self.keys]
        return scheme.lower() == "bearer" and any(matches)

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; a file that is now bad keeps the old keys (logged)."""
        if self.path is None:
            return False
        try:
            identity = file_identity(self.path)
        except OSError as exc:
            log.error("keeping the previous API keys: cannot stat %s: %s", self.path, exc)
            return False
        if identity == self._identity:
            return False
        # Remember it even when the new content is bad: one log line per change, not per poll.
        self._identity = identity
        try:
            keys, self._identity = read_api_keys(self.path)
        except ApiKeysError as exc:
            log.error("keeping the previous API keys: %s", exc)
            return False
        self.keys = keys
        log.info("reloaded API keys from %s: %d keys", self.path, len(keys))
        return True

    async def watch(self, interval_s: float) -> None:
        """Poll the file every ``interval_s``. Each check runs in a thread and is awaited for a
        bounded time, so a hung mount neither stalls the loop nor stacks up checks; the old keys
        stay in force meanwhile."""
        check: asyncio.Future[bool] | None = None
        while True:
            await asyncio.sleep(interval_s)
            if check is None or check.done():
                check = asyncio.ensure_future(asyncio.to_thread(self.reload_if_changed))
            try:
                await asyncio.wait_for(asyncio.shield(check), 5 * interval_s)
            except TimeoutError:
                log.error("keeping the previous API keys: checking %s hangs", self.path)
            except Exception:
                log.exception("keeping the previous API keys: checking %s failed", self.path)
