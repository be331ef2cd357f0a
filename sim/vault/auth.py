"""Auth of the Vault simulator, as Vault documents it: service tokens with TTLs (renew-self up to
the role's max TTL, lookup-self, revoke-self), ACL policies (`sys/policies/acl/<name>`, HCL or
JSON, per-path capabilities) and the AppRole method (`auth/approle`: roles, role ids, secret ids
and login). The root token has the `root` policy and no TTL; every other token has the `default`
policy (its own lookup, renewal and revocation) and its role's policies.

Pure state, no HTTP: `sim.vault.app` checks each request against `Auth.allowed` and maps the
auth endpoints onto these methods. Auth state lives in memory (the stack provisions roles and
policies on each start); secret ids and tokens are kept as SHA-256 digests only.

Simplifications: no entities, groups, token roles, batch tokens, CIDR bindings, response
wrapping or parameter constraints in policies. When several policy paths match a request, one
decides, by Vault's priority rules (its policy documentation, "Priority matching"): an exact path
first, then the later first wildcard, no trailing `*`, fewer `+` segments, the longer path, the
lexicographically larger; the same path in several of the token's policies has the union of
their capabilities, and a `deny` among them wins.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim.vault.kv import vault_timestamp

ROOT_POLICY = "root"
DEFAULT_POLICY = "default"
# Vault's default policy: a token may look itself up, renew and revoke itself.
DEFAULT_POLICY_PATHS = {
    "auth/token/lookup-self": {"read"},
    "auth/token/renew-self": {"update"},
    "auth/token/revoke-self": {"update"},
}
# Vault's system default for a token TTL without a role or mount setting: 768h.
SYSTEM_MAX_TTL_S = 768 * 3600
CAPABILITIES = {"create", "read", "update", "patch", "delete", "list", "sudo", "deny"}
_TOKEN_ALPHABET = string.ascii_letters + string.digits
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


class AuthError(Exception):
    """A refused auth request; `status` and Vault's error text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_service_token() -> str:
    return "hvs." + "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(24))


def parse_duration(value: Any, field_name: str) -> int:
    """Vault's TypeDurationSecond: an integer of seconds, or a duration string ("90s", "15m",
    "1h30m"); whole seconds."""
    if isinstance(value, bool):
        raise AuthError(400, f'error converting input for field "{field_name}"')
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        parts = _DURATION.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return int(sum(int(n) * _DURATION_UNITS[u or None] for n, u in parts))
    raise AuthError(400, f'error converting input for field "{field_name}"')


def parse_list(value: Any) -> list[str]:
    """Vault's TypeCommaStringSlice: a list, or one comma-separated string."""
    if value is None or value == "":
        return []
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise AuthError(400, "expected a list of strings")
    return [i.strip() for i in items if i.strip()]


# --- policies ------------------------------------------------------------------------------------

_HCL_PATH = re.compile(r'path\s+"([^"]+)"\s*\{([^}]*)\}', re.S)
_HCL_CAPABILITIES = re.compile(r"capabilities\s*=\s*\[([^\]]*)\]", re.S)
_HCL_COMMENT = re.compile(r"(#|//)[^\n]*")


def parse_policy(text: str) -> dict[str, set[str]]:
    """{path pattern: capabilities} from a policy in HCL (`path "kv/data/x" { capabilities =
    ["read"] }`) or its JSON form (`{"path": {"kv/data/x": {"capabilities": ["read"]}}}`)."""
    try:
        document = json.loads(text)
    except ValueError:
        document = None
    rules = _hcl_rules(text) if document is None else _json_rules(document)
    for pattern, capabilities in rules.items():
        unknown = capabilities - CAPABILITIES
        if unknown:
            raise AuthError(400, f'invalid capability "{sorted(unknown)[0]}" on path "{pattern}"')
    return rules


def _no_capabilities(pattern: str) -> AuthError:
    return AuthError(400, f'failed to parse policy: path "{pattern}" has no capabilities')


def _hcl_rules(text: str) -> dict[str, set[str]]:
    rules: dict[str, set[str]] = {}
    body = _HCL_COMMENT.sub("", text)
    for pattern, block in _HCL_PATH.findall(body):
        found = _HCL_CAPABILITIES.search(block)
        if found is None:
            raise _no_capabilities(pattern)
        rules[pattern] = set(re.findall(r'"([^"]*)"', found.group(1)))
    if not rules and body.strip():
        raise AuthError(400, "failed to parse policy")
    return rules


