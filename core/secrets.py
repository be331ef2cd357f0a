"""The product's secret store: Vault KV version 2 through hvac (docs/maas-sites.md#secrets-in-vault,
architecture rule 8).

Paths are full paths whose first segment is the KV mount, e.g. "kv/maas-sites/<id>/api-token"
(core.secret_paths builds them). Every call goes to Vault, nothing is cached, and a token file is
re-read on each call: a rotated secret or token is used by the next call, with no restart.

In production a process logs in by AppRole (`AppRoleCredentials`: a role id and a secret id, each
given directly or in a file re-read at every login, so the secret id can be rotated without a
restart): the token it gets is renewed (`auth/token/renew-self`) once two thirds of its TTL have
passed, replaced by a fresh login when it can no longer be renewed far enough (its max TTL) or has
expired, and on a 403 (revoked, or expired early) the call is retried once after a fresh login.

Errors are SecretStoreError subclasses whose messages name the operation and the path but never a
secret value, nor the text of the underlying exception (hvac's and requests' messages can carry
response or request bodies). They are raised outside the `except` block that caught the original,
so neither __cause__ nor __context__ links back to it.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import hvac
import hvac.exceptions
import requests

from core.config import Settings

T = TypeVar("T")


class SecretStoreError(Exception):
    """A secret operation failed; `path` says which secret. Never carries a secret value."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class SecretStoreUnavailable(SecretStoreError):
    """Vault did not answer in time, refused the connection, is sealed or answered 5xx/429:
    worth retrying later."""


class SecretStoreForbidden(SecretStoreError):
    """Vault answered 403: the token is wrong, expired or not allowed this path."""


class SecretStoreMisconfigured(SecretStoreError):
    """The call cannot succeed as configured: no token, an unreadable token file, a malformed path
    or a KV mount that Vault does not have."""


@runtime_checkable  # Litestar checks injected dependencies against their annotation
class SecretStore(Protocol):
    """What the gateway and activities need from a secret store."""

    async def read(self, path: str) -> dict[str, str] | None: ...

    async def write(self, path: str, data: Mapping[str, str]) -> int: ...

    async def delete(self, path: str) -> None: ...


# hvac raises one class per status; these mean "Vault is there but cannot serve now".
_UNAVAILABLE_STATUS = {
    hvac.exceptions.VaultDown: 503,
    hvac.exceptions.InternalServerError: 500,
    hvac.exceptions.BadGateway: 502,
    hvac.exceptions.VaultNotInitialized: 501,
    hvac.exceptions.RateLimitExceeded: 429,
}
# What a refused AppRole login says when a Vault release answers it with 500 instead of 400.
_REFUSED_LOGIN = re.compile(r"invalid (?:role id|secret id|role or secret id)", re.IGNORECASE)
# The settings that give each credential (core.config), named when none is configured.
_VARIABLES = {
    "Vault token": "GPUCLOUD_VAULT_TOKEN_FILE or GPUCLOUD_VAULT_TOKEN",
    "Vault AppRole role id": "GPUCLOUD_VAULT_ROLE_ID_FILE or GPUCLOUD_VAULT_ROLE_ID",
    "Vault AppRole secret id": "GPUCLOUD_VAULT_SECRET_ID_FILE or GPUCLOUD_VAULT_SECRET_ID",
}


def split_path(path: str) -> tuple[str, str]:
    """("kv", "maas-sites/<id>/api-token") from "kv/maas-sites/<id>/api-token"."""
    mount, _, key = path.partition("/")
    if not mount or not key or key.startswith("/") or key.endswith("/") or "//" in key:
        raise SecretStoreMisconfigured(
            f"secret path {path!r} is not <mount>/<key> (e.g. kv/maas-sites/<id>/api-token)",
            path=path,
        )
    return mount, key


@dataclass(frozen=True)
class AppRoleCredentials:
    """Where an AppRole login's role id and secret id come from: the value, or a file read at
    each login (the bootstrap rotates the secret id by rewriting it)."""

    role_id: str | None = None
    role_id_file: Path | None = None
    secret_id: str | None = field(default=None, repr=False)
    secret_id_file: Path | None = None
    mount: str = "approle"

    def read(self, path: str) -> tuple[str, str]:
        return (
            _value_or_file(self.role_id, self.role_id_file, "Vault AppRole role id", path),
            _value_or_file(self.secret_id, self.secret_id_file, "Vault AppRole secret id", path),
        )


