"""Where a decommission left the node's disks (issue 35): what MAAS's event log shows about an
erase since the machine's last deployment, and the one disposition record per job (`erased`,
or `not_erased` with why) kept in the job's followups, which the API and the timeline show.

Separate from the MAAS release stage because two callers decide from it: the release (after
its own release, or adopting one done out of band) and the operator's observation that
adopt_observed_state decides from.
"""

from __future__ import annotations

from typing import Any

from activities.decommission.stage_runtime import Run, ambiguity
from activities.maas.client import MaasClient
from contracts.decommission import DISK_DISPOSITION_KIND, DecommissionState, Erase

# MAAS event types, as the region names them: a deployment (which puts an OS, and then tenant
# data, on the disks) begins with the first; an erase that completed logs the second.
# MAAS's event log (../shared/maas-api-notes.md "Events"): the deployment start, and the status
# change that leaves Disk erasing after a successful wipe ("Disk erasing → Releasing → Ready";
# a failed wipe goes to "Failed disk erasing" instead).
MAAS_DEPLOYMENT_EVENT = "User starting deployment"
MAAS_STATUS_CHANGE_EVENT = "Node changed status"
MAAS_ERASE_FINISHED = "From 'Disk erasing' to 'Releasing'"


async def disks_erased_since_deployment(maas: MaasClient, system_id: str) -> bool:
    """Whether MAAS's event log shows the machine's disks erased since it was last deployed:
    reading newest first, the status change out of Disk erasing into Releasing comes before the
    deployment start. A Ready machine does not say whether a release erased it; only its event
    log does (the status changes are DEBUG events). Not found in the last events: not seen, so
    not erased."""
    for event in await maas.query_events(system_id=system_id, level="DEBUG", limit=200):
        if event.type == MAAS_STATUS_CHANGE_EVENT and event.description == MAAS_ERASE_FINISHED:
            return True
        if event.type == MAAS_DEPLOYMENT_EVENT:
            return False
    return False


def record_disk_disposition(
    state: DecommissionState, disposition: str, **facts: Any
) -> dict[str, Any]:
    """The job's disk disposition (issue 35: where the disks went): `erased` (method, how it
    was observed) or `not_erased` (reason: operator_accepted_risk, erase_failed_fallback,
    machine_absent, machine_vanished). One per job, the last release's; kept in the job's
    followups so the API shows it, and returned for the stage event's details (the timeline)."""
    record = {
        "kind": DISK_DISPOSITION_KIND,
        "disposition": disposition,
        "system_id": state.system_id,
        **{k: v for k, v in facts.items() if v is not None},
    }
    state.followups = [f for f in state.followups if f.get("kind") != DISK_DISPOSITION_KIND]
    state.followups.append(record)
    return record


async def release_disk_disposition(
    run: Run, maas: MaasClient, requested: Erase, *, out_of_band: bool = False
) -> dict[str, Any]:
    """Where this release left the disks, recorded on the job (followups, shown by the
    API) and in the stage's event (the timeline). `erased` only when MAAS's event log shows
    the erase finished since the machine's last deployment (observed now, never inferred
    from the request); otherwise `not_erased` with why: the erase failed and the site's
    policy allowed the no-erase release, or the request asked for none (the operator
    accepted the risk, named with the request's reason)."""
    state, request = run.state, run.input.decommission
    assert state.system_id is not None
    if state.erase_fell_back:
        return record_disk_disposition(
            state,
            "not_erased",
            reason="erase_failed_fallback",
            requested=requested.value,
            detail=f"the {requested.value} erase failed in MAAS (Failed disk erasing); "
            "released without erase as the site's release_fallback_no_erase allows",
        )
    if requested == Erase.NONE:
        return record_disk_disposition(
            state,
            "not_erased",
            reason="operator_accepted_risk",
            requested=Erase.NONE.value,
            accepted_by=request.requested_by or None,
            accepted_reason=request.reason or None,
            detail="the request asked for no erase: the disks keep their data",
        )
    if not await disks_erased_since_deployment(maas, state.system_id):
        raise ambiguity(
            "erase_not_observed",
            f"the machine is Ready but MAAS shows no disk erase since it was deployed; "
            f"the requested {requested.value} erase was not seen done",
            maas_status=state.maas_status,
            erase=requested.value,
        )
    return record_disk_disposition(
        state,
        "erased",
        # Released out of band: MAAS's log shows an erase, not which one.
        method="unknown" if out_of_band else (state.erase_used or requested.value),
        requested=requested.value,
        observed="MAAS event log: Disk erasing ended (Releasing) after the last deployment",
    )