def _json_rules(document: Any) -> dict[str, set[str]]:
    paths = document.get("path") if isinstance(document, dict) else None
    if not isinstance(paths, dict):
        raise AuthError(400, "failed to parse policy")
    rules: dict[str, set[str]] = {}
    for pattern, block in paths.items():
        capabilities = block.get("capabilities") if isinstance(block, dict) else None
        if not isinstance(capabilities, list):
            raise _no_capabilities(pattern)
        rules[pattern] = {str(c) for c in capabilities}
    return rules


def _matches(pattern: str, path: str) -> bool:
    """Vault's path patterns: a `+` segment is any one segment, a trailing `*` any suffix."""
    glob = pattern.endswith("*")
    body = pattern[:-1] if glob else pattern
    regex = "/".join("[^/]+" if part == "+" else re.escape(part) for part in body.split("/"))
    return re.fullmatch(regex + (".*" if glob else ""), path) is not None


def _priority(pattern: str) -> tuple[bool, int, bool, int, int, str]:
    """Vault's order among the policy paths that match a request; the highest decides."""
    glob = pattern.endswith("*")
    plus = pattern.find("+")
    if plus < 0 and not glob:
        return (True, len(pattern), True, 0, len(pattern), pattern)  # exact: always first
    first_wildcard = plus if plus >= 0 else len(pattern) - 1
    return (False, first_wildcard, not glob, -pattern.count("+"), len(pattern), pattern)


# --- tokens and AppRole --------------------------------------------------------------------------


@dataclass
class Token:
    token_digest: str
    accessor: str
    policies: list[str]
    path: str
    display_name: str
    creation_time: float
    ttl_s: int  # 0: never expires (root)
    max_ttl_s: int
    expires_at: float | None
    meta: dict[str, str] | None = None

    def ttl_left(self, now: float) -> int:
        return 0 if self.expires_at is None else max(0, round(self.expires_at - now))


@dataclass
class SecretId:
    accessor: str
    created: float
    expires_at: float | None
    uses_left: int | None  # None: unlimited


@dataclass
class Role:
    name: str
    role_id: str
    token_policies: list[str] = field(default_factory=list)
    token_ttl_s: int = 0
    token_max_ttl_s: int = 0
    secret_id_ttl_s: int = 0
    secret_id_num_uses: int = 0
    secret_ids: dict[str, SecretId] = field(default_factory=dict)  # by digest

    def settings(self) -> dict[str, Any]:
        return {
            "bind_secret_id": True,
            "secret_id_bound_cidrs": None,
            "secret_id_num_uses": self.secret_id_num_uses,
            "secret_id_ttl": self.secret_id_ttl_s,
            "local_secret_ids": False,
            "token_policies": self.token_policies,
            "policies": self.token_policies,
            "token_ttl": self.token_ttl_s,
            "token_max_ttl": self.token_max_ttl_s,
            "token_type": "default",
            "token_no_default_policy": False,
            "token_num_uses": 0,
            "token_period": 0,
        }


_ROLE_FIELDS = {
    "token_policies",
    "policies",
    "token_ttl",
    "token_max_ttl",
    "secret_id_ttl",
    "secret_id_num_uses",
    "bind_secret_id",
    "token_type",
}