def _value_or_file(value: str | None, file: Path | None, what: str, path: str) -> str:
    """The stripped content of `file` (re-read at each call, so a rotated file needs no
    restart), else `value`; SecretStoreMisconfigured when neither is there (the message names
    the file, never its content)."""
    if file is None:
        if value:
            return value
        raise SecretStoreMisconfigured(f"no {what} configured ({_VARIABLES[what]})", path=path)
    try:
        text = file.read_text().strip()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        error = SecretStoreMisconfigured(f"cannot read the {what} file {str(file)!r}: {reason}",
                                         path=path)  # fmt: skip
    else:
        if text:
            return text
        error = SecretStoreMisconfigured(f"the {what} file {str(file)!r} is empty", path=path)
    raise error from None


@dataclass(frozen=True)
class _Login:
    """A token from an AppRole login (or its latest renewal), with monotonic-clock deadlines."""

    token: str = field(repr=False)
    lease_s: float
    renewable: bool
    renew_at: float
    expires_at: float

    @classmethod
    def from_auth(cls, auth: Mapping[str, Any], now: float) -> _Login:
        lease = float(auth["lease_duration"])
        # A little before Vault's own deadline, for the time the next request takes to arrive.
        margin = min(lease * 0.1, 5.0)
        return cls(
            token=str(auth["client_token"]),
            lease_s=lease,
            renewable=bool(auth.get("renewable")),
            renew_at=now + lease * 2 / 3,
            expires_at=now + lease - margin,
        )


