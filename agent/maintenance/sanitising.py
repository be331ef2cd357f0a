"""What may leave the node from a maintenance task
(docs/lifecycles/node.md#what-the-control-plane-asks-of-a-node): every string in results, phases and
errors goes through `sanitise` (secret-looking text redacted, the system root's own location never
shown, messages truncated). Separate because both the backend (scrub outcomes) and the activities
(results, phases, errors) apply it, and it is the one rule for both.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import TypeVar

from agent.backends.system_root import SystemRoot
from core.redaction import MAX_MESSAGE_CHARS, redact


def sanitise(text: str, *, root: SystemRoot | None = None, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Text safe for node_tasks output and the timeline: the system root's own location removed
    (paths read as on the node), secret-looking text redacted, control characters dropped,
    truncated to `limit` characters."""
    if root is not None and str(root.path) != "/":
        text = text.replace(str(root.path), "")
    return redact(text, limit=limit)


_T = TypeVar("_T")


def sanitise_strings(value: _T, *, root: SystemRoot | None = None) -> _T:
    """Apply `sanitise` to every string field of a (nested) result dataclass, in place."""
    if is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            current = getattr(value, f.name)
            if isinstance(current, str):
                setattr(value, f.name, sanitise(current, root=root))
            elif isinstance(current, list):
                setattr(
                    value,
                    f.name,
                    [
                        sanitise(item, root=root)
                        if isinstance(item, str)
                        else sanitise_strings(item, root=root)
                        for item in current
                    ],
                )
            elif is_dataclass(current):
                sanitise_strings(current, root=root)
    return value
