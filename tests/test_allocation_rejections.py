"""Ordinary placement refusals (sku_unavailable, balance_depleted) end to end: the typed HTTP
answer with nothing reserved, one info line in the worker's log and no warning with a traceback
(they are outcomes, not faults), and the rejected workflows' recorded histories."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from contracts.allocation import allocation_workflow_id
from gateway.allocations import allocation_id_for
from schema.models import Allocation, AllocationResourceClaim
from tests.histories import record_history
from tests.lifecycle_support import baremetal_request, create_fleet, slice_request

pytestmark = pytest.mark.usefixtures("control_plane")


async def test_an_ordinary_rejection_is_one_info_line_without_a_traceback(
    api: Any, make_project: Any, make_token: Any, db_sessions: Any, temporal_client: Any,
    count_rows: Any, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    await create_fleet(db_sessions, slice_nodes=1)  # and no bare-metal node at all
    funded = await make_project()
    never_credited = await make_project(credit_minor=0)
    cases = [
        (funded, baremetal_request(), 409, "sku_unavailable", "rejected_sku_unavailable"),
        (never_credited, slice_request(1), 402, "balance_depleted", "rejected_balance_depleted"),
    ]
    caplog.set_level(logging.DEBUG)
    for project, body, status, code, history in cases:
        client = await api(token=await make_token("tenant", project))
        key = f"reject-{code}"
        caplog.clear()
        response = await client.post(
            "/api/v1/allocations", json=body, headers={"X-Idempotency-Key": key}
        )
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        handle = temporal_client.get_workflow_handle(
            allocation_workflow_id(str(allocation_id_for(project.id, key)))
        )
        assert (await handle.result())["status"] == "rejected"

        ours = [r for r in caplog.records if r.name == "activities.allocations"]
        assert [(r.levelno, code in r.getMessage()) for r in ours] == [(logging.INFO, True)]
        loud = [
            r
            for r in caplog.records
            if r.levelno >= logging.WARNING or (r.exc_info and r.levelno >= logging.INFO)
        ]
        assert not loud, [(r.name, r.levelname, r.getMessage()) for r in loud]
        await record_history(handle, "allocation", history)

    assert await count_rows(Allocation) == 0
    assert await count_rows(AllocationResourceClaim) == 0