class VaultSecretStore:
    """SecretStore on Vault KV v2. hvac is synchronous: each call runs in a worker thread with a
    client of its own (requests sessions are not meant to be shared between threads), bounded by
    `timeout` seconds for the connection and again for the answer."""

    def __init__(
        self,
        addr: str,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 5.0,
        *,
        approle: AppRoleCredentials | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if token is not None and token_file is not None:
            raise ValueError("give a Vault token or a token file, not both")
        if approle is not None and (token is not None or token_file is not None):
            raise ValueError("give AppRole credentials or a Vault token, not both")
        self._addr = addr.rstrip("/")
        self._token = token or None
        self._token_file = Path(token_file) if token_file is not None else None
        self._timeout = timeout
        self._local = threading.local()
        self._approle = approle
        self._clock = clock
        self._login_lock = threading.Lock()
        self._login: _Login | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> VaultSecretStore:
        """GPUCLOUD_VAULT_ADDR with AppRole (GPUCLOUD_VAULT_ROLE_ID[_FILE] and
        GPUCLOUD_VAULT_SECRET_ID[_FILE]: production), else GPUCLOUD_VAULT_TOKEN_FILE (rotates
        without a restart) or GPUCLOUD_VAULT_TOKEN."""
        if settings.vault_role_id or settings.vault_role_id_file:
            approle = AppRoleCredentials(
                role_id=settings.vault_role_id,
                role_id_file=_path(settings.vault_role_id_file),
                secret_id=settings.vault_secret_id,
                secret_id_file=_path(settings.vault_secret_id_file),
                mount=settings.vault_approle_mount,
            )
            return cls(settings.vault_addr, approle=approle,
                       timeout=settings.vault_timeout_seconds)  # fmt: skip
        if settings.vault_token_file:
            return cls(settings.vault_addr, token_file=settings.vault_token_file,
                       timeout=settings.vault_timeout_seconds)  # fmt: skip
        return cls(settings.vault_addr, token=settings.vault_token,
                   timeout=settings.vault_timeout_seconds)  # fmt: skip

    def __repr__(self) -> str:
        source = f"token_file={str(self._token_file)!r}" if self._token_file else "token=<hidden>"
        if self._approle is not None:
            source = f"approle={self._approle!r}"
        return f"VaultSecretStore(addr={self._addr!r}, {source}, timeout={self._timeout})"

    @property
    def addr(self) -> str:
        return self._addr

    async def read(self, path: str) -> dict[str, str] | None:
        """The latest version's data; None when the secret does not exist or its latest version
        is deleted or destroyed."""
        mount, key = split_path(path)

        def call(client: hvac.Client) -> Any:
            try:
                response = client.secrets.kv.v2.read_secret_version(
                    path=key, mount_point=mount, raise_on_deleted_version=True
                )
            except hvac.exceptions.InvalidPath as exc:
                # Vault's 404 for an absent or deleted secret has no error text; one with text
                # ("no handler for route ...") means the mount itself is missing.
                if exc.errors:
                    raise
                return None
            return response["data"]["data"]

        data = await asyncio.to_thread(self._run, "read", path, call)
        if data is None:
            return None
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in data.items()
        ):
            raise SecretStoreError(f"secret {path!r} in Vault is not a map of strings", path=path)
        return {str(k): str(v) for k, v in data.items()}

    async def write(self, path: str, data: Mapping[str, str]) -> int:
        """Store `data` as the secret's new version; returns that version number."""
        mount, key = split_path(path)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise SecretStoreError(f"secret {path!r}: keys and values must be strings", path=path)
        payload = dict(data)

        def call(client: hvac.Client) -> Any:
            response = client.secrets.kv.v2.create_or_update_secret(
                path=key, secret=payload, mount_point=mount
            )
            return response["data"]["version"]

        return int(await asyncio.to_thread(self._run, "write", path, call))

    async def delete(self, path: str) -> None:
        """Remove every version and the metadata; no error when the secret does not exist."""
        mount, key = split_path(path)

        def call(client: hvac.Client) -> None:
            client.secrets.kv.v2.delete_metadata_and_all_versions(path=key, mount_point=mount)

        await asyncio.to_thread(self._run, "delete", path, call)

    # --- in the worker thread ------------------------------------------------------------------

    def _current_token(self, path: str) -> str:
        if self._approle is not None:
            return self._approle_token(path)
        return _value_or_file(self._token, self._token_file, "Vault token", path)

    def _approle_token(self, path: str) -> str:
        """The logged-in token: renewed past two thirds of its TTL, replaced by a new login once
        expired or when a renewal no longer extends it by its whole TTL (the max TTL caps it:
        renewing on would only give ever shorter tokens)."""
        with self._login_lock:
            login, now = self._login, self._clock()
            if login is None or now >= login.expires_at:
                login = self._log_in(path)
            elif login.renewable and now >= login.renew_at:
                renewed = self._renew(login, path)
                login = renewed if renewed.lease_s >= login.lease_s else self._log_in(path)
            self._login = login
            return login.token

    def _forget_login(self, token: str) -> bool:
        """Drop the login whose token Vault refused; True when there was one to drop."""
        with self._login_lock:
            if self._login is None or self._login.token != token:
                return False
            self._login = None
            return True

    def _log_in(self, path: str) -> _Login:
        assert self._approle is not None
        role_id, secret_id = self._approle.read(path)
        mount = self._approle.mount
        client = hvac.Client(url=self._addr, timeout=self._timeout)
        try:
            response = self._call_translated(
                "AppRole login for",
                path,
                lambda: client.auth.approle.login(role_id, secret_id, False, mount),
            )
        finally:
            client.adapter.close()
        return _Login.from_auth(response["auth"], self._clock())

    def _renew(self, login: _Login, path: str) -> _Login:
        """renew-self; a refused renewal (revoked, expired) is a fresh login instead."""
        client = hvac.Client(url=self._addr, token=login.token, timeout=self._timeout)
        try:
            response = self._call_translated(
                "token renewal for", path, lambda: client.auth.token.renew_self()
            )
        except SecretStoreForbidden:
            return self._log_in(path)
        finally:
            client.adapter.close()
        return _Login.from_auth(response["auth"], self._clock())

    def _call_translated(self, operation: str, path: str, call: Callable[[], T]) -> T:
        error: SecretStoreError
        try:
            return call()
        except hvac.exceptions.InvalidRequest:
            # Vault answers a wrong or expired role id / secret id with 400.
            error = SecretStoreForbidden(
                f"Vault {operation} {path!r} was refused (HTTP 400): the AppRole role id or "
                "secret id is wrong or expired",
                path=path,
            )
        except hvac.exceptions.InternalServerError as exc:
            # Some releases (v1.13.0, checked) answer an unknown secret id with 500 "invalid
            # secret id": a refusal, not an outage that a retry would get past.
            refused = _REFUSED_LOGIN.search(str(exc))
            if refused is None:
                error = self._translate(exc, operation.removesuffix(" for"), path)
            else:
                error = SecretStoreForbidden(
                    f"Vault {operation} {path!r} was refused (HTTP 500, {refused.group(0)}): "
                    "the AppRole role id or secret id is wrong or expired",
                    path=path,
                )
        except Exception as exc:  # translated below, outside this block, so nothing chains
            error = self._translate(exc, operation.removesuffix(" for"), path)
        raise error from None

    def _client(self, token: str) -> hvac.Client:
        """One client (and HTTP connection pool) per calling thread and token: a fresh client
        per call paid a new connection every time, a tenth of a busy worker's CPU. A rotated
        token (token file) gets a new client on the next call."""
        cached: tuple[str, hvac.Client] | None = getattr(self._local, "client", None)
        if cached is not None and cached[0] == token:
            return cached[1]
        if cached is not None:
            cached[1].adapter.close()
        client = hvac.Client(url=self._addr, token=token, timeout=self._timeout)
        self._local.client = (token, client)
        return client

    def _run(self, operation: str, path: str, call: Callable[[hvac.Client], T]) -> T:
        token = self._current_token(path)
        try:
            return self._run_with(token, operation, path, call)
        except SecretStoreForbidden:
            # A logged-in token Vault no longer honours (revoked, expired before its TTL): log
            # in again and retry once. While the token still looks itself up, the 403 is the
            # policy's answer (the path is not this component's) and stands.
            if self._approle is None or self._token_alive(token) or not self._forget_login(token):
                raise
        return self._run_with(self._current_token(path), operation, path, call)

    def _token_alive(self, token: str) -> bool:
        """lookup-self (every token's default policy allows it) answers for a live token."""
        try:
            self._client(token).auth.token.lookup_self()
        except Exception:  # refused or unreachable alike: not known to be alive
            return False
        return True

    def _run_with(
        self, token: str, operation: str, path: str, call: Callable[[hvac.Client], T]
    ) -> T:
        client = self._client(token)
        error: SecretStoreError
        try:
            return call(client)
        except Exception as exc:  # translated below, outside this block, so nothing chains
            error = self._translate(exc, operation, path)
            # A broken connection must not poison the next call on this thread.
            client.adapter.close()
            self._local.client = None
        raise error from None

    def _translate(self, exc: Exception, operation: str, path: str) -> SecretStoreError:
        what = f"Vault {operation} of {path!r}"
        if isinstance(exc, SecretStoreError):
            return exc
        if isinstance(exc, hvac.exceptions.Forbidden):
            return SecretStoreForbidden(
                f"{what} was denied (HTTP 403): the token is invalid or lacks permission", path=path
            )
        status = _UNAVAILABLE_STATUS.get(type(exc))
        if status is not None:
            return SecretStoreUnavailable(f"{what} failed: Vault answered HTTP {status}", path=path)
        if isinstance(exc, requests.exceptions.Timeout):
            return SecretStoreUnavailable(
                f"{what} timed out after {self._timeout:g}s ({self._addr})", path=path
            )
        if isinstance(exc, requests.exceptions.RequestException):
            return SecretStoreUnavailable(
                f"{what} failed: cannot reach Vault at {self._addr} ({type(exc).__name__})",
                path=path,
            )
        if isinstance(exc, hvac.exceptions.InvalidPath):
            return SecretStoreMisconfigured(
                f"{what} failed (HTTP 404): no such KV v2 mount or route", path=path
            )
        if isinstance(exc, hvac.exceptions.InvalidRequest):
            return SecretStoreError(f"{what} was rejected by Vault (HTTP 400)", path=path)
        return SecretStoreError(f"{what} failed ({type(exc).__name__})", path=path)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None
