"""Liveness (no dependencies touched) and readiness (database and Temporal, quickly)."""

from __future__ import annotations

import asyncio

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from sqlalchemy import text

from gateway.errors import error_body
from gateway.runtime import Runtime
from gateway.schemas import ErrorResponse, Health, Readiness

READY_DB_SECONDS = 3.0


class HealthController(Controller):
    path = "/"
    tags = ["health"]

    @get("/healthz", summary="Liveness: the process answers; nothing else is checked")
    async def healthz(self) -> Health:
        return Health(status="ok")

    @get(
        "/readyz",
        summary="Readiness: the database and Temporal answer",
        responses={503: ResponseSpec(data_container=ErrorResponse, description="not ready")},
    )
    async def readyz(self, runtime: NamedDependency[Runtime]) -> Response[Readiness]:
        async def database() -> None:
            async with runtime.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))

        checks = {"database": "ok", "temporal": "ok"}
        codes: list[str] = []
        try:
            await asyncio.wait_for(database(), READY_DB_SECONDS)
        except Exception:
            checks["database"] = "unavailable"
            codes.append("database_unavailable")
        try:
            await runtime.temporal.check_health()
        except Exception:
            checks["temporal"] = "unavailable"
            codes.append("temporal_unavailable")
        if codes:
            body = error_body(codes[0], "not ready", {"checks": checks})
            return Response(body, status_code=503, headers={"Retry-After": "2"})  # type: ignore[arg-type]
        return Response(Readiness(status="ready", checks=checks))
