"""API keys: one per line in a file, checked in constant time, reloaded on change.

A token and each key are compared as SHA-256 digests (``hmac.compare_digest`` on two equal-length
digests), so neither the comparison's time nor its early exit on unequal lengths says anything
about a key's length or content.

A line is a key, optionally followed by the priority levels it may ask for:
``sk-batch-team  levels=5-9`` (or ``levels=3``); a key without ``levels=`` may ask for any. It may
also name its tenant and the tenant's weight and limits (``tenant=team-a weight=2 rpm=600``,
``tenants.py``); a key without ``tenant=`` belongs to the tenant ``default``.

In Kubernetes the file is a mounted Secret. The kubelet updates it in place by writing a new
timestamped folder and swapping a ``..data`` symlink to it, so the path's own mtime never
changes: the watch compares what ``os.stat`` sees through the symlinks (device, inode, mtime,
size), which changes on that swap and on an ordinary rewrite alike.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from slotserve.contracts.pool_spec import MAX_PRIORITY_LEVELS
from slotserve.gateway.admission.tenants import (
    DEFAULT,
    DEFAULT_TENANT,
    LIMIT_OPTIONS,
    Tenant,
    TenantBook,
    TenantError,
    check_tenant_name,
    parse_limit,
)

log = logging.getLogger(__name__)

MAX_KEYS_FILE_BYTES = 1_048_576  # a keys file is small; refuse to read a runaway one
FileIdentity = tuple[int, int, int, int]
ALL_LEVELS = range(1, MAX_PRIORITY_LEVELS + 1)


class ApiKeysError(Exception):
    """The keys file cannot be read, or holds no key; the message says which file and why."""


@dataclass(frozen=True)
class ApiKey:
    secret: str = field(repr=False)  # never in a log line
    levels: range  # the priority levels this key may ask for
    tenant: str = DEFAULT_TENANT

    @property
    def digest(self) -> bytes:
        return _digest(self.secret.encode())


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _parse_levels(value: str, where: str) -> range:
    low, _, high = value.partition("-")
    try:
        levels = range(int(low), int(high or low) + 1)
    except ValueError:
        raise ApiKeysError(f"{where}: levels must be N or LOW-HIGH, got {value!r}") from None
    if not levels or levels.start < 1 or levels.stop - 1 > MAX_PRIORITY_LEVELS:
        raise ApiKeysError(f"{where}: levels must lie within 1-{MAX_PRIORITY_LEVELS}")
    return levels


KEY_OPTIONS = ("levels", "tenant", *LIMIT_OPTIONS)


def _parse_line(options: list[str], where: str, book: TenantBook) -> tuple[range, str]:
    levels, tenant, limits = ALL_LEVELS, DEFAULT_TENANT, {}
    try:
        for option in options:
            name, _, value = option.partition("=")
            if name == "levels":
                levels = _parse_levels(value, where)
            elif name == "tenant":
                tenant = check_tenant_name(value)
            elif name in LIMIT_OPTIONS:
                field_name, number = parse_limit(name, value)
                limits[field_name] = number
            else:
                raise ApiKeysError(f"{where}: unknown option (only {'=, '.join(KEY_OPTIONS)}=)")
        book.add(tenant, limits)
    except TenantError as exc:
        raise ApiKeysError(f"{where}: {exc}") from None
    return levels, tenant


def parse_api_keys(text: str, source: str) -> tuple[ApiKey, ...]:
    """The keys of a keys file (``parse_keys_file`` without the tenants)."""
    return parse_keys_file(text, source)[0]


def parse_keys_file(text: str, source: str) -> tuple[tuple[ApiKey, ...], dict[str, Tenant]]:
    """One key per line, optionally with ``levels=LOW-HIGH`` and tenant options; blank lines
    and lines starting with # are ignored. Messages name the line, never the key. Returns the
    keys and the tenants they declare (``default`` always among them).

    A file without any key is an error, not "authentication off": an empty Secret is almost
    always a mistake, and failing open would let anyone in.
    """
    keys = []
    book = TenantBook()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        secret, *options = line.split()
        levels, tenant = _parse_line(options, f"{source} line {number}", book)
        keys.append(ApiKey(secret, levels, tenant))
    if not keys:
        raise ApiKeysError(f"API keys file {source} holds no key (empty or only comments)")
    return tuple(keys), book.tenants()


def file_identity(path: Path) -> FileIdentity:
    """What changes when the file (or the target of any symlink on its path) is replaced."""
    stat = os.stat(path)  # follows symlinks: the kubelet's ..data swap gives a new inode
    return (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)


KeysAndTenants = tuple[tuple[ApiKey, ...], dict[str, Tenant]]


def read_api_keys(path: Path) -> tuple[KeysAndTenants, FileIdentity]:
    try:
        identity = file_identity(path)
        if identity[3] > MAX_KEYS_FILE_BYTES:
            raise ApiKeysError(f"API keys file {path} is larger than {MAX_KEYS_FILE_BYTES} bytes")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeysError(f"cannot read API keys file {path}: {exc}") from exc
    return parse_keys_file(text, str(path)), identity


class ApiKeys:
    """The keys in force now; empty (no file) means every caller is accepted."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.keys: tuple[ApiKey, ...] = ()
        self.tenants: dict[str, Tenant] = {DEFAULT_TENANT: DEFAULT}
        self._digests: tuple[bytes, ...] = ()
        self._identity: FileIdentity | None = None
        if path is not None:
            keys, self._identity = read_api_keys(path)
            self._use(keys)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _use(self, parsed: KeysAndTenants) -> None:
        keys, self.tenants = parsed
        self.keys, self._digests = keys, tuple(key.digest for key in keys)

    def _matching(self, authorization: str) -> list[ApiKey]:
        scheme, _, token = authorization.partition(" ")
        token_digest = _digest(token.strip().encode())
        # Digests of equal length, against every key (no early exit): timing says nothing about
        # which key matched, nor how long any key is.
        matches = [hmac.compare_digest(token_digest, digest) for digest in self._digests]
        if scheme.lower() != "bearer":
            return []
        return [key for key, match in zip(self.keys, matches, strict=True) if match]

    def accepts(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (as a bearer)."""
        return bool(self._matching(authorization))

    def allowed_levels(self, authorization: str) -> range:
        """The priority levels the caller's key may ask for: every level without keys, none
        for a caller without a valid key (the middleware has answered 401 already)."""
        if not self.enabled:
            return ALL_LEVELS
        matching = self._matching(authorization)
        return matching[0].levels if matching else range(0)

    def tenant_of(self, authorization: str) -> Tenant:
        """The caller's tenant: its key's, else (no keys configured) the default tenant."""
        if not self.enabled:
            return self.tenants[DEFAULT_TENANT]
        matching = self._matching(authorization)
        name = matching[0].tenant if matching else DEFAULT_TENANT
        return self.tenants.get(name, DEFAULT)

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
        self._use(keys)
        log.info(
            "reloaded API keys from %s: %d keys, %d tenants",
            self.path,
            len(keys[0]),
            len(keys[1]),
        )
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