class Auth:
    """Tokens, policies and AppRole roles; thread-safe (uvicorn serves from one loop, the tests
    call it directly too)."""

    def __init__(self, root_token: str, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[str, Token] = {}
        self._policies: dict[str, tuple[str, dict[str, set[str]]]] = {}
        self._roles: dict[str, Role] = {}
        root = Token(
            token_digest=digest(root_token),
            accessor=secrets.token_urlsafe(18),
            policies=[ROOT_POLICY],
            path="auth/token/root",
            display_name="root",
            creation_time=clock(),
            ttl_s=0,
            max_ttl_s=0,
            expires_at=None,
        )
        self._tokens[root.token_digest] = root

    # --- tokens ---

    def lookup(self, token: str) -> Token | None:
        """The live token, or None (unknown, revoked or expired: Vault answers 403 for all)."""
        if not token:
            return None
        with self._lock:
            entry = self._tokens.get(digest(token))
            if entry is None:
                return None
            if entry.expires_at is not None and entry.expires_at <= self._clock():
                del self._tokens[entry.token_digest]
                return None
            return entry

    def token_info(self, token: str) -> dict[str, Any]:
        """auth/token/lookup-self's data."""
        entry = self._require(token)
        now = self._clock()
        expire_time = None if entry.expires_at is None else _rfc3339(entry.expires_at)
        return {
            "accessor": entry.accessor,
            "creation_time": int(entry.creation_time),
            "creation_ttl": entry.ttl_s,
            "display_name": entry.display_name,
            "entity_id": "",
            "expire_time": expire_time,
            "explicit_max_ttl": 0,
            "id": token,
            "issue_time": _rfc3339(entry.creation_time),
            "meta": entry.meta,
            "num_uses": 0,
            "orphan": True,
            "path": entry.path,
            "policies": entry.policies,
            "renewable": entry.expires_at is not None,
            "ttl": entry.ttl_left(now),
            "type": "service",
        }

    def renew(self, token: str, increment: Any) -> dict[str, Any]:
        """auth/token/renew-self: a new TTL of `increment` (default: the token's own TTL), never
        past its max TTL counted from its creation; the auth block of the answer."""
        entry = self._require(token)
        if entry.expires_at is None:
            raise AuthError(400, "lease is not renewable")
        wanted = (
            entry.ttl_s if increment in (None, "", 0) else parse_duration(increment, "increment")
        )
        now = self._clock()
        with self._lock:
            ceiling = entry.creation_time + entry.max_ttl_s
            entry.expires_at = min(now + wanted, ceiling)
        return self._auth_block(token, entry)

    def revoke(self, token: str) -> None:
        with self._lock:
            self._tokens.pop(digest(token), None)

    def _require(self, token: str) -> Token:
        entry = self.lookup(token)
        if entry is None:
            raise AuthError(403, "permission denied")
        return entry

    def _auth_block(self, token: str, entry: Token) -> dict[str, Any]:
        return {
            "client_token": token,
            "accessor": entry.accessor,
            "policies": entry.policies,
            "token_policies": entry.policies,
            "identity_policies": None,
            "metadata": entry.meta,
            "lease_duration": entry.ttl_left(self._clock()),
            "renewable": entry.expires_at is not None,
            "entity_id": "",
            "token_type": "service",
            "orphan": True,
            "mfa_requirement": None,
            "num_uses": 0,
        }

    # --- policies ---

    def write_policy(self, name: str, text: Any) -> None:
        if name in (ROOT_POLICY, DEFAULT_POLICY):
            raise AuthError(400, f'cannot update "{name}" policy')
        if not isinstance(text, str) or not text.strip():
            raise AuthError(400, "'policy' parameter not supplied or empty")
        rules = parse_policy(text)
        with self._lock:
            self._policies[name] = (text, rules)

    def read_policy(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._policies.get(name)
        return None if found is None else {"name": name, "policy": found[0]}

    def delete_policy(self, name: str) -> None:
        with self._lock:
            self._policies.pop(name, None)

    def policy_names(self) -> list[str]:
        with self._lock:
            return sorted([DEFAULT_POLICY, ROOT_POLICY, *self._policies])

    def allowed(self, entry: Token, path: str, capability: str) -> bool:
        """Whether the token's policies grant `capability` on `path` (a `deny` wins)."""
        if ROOT_POLICY in entry.policies:
            return True
        if capability in DEFAULT_POLICY_PATHS.get(path.rstrip("/"), set()):
            return True
        with self._lock:
            rule_sets = [self._policies[p][1] for p in entry.policies if p in self._policies]
        matching = [(pattern, caps) for rules in rule_sets for pattern, caps in rules.items()
                    if _matches(pattern, path)]  # fmt: skip
        if not matching:
            return False
        winner = max((pattern for pattern, _ in matching), key=_priority)
        granted = set().union(*(caps for pattern, caps in matching if pattern == winner))
        return "deny" not in granted and capability in granted

    # --- AppRole ---

    def write_role(self, name: str, body: dict[str, Any]) -> None:
        unknown = set(body) - _ROLE_FIELDS
        if unknown:
            raise AuthError(400, f"unknown fields: {sorted(unknown)}")
        with self._lock:
            role = self._roles.get(name) or Role(name=name, role_id=str(uuid.uuid4()))
            if "token_policies" in body or "policies" in body:
                role.token_policies = parse_list(body.get("token_policies", body.get("policies")))
            for key, attribute in (
                ("token_ttl", "token_ttl_s"),
                ("token_max_ttl", "token_max_ttl_s"),
                ("secret_id_ttl", "secret_id_ttl_s"),
            ):
                if key in body:
                    setattr(role, attribute, parse_duration(body[key], key))
            if "secret_id_num_uses" in body:
                role.secret_id_num_uses = parse_duration(body["secret_id_num_uses"], "uses")
            if role.token_max_ttl_s and role.token_ttl_s > role.token_max_ttl_s:
                raise AuthError(400, "token_ttl should not be greater than token_max_ttl")
            self._roles[name] = role

    def read_role(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            role = self._roles.get(name)
            return None if role is None else role.settings()

    def delete_role(self, name: str) -> None:
        with self._lock:
            self._roles.pop(name, None)

    def role_names(self) -> list[str]:
        with self._lock:
            return sorted(self._roles)

    def role_id(self, name: str) -> str:
        return self._role(name).role_id

    def set_role_id(self, name: str, role_id: Any) -> None:
        if not isinstance(role_id, str) or not role_id:
            raise AuthError(400, "missing role_id")
        with self._lock:
            self._role_locked(name).role_id = role_id

    def new_secret_id(self, name: str) -> dict[str, Any]:
        secret_id = str(uuid.uuid4())
        now = self._clock()
        with self._lock:
            role = self._role_locked(name)
            entry = SecretId(
                accessor=str(uuid.uuid4()),
                created=now,
                expires_at=now + role.secret_id_ttl_s if role.secret_id_ttl_s else None,
                uses_left=role.secret_id_num_uses or None,
            )
            role.secret_ids[digest(secret_id)] = entry
        return {
            "secret_id": secret_id,
            "secret_id_accessor": entry.accessor,
            "secret_id_ttl": role.secret_id_ttl_s,
            "secret_id_num_uses": role.secret_id_num_uses,
        }

    def destroy_secret_id_accessor(self, name: str, accessor: Any) -> None:
        with self._lock:
            role = self._role_locked(name)
            for key, entry in list(role.secret_ids.items()):
                if entry.accessor == accessor:
                    del role.secret_ids[key]
                    return
        raise AuthError(404, f"failed to find accessor entry for secret_id_accessor: {accessor!r}")

    def destroy_secret_id(self, name: str, secret_id: Any) -> None:
        with self._lock:
            self._role_locked(name).secret_ids.pop(digest(str(secret_id)), None)

    def login(self, role_id: Any, secret_id: Any) -> dict[str, Any]:
        """auth/approle/login: a new service token with the role's policies and TTLs."""
        if not isinstance(role_id, str) or not role_id:
            raise AuthError(400, "missing role_id")
        if not isinstance(secret_id, str) or not secret_id:
            raise AuthError(400, "missing secret_id")
        now = self._clock()
        with self._lock:
            role = next((r for r in self._roles.values() if r.role_id == role_id), None)
            if role is None:
                raise AuthError(400, "invalid role or secret ID")
            entry = role.secret_ids.get(digest(secret_id))
            if entry is None or (entry.expires_at is not None and entry.expires_at <= now):
                role.secret_ids.pop(digest(secret_id), None)
                raise AuthError(400, "invalid role or secret ID")
            if entry.uses_left is not None:
                entry.uses_left -= 1
                if entry.uses_left <= 0:
                    del role.secret_ids[digest(secret_id)]
            max_ttl = min(role.token_max_ttl_s or SYSTEM_MAX_TTL_S, SYSTEM_MAX_TTL_S)
            ttl = min(role.token_ttl_s or max_ttl, max_ttl)
            token = new_service_token()
            issued = Token(
                token_digest=digest(token),
                accessor=secrets.token_urlsafe(18),
                policies=sorted({DEFAULT_POLICY, *role.token_policies}),
                path="auth/approle/login",
                display_name="approle",
                creation_time=now,
                ttl_s=ttl,
                max_ttl_s=max_ttl,
                expires_at=now + ttl,
                meta={"role_name": role.name},
            )
            self._tokens[issued.token_digest] = issued
        return self._auth_block(token, issued)

    def _role(self, name: str) -> Role:
        with self._lock:
            return self._role_locked(name)

    def _role_locked(self, name: str) -> Role:
        role = self._roles.get(name)
        if role is None:
            raise AuthError(400, f'role "{name}" does not exist')
        return role


def _rfc3339(seconds: float) -> str:
    return vault_timestamp(int(seconds * 1_000_000_000))
