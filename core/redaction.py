"""Text that may leave a process for logs, node_tasks output, the timeline or an exception:
secret-looking content (keys, tokens, passwords, private key blocks, cloud-init content, long
blobs) redacted, control characters dropped, truncated. The node agent, the worker's host access
(ipmitool, SSH) and every free-text field of the allocation timeline's records (phase messages,
reasons, failure messages: activities/node_task_log.py) use it."""

from __future__ import annotations

import re

MAX_MESSAGE_CHARS = 240

_REDACTED = "[redacted]"
_SECRET_PATTERNS = (
    re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(-----END [A-Z0-9 ]+-----|$)", re.S),
    # Cloud-init content: everything from its header or a user-data assignment on (it may hold
    # passwords, keys and tokens anywhere below).
    re.compile(r"(?i)(#cloud-config|#!/bin/\S+|\buser[-_ ]?data\s*[=:]).*", re.S),
    re.compile(
        r"\b(ssh-(rsa|dss|ed25519)|ecdsa-sha2-\S+|sk-\S+@openssh\.com)\s+[A-Za-z0-9+/=]{16,}"
    ),
    re.compile(
        r"(?i)\b(password|passwd|secret|token|api[_-]?key|credentials?|authorization)"
        r"(\s*[=:]\s*|\s+)(bearer\s+)?\S+"
    ),
    re.compile(r"\b(gpc|sk|pk|rk|whsec|ghp|xox[abp])_[A-Za-z0-9_]{8,}"),  # prefixed API tokens
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"[A-Za-z0-9+/_-]{32,}={0,2}"),  # long base64 / hex blobs
)
# A UUID is an id, not a secret, though it is as long as a blob: it is kept, also as part of a
# name made from it (a VM domain `gpc-<allocation id>`, a workflow id `allocation-<id>`).
_UUID = re.compile(r"([A-Za-z][A-Za-z0-9]*-)*[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _replace(match: re.Match[str]) -> str:
    return match.group() if _UUID.fullmatch(match.group()) else _REDACTED


def redact(text: str, *, limit: int = MAX_MESSAGE_CHARS) -> str:
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(_replace, text)
    text = _CONTROL.sub(" ", text).strip()
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def redact_optional(text: str | None, *, limit: int = MAX_MESSAGE_CHARS) -> str | None:
    """`redact` for a nullable column: None stays None."""
    return None if text is None else redact(text, limit=limit)
