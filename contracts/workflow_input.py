"""What a workflow accepts from an update or a signal (issue 38): input that an activity could
not store later (PostgreSQL refuses NUL; a lone surrogate cannot be encoded; a column has its
length) is refused by the update's validator, before it enters history, or dropped by the
signal handler with a warning, so a malformed message can never fail a workflow task or the
workflow. Pure: safe in workflow code (validators and handlers).

The gateway refuses all of this at the edge first (422 invalid_text, gateway.request_decoding);
these checks hold for whatever else can reach Temporal (other clients, agents, old gateways).
"""

from __future__ import annotations

import re
import uuid

from temporalio.exceptions import ApplicationError

# An update refused for its input (the gateway answers 422 before one could reach a workflow).
INVALID_INPUT = "invalid_input"
# Free text (reasons, notes): one line, no control character, no lone surrogate.
_NOT_TEXT = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
# Any stored string, multi-line allowed: no NUL, other C0 controls but tab/newline/CR, DEL, or
# lone surrogate.
_NOT_STORABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
# A reason or note: the gateway bounds an operator's at 500 characters (gateway.schemas.Reason),
# and callers prefix their own context (a decommission names itself); the columns are text.
MAX_REASON_CHARS = 2000
MAX_ID_CHARS = 255


def text_problem(value: object, *, max_chars: int, one_line: bool = True) -> str | None:
    """Why `value` is not a storable string of at most `max_chars` characters, or None."""
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    if len(value) > max_chars:
        return f"longer than {max_chars} characters"
    if (_NOT_TEXT if one_line else _NOT_STORABLE).search(value):
        return "holds a NUL, another control character or a lone surrogate"
    return None


def uuid_problem(value: object) -> str | None:
    """Why `value` is not a UUID's text, or None."""
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    try:
        uuid.UUID(value)
    except ValueError:
        return "not a UUID"
    return None


def check_text(field: str, value: object, *, max_chars: int = MAX_REASON_CHARS) -> None:
    """For validators: refuse `value` unless it is storable one-line text (INVALID_INPUT)."""
    if (problem := text_problem(value, max_chars=max_chars)) is not None:
        raise invalid_input(field, problem)


def invalid_input(field: str, problem: str) -> ApplicationError:
    # The problem names the rule broken, never the value (it may be hostile or secret).
    return ApplicationError(f"{field}: {problem}", type=INVALID_INPUT, non_retryable=True)
