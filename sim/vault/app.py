"""The Vault simulator's HTTP face: a raw ASGI app answering the subset of Vault's API that hvac's
`client.secrets.kv.v2` and `client.sys` use, with Vault's status codes and bodies.

A raw ASGI app rather than a framework because Vault's API leans on things frameworks normalise
away: the non-standard LIST method, exact error envelopes ({"errors": [...]}, {"errors": []} for
a plain 404), 404s that still carry a body (a deleted version's metadata), and
`Content-Type: application/json` without a charset (hvac compares the header verbatim).

Served by uvicorn with the h11 protocol: httptools rejects LIST.
Never log request bodies, secret values or tokens.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from sim.vault.auth import Auth, AuthError, Token
from sim.vault.kv import CheckAndSetError, KVStore

log = logging.getLogger("sim.vault")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Vault's default max_request_size is 32 MiB; secrets are small, so the simulator keeps memory low.
MAX_BODY_BYTES = 1024 * 1024
SIM_VERSION = "1.15.6+gpucloud.sim"
UNAUTHENTICATED = {"sys/health", "sys/init", "sys/seal-status", "sys/unseal"}
APPROLE_LOGIN = "auth/approle/login"
APPROLE_ROLE = "auth/approle/role/"
ACL_POLICY_PREFIXES = ("sys/policies/acl/", "sys/policy/")
# Vault's own wording, capital letter and all, differs between the two handlers.
NO_VERSIONS = {
    "delete": "No version number provided",
    "undelete": "No version number provided",
    "destroy": "no version number provided",
}


@dataclass
class Reply:
    status: int
    body: Any = None  # None: no body (204, HEAD)


class VaultError(Exception):
    """A request Vault refuses; becomes {"errors": [...]} with this status."""

    def __init__(self, status: int, *errors: str) -> None:
        super().__init__(status, errors)
        self.status = status
        self.errors = list(errors)


def _permission_denied() -> VaultError:
    return VaultError(403, "permission denied")


def _unsupported_path() -> VaultError:
    # Vault's router wraps backend errors in a multierror, hence the odd text.
    return VaultError(404, "1 error occurred:\n\t* unsupported path\n\n")


def _unsupported_operation() -> VaultError:
    return VaultError(405, "1 error occurred:\n\t* unsupported operation\n\n")


def envelope(data: Any, mount_type: str = "kv") -> dict[str, Any]:
    """Vault's logical response wrapper around a backend's `data`."""
    return {
        "request_id": str(uuid.uuid4()),
        "lease_id": "",
        "renewable": False,
        "lease_duration": 0,
        "data": data,
        "wrap_info": None,
        "warnings": None,
        "auth": None,
        "mount_type": mount_type,
    }


@dataclass
class Request:
    operation: str  # read | list | update | delete (Vault's logical operations)
    path: str  # below /v1/, without leading slash
    query: dict[str, list[str]]
    body: dict[str, Any]
    token: str


def _operation(method: str, query: dict[str, list[str]]) -> str:
    if method in ("GET", "HEAD"):
        return "list" if query.get("list", [""])[0].lower() == "true" else "read"
    operation = {"POST": "update", "PUT": "update", "DELETE": "delete", "LIST": "list"}.get(method)
    if operation is None:
        raise _unsupported_operation()
    return operation


def _token(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name.lower() == b"x-vault-token":
            return value.decode("latin-1")
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return credentials.strip()
    return ""


def _json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise VaultError(400, "error parsing JSON") from None
    if not isinstance(body, dict):
        raise VaultError(400, "error parsing JSON")
    return body


def _int_field(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ValueError(field)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise ValueError(field)


def _versions(body: dict[str, Any]) -> list[int]:
    """Vault's TypeCommaIntSlice: a list of ints, a single int, or "1,2,3"."""
    raw = body.get("versions")
    if raw is None or raw == "":
        return []
    items = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list) else [raw]
    try:
        return [_int_field(item, "versions") for item in items]
    except ValueError:
        # Vault echoes the input here; the simulator does not echo request bodies.
        raise VaultError(400, 'error converting input for field "versions"') from None


