"""A stage failure with its §4.7 class and a stable error code, as it crosses into Temporal.

Activities raise `StageError` (or let a `ClassifiedError` such as a MaasError escape); `as_
application_error` turns either into the ApplicationError the workflow sees: type = failure class,
details[0] = {"error_code", "details"}. Messages and details must already be safe to store."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from temporalio.exceptions import ApplicationError

from core.failures import ClassifiedError, FailureClass, application_error


class StageError(ClassifiedError):
    def __init__(
        self,
        failure_class: FailureClass,
        error_code: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        non_retryable: bool | None = None,
    ) -> None:
        super().__init__(message, failure_class=failure_class)
        self.error_code = error_code
        self.details = dict(details or {})
        self.non_retryable = non_retryable


def error_code_of(error: ClassifiedError) -> str:
    if isinstance(error, StageError):
        return error.error_code
    return error.failure_class.value


def as_application_error(error: ClassifiedError) -> ApplicationError:
    details = error.details if isinstance(error, StageError) else {}
    non_retryable = error.non_retryable if isinstance(error, StageError) else None
    status = getattr(error, "status_code", None)
    if status is not None:
        details = {**details, "maas_status_code": status}
    return application_error(
        error.failure_class,
        error.message,
        {"error_code": error_code_of(error), "details": details},
        non_retryable=non_retryable,
    )
