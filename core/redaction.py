"""Text that may leave a process for logs, node_tasks output, the timeline or an exception:
secret-looking content (keys, tokens, passwords, long blobs) redacted, control characters
dropped, truncated. The node agent and the worker's host access (ipmitool, SSH) both use it."""

from __future__ import annotations

import re

MAX_MESSAGE_CHARS = 240

_REDACTED = "[redacted]"
_SECRET_PATTERNS = (
    re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(-----END [A-Z0-9 ]+-----|$)", re.S),
    re.compile(
        r"\b(ssh-(rsa|dss|ed25519)|ecdsa-sha2-\S+|sk-\S+@openssh\.com)\s+[A-Za-z0-9+/=]{16,}"
    ),
    re.compile(
        r"(?i)\b(password|passwd|secret|token|api[_-]?key|credentials?|authorization)"
        r"(\s*[=:]\s*|\s+)(bearer\s+)?\S+"
    ),
    re.compile(r"[A-Za-z0-9+/_-]{32,}={0,2}"),  # long base64 / hex blobs
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def redact(text: str, *, limit: int = MAX_MESSAGE_CHARS) -> str:
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(_REDACTED, text)
    text = _CONTROL.sub(" ", text).strip()
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text