class VaultApp:
    """ASGI application: one root token, KV v2 mounts backed by `store`, seal/unseal."""

    def __init__(self, store: KVStore, root_token: str) -> None:
        self.store = store
        self.root_token = root_token
        self.auth = Auth(root_token)
        self.sealed = False
        self.cluster_id = str(uuid.uuid4())
        self.cluster_name = f"vault-cluster-{secrets.token_hex(4)}"
        self.token_accessor = secrets.token_urlsafe(18)
        self.started = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            reply = await self._handle(scope, receive)
        except VaultError as err:
            reply = Reply(err.status, {"errors": err.errors})
        if scope["method"] == "HEAD":
            reply = Reply(reply.status)
        await self._send(send, reply)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    async def _send(send: Send, reply: Reply) -> None:
        headers = [(b"cache-control", b"no-store")]
        payload = b""
        if reply.body is not None:
            payload = json.dumps(reply.body, separators=(",", ":")).encode() + b"\n"
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    @staticmethod
    async def _read_body(receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise VaultError(413, "http: request body too large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _handle(self, scope: Scope, receive: Receive) -> Reply:
        raw_path: str = scope["path"]
        if not raw_path.startswith("/v1/"):
            raise VaultError(404)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        operation = _operation(scope["method"].upper(), query)
        path = raw_path[len("/v1/") :]
        while "//" in path:
            path = path.replace("//", "/")
        if operation == "list" and not path.endswith("/"):
            path += "/"  # Vault lists a prefix, with or without the trailing slash
        body = _json_body(await self._read_body(receive)) if operation == "update" else {}
        request = Request(operation, path, query, body, _token(scope.get("headers", [])))

        if request.path.rstrip("/") in UNAUTHENTICATED:
            return self._sys_unauthenticated(request)
        if self.sealed:
            raise VaultError(503, "Vault is sealed")
        try:
            if request.path.rstrip("/") == APPROLE_LOGIN and request.operation == "update":
                body = request.body
                auth = self.auth.login(body.get("role_id"), body.get("secret_id"))
                return Reply(200, {**envelope(None, mount_type="approle"), "auth": auth})
            token = self.auth.lookup(request.token)
            if token is None or not self.auth.allowed(
                token, request.path, self._capability(request)
            ):
                log.info("permission denied: %s /v1/%s", scope["method"], request.path)
                raise _permission_denied()
            if request.path.startswith("auth/"):
                return self._auth_endpoint(request, token)
        except AuthError as err:
            raise VaultError(err.status, err.message) from None
        if request.path.startswith("sys/"):
            return self._sys(request)
        mount = self.store.mount_for(request.path.rstrip("/"))
        if mount is None:
            raise VaultError(404, f'no handler for route "{request.path}". route entry not found.')
        return self._kv(request, mount, request.path[len(mount) + 1 :])

    def _capability(self, request: Request) -> str:
        """The ACL capability a request needs: its operation's, except that a KV v2 write to a
        secret that does not exist yet needs `create` (Vault's existence check)."""
        if request.operation != "update":
            return request.operation
        mount = self.store.mount_for(request.path.rstrip("/"))
        if mount is not None:
            section, _, key = request.path[len(mount) + 1 :].partition("/")
            if section == "data" and key and self.store.metadata(mount, key) is None:
                return "create"
        return "update"

    # --- sys/ and auth/token -------------------------------------------------------------------

    def _seal_status(self) -> dict[str, Any]:
        return {
            "type": "shamir",
            "initialized": True,
            "sealed": self.sealed,
            "t": 1,
            "n": 1,
            "progress": 0,
            "nonce": "",
            "version": SIM_VERSION,
            "build_date": "",
            "migration": False,
            "cluster_name": self.cluster_name,
            "cluster_id": self.cluster_id,
            "recovery_seal": False,
            "storage_type": "inmem" if self.store.data_file is None else "file",
        }

    def _sys_unauthenticated(self, request: Request) -> Reply:
        name = request.path.rstrip("/")
        if name == "sys/health" and request.operation == "read":
            code_param = "sealedcode" if self.sealed else "activecode"
            default = 503 if self.sealed else 200
            try:
                status = int(request.query.get(code_param, [str(default)])[0])
            except ValueError:
                status = default
            return Reply(status, {
                "initialized": True,
                "sealed": self.sealed,
                "standby": False,
                "performance_standby": False,
                "replication_performance_mode": "disabled",
                "replication_dr_mode": "disabled",
                "server_time_utc": int(time.time()),
                "version": SIM_VERSION,
                "enterprise": False,
                "cluster_name": self.cluster_name,
                "cluster_id": self.cluster_id,
                "echo_duration_ms": 0,
                "clock_skew_ms": 0,
                "replication_primary_canary_age_ms": 0,
            })  # fmt: skip
        if name == "sys/init" and request.operation == "read":
            return Reply(200, {"initialized": True})
        if name == "sys/seal-status" and request.operation == "read":
            return Reply(200, self._seal_status())
        if name == "sys/unseal" and request.operation == "update":
            # The simulator has one unseal key share: the root token.
            if request.body.get("reset"):
                return Reply(200, self._seal_status())
            key = request.body.get("key")
            if not isinstance(key, str) or not key:
                raise VaultError(
                    400, "'key' must be specified in request body as JSON, or 'reset' set to true"
                )
            if not secrets.compare_digest(key.encode(), self.root_token.encode()):
                raise VaultError(400, "Error unsealing: invalid key")
            self.sealed = False
            log.info("unsealed")
            return Reply(200, self._seal_status())
        raise _unsupported_operation()

    def _sys(self, request: Request) -> Reply:
        name = request.path.rstrip("/")
        if name == "sys/seal" and request.operation == "update":
            self.sealed = True
            log.info("sealed")
            return Reply(204)
        if name == "sys/mounts" and request.operation == "read":
            mounts = {f"{m}/": self._mount_entry(m) for m in self.store.mounts}
            return Reply(200, {**mounts, **envelope(mounts, mount_type="system")})
        if name == "sys/auth" and request.operation == "read":
            methods = {
                "token/": {"type": "token", "description": "token based credentials"},
                "approle/": {"type": "approle", "description": "AppRole (always enabled here)"},
            }
            return Reply(200, {**methods, **envelope(methods, mount_type="system")})
        if request.path.startswith(ACL_POLICY_PREFIXES):
            return self._acl_policy(request)
        if name in ("sys/policies/acl", "sys/policy") and request.operation in ("read", "list"):
            names = self.auth.policy_names()
            return Reply(200, {"policies": names, **envelope({"keys": names, "policies": names})})
        raise _unsupported_path()

    def _acl_policy(self, request: Request) -> Reply:
        prefix = next(p for p in ACL_POLICY_PREFIXES if request.path.startswith(p))
        name = request.path[len(prefix) :].strip("/")
        if not name:
            raise _unsupported_path()
        try:
            if request.operation == "update":
                self.auth.write_policy(name, request.body.get("policy", request.body.get("rules")))
                return Reply(204)
            if request.operation == "delete":
                self.auth.delete_policy(name)
                return Reply(204)
            if request.operation == "read":
                policy = self.auth.read_policy(name)
                if policy is None:
                    raise VaultError(404)
                body = {**policy, "rules": policy["policy"]}
                return Reply(200, {**body, **envelope(body, mount_type="system")})
        except AuthError as err:
            raise VaultError(err.status, err.message) from None
        raise _unsupported_operation()

    def _auth_endpoint(self, request: Request, token: Token) -> Reply:
        """auth/token/{lookup,renew,revoke}-self and the AppRole administration endpoints."""
        name, op, body = request.path.rstrip("/"), request.operation, request.body
        if name == "auth/token/lookup-self" and op == "read":
            return Reply(200, envelope(self.auth.token_info(request.token), mount_type="token"))
        if name == "auth/token/renew-self" and op == "update":
            auth = self.auth.renew(request.token, body.get("increment"))
            return Reply(200, {**envelope(None, mount_type="token"), "auth": auth})
        if name == "auth/token/revoke-self" and op == "update":
            self.auth.revoke(request.token)
            return Reply(204)
        if name == "auth/approle/role" and op == "list":
            return Reply(200, envelope({"keys": self.auth.role_names()}, mount_type="approle"))
        if not name.startswith(APPROLE_ROLE):
            raise _unsupported_path()
        role, _, rest = name[len(APPROLE_ROLE) :].partition("/")
        match rest, op:
            case "", "update":
                self.auth.write_role(role, body)
                return Reply(204)
            case "", "read":
                settings = self.auth.read_role(role)
                if settings is None:
                    raise VaultError(404)
                return Reply(200, envelope(settings, mount_type="approle"))
            case "", "delete":
                self.auth.delete_role(role)
                return Reply(204)
            case "role-id", "read":
                return Reply(200, envelope({"role_id": self.auth.role_id(role)}, "approle"))
            case "role-id", "update":
                self.auth.set_role_id(role, body.get("role_id"))
                return Reply(204)
            case "secret-id", "update":
                return Reply(200, envelope(self.auth.new_secret_id(role), mount_type="approle"))
            case "secret-id/destroy", "update":
                self.auth.destroy_secret_id(role, body.get("secret_id"))
                return Reply(204)
            case "secret-id-accessor/destroy", "update":
                self.auth.destroy_secret_id_accessor(role, body.get("secret_id_accessor"))
                return Reply(204)
        raise _unsupported_path()

    @staticmethod
    def _mount_entry(mount: str) -> dict[str, Any]:
        return {
            "accessor": f"kv_{uuid.uuid5(uuid.NAMESPACE_URL, mount).hex[:8]}",
            "config": {"default_lease_ttl": 0, "force_no_cache": False, "max_lease_ttl": 0},
            "description": "key/value secret storage",
            "external_entropy_access": False,
            "local": False,
            "options": {"version": "2"},
            "plugin_version": "",
            "running_plugin_version": "",
            "running_sha256": "",
            "seal_wrap": False,
            "type": "kv",
            "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"mount:{mount}")),
        }

    # --- KV v2 ---------------------------------------------------------------------------------

    def _kv(self, request: Request, mount: str, rest: str) -> Reply:
        section, _, key = rest.partition("/")
        op = request.operation
        if section == "config" and not key:
            if op != "read":
                raise _unsupported_operation()
            return Reply(200, envelope(
                {"cas_required": False, "delete_version_after": "0s", "max_versions": 0}
            ))  # fmt: skip
        if section == "metadata":
            return self._kv_metadata(request, mount, key)
        if not key or key.endswith("/"):
            raise _unsupported_path()
        if section == "data":
            return self._kv_data(request, mount, key)
        if section in ("delete", "undelete", "destroy"):
            if op != "update":
                raise _unsupported_operation()
            versions = _versions(request.body)
            if not versions:
                raise VaultError(400, NO_VERSIONS[section])
            {
                "delete": self.store.delete_versions,
                "undelete": self.store.undelete_versions,
                "destroy": self.store.destroy_versions,
            }[section](mount, key, versions)
            return Reply(204)
        raise _unsupported_path()

    def _kv_data(self, request: Request, mount: str, key: str) -> Reply:
        if request.operation == "read":
            raw_version = request.query.get("version", ["0"])[0] or "0"
            try:
                version = _int_field(raw_version, "version")
            except ValueError:
                raise VaultError(400, 'error converting input for field "version"') from None
            found = self.store.read(mount, key, version)
            if found is None:
                raise VaultError(404)
            body, readable = found
            # A deleted or destroyed version: 404, but with the envelope and its metadata.
            return Reply(200 if readable else 404, envelope(body))
        if request.operation == "update":
            if "data" not in request.body:
                raise VaultError(400, "no data provided")
            data = request.body["data"]
            if not isinstance(data, dict):
                raise VaultError(400, 'error converting input for field "data"')
            options = request.body.get("options") or {}
            if not isinstance(options, dict):
                raise VaultError(400, 'error converting input for field "options"')
            cas: int | None = None
            if "cas" in options:
                try:
                    cas = _int_field(options["cas"], "cas")
                except ValueError:
                    raise VaultError(400, "error parsing check-and-set parameter") from None
            try:
                written = self.store.write(mount, key, data, cas)
            except CheckAndSetError as err:
                raise VaultError(400, str(err)) from None
            return Reply(200, envelope(written))
        if request.operation == "delete":
            self.store.delete_latest(mount, key)
            return Reply(204)
        raise _unsupported_operation()

    def _kv_metadata(self, request: Request, mount: str, key: str) -> Reply:
        op = request.operation
        if op == "list":
            keys = self.store.list_keys(mount, key)
            if not keys:
                raise VaultError(404)
            return Reply(200, envelope({"keys": keys}))
        if op == "read":
            metadata = self.store.metadata(mount, key)
            if metadata is None:
                raise VaultError(404)
            return Reply(200, envelope(metadata))
        if op == "delete":
            self.store.delete_metadata(mount, key)
            return Reply(204)
        raise _unsupported_operation()
