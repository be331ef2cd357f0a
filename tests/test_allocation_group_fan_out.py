"""The group release fan-out's reading of each member's answer (activities/allocation_groups.py,
release_members): a member that refused or whose workflow has ended is skipped, but Temporal not
answering fails the activity, so its retry asks again (under the same update ids) instead of the
member being left out of the release. Temporal's own answers for the first two are exercised end
to end in tests/test_allocation_groups.py; an unavailable service cannot be produced there."""

from __future__ import annotations

from typing import Any, cast

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.allocation_groups import AllocationGroupActivities
from contracts.allocation import NOT_RELEASABLE, ReleaseRequest, allocation_workflow_id
from contracts.allocation_group import MemberReleases
from contracts.states import ReleaseActor


class _Handle:
    def __init__(self, client: _Client, workflow_id: str) -> None:
        self._client, self._workflow_id = client, workflow_id

    async def execute_update(self, update: str, arg: Any, *, id: str, **_: Any) -> None:
        self._client.asked.append((self._workflow_id, id))
        error = self._client.errors.get(self._workflow_id)
        if error is not None:
            raise error


class _Client:
    def __init__(self, errors: dict[str, BaseException]) -> None:
        self.errors = errors
        self.asked: list[tuple[str, str]] = []

    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return _Handle(self, workflow_id)


def _fan_out(client: _Client, members: list[str]) -> Any:
    activities = AllocationGroupActivities(cast(Any, None), cast(Client, client))
    return activities.release_members(
        MemberReleases(
            "allocation-group-g", 1, members, ReleaseRequest(actor=ReleaseActor.USER.value)
        )
    )


async def test_refused_and_ended_members_are_skipped() -> None:
    refused = WorkflowUpdateFailedError(ApplicationError("failed", type=NOT_RELEASABLE))
    ended = RPCError("workflow execution already completed", RPCStatusCode.NOT_FOUND, b"")
    client = _Client({allocation_workflow_id("b"): refused, allocation_workflow_id("c"): ended})
    result = await _fan_out(client, ["a", "b", "c"])
    assert (result.asked, result.skipped) == (["a"], ["b", "c"])
    assert sorted(client.asked) == [
        (allocation_workflow_id(m), f"allocation-group-g/release-1/{m}") for m in "abc"
    ]


@pytest.mark.parametrize(
    "status", [RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.INTERNAL]
)
async def test_temporal_not_answering_fails_the_fan_out_for_its_retry(
    status: RPCStatusCode,
) -> None:
    client = _Client({allocation_workflow_id("b"): RPCError("no answer", status, b"")})
    with pytest.raises(RPCError):
        await _fan_out(client, ["a", "b"])
