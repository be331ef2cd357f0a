"""What the workflow's operator actions run (docs/lifecycles/decommission.md#actions): `observe`,
the fresh look at the node record, MAAS's machine and the live allocations that adopt_observed_state
decides from, and `compensate`, what cancel does (MAAS is never touched back; the node is not left
in draining or removing without an owner).

Separate from the stages because these are not stages: they run outside the stage sequence,
write no stage events of their own (compensate writes one `cancel` event), and must answer even
when MAAS cannot be asked.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select
from temporalio import activity

from activities.decommission import read_model
from activities.decommission.disk_disposition import disks_erased_since_deployment
from activities.decommission.stage_runtime import (
    ACTOR,
    MAAS_TIMEOUT_SECONDS,
    Run,
    S,
    StageRuntime,
    observe_machine,
)
from activities.maas.errors import MaasNotFound
from activities.node_lifecycle import transition_node, transition_path
from activities.onboarding.stage_errors import as_application_error
from contracts.decommission import Erase, EventStatus, Observation, Stage, StageInput, StageResult
from contracts.states import NodeStatus
from core.failures import ClassifiedError
from core.secrets import SecretStoreError
from schema.models import Node


class OperatorActions(StageRuntime):
    @activity.defn(name="decommission.observe")
    async def observe(self, input: StageInput) -> Observation:
        """What adopt_observed_state decides from, seen now: the node record (its status and
        its MAAS binding, which a stage that failed may never have handed back), MAAS's machine,
        and the live allocations on the node. MAAS is asked through the loaded site only; when
        it cannot be asked (no site loaded, token missing, MAAS unreachable) the observation
        says so (`maas_observed` False, `maas_error` why) instead of reporting the machine
        absent."""
        run = Run(input=input, stage=Stage.DISABLE_NODE)
        state = input.state
        try:
            await self._load_node(run)
        except ClassifiedError as err:
            raise as_application_error(err) from err
        async with self.deps.sessions() as session:
            node_status = await session.scalar(select(Node.status).where(Node.id == run.node_id))
        machine_present = maas_observed = False
        maas_error = ""
        disks_erased: bool | None = None
        if state.maas_managed:
            if input.site is None:
                maas_error = "the site configuration is not loaded"
            elif not state.system_id:
                maas_error = "the node's MAAS binding names no machine"
            else:
                try:
                    async with asyncio.timeout(MAAS_TIMEOUT_SECONDS), self.maas(run) as maas:
                        try:
                            machine = await maas.get_machine(state.system_id)
                        except MaasNotFound:
                            state.maas_status = None
                            maas_observed = True
                        else:
                            observe_machine(state, machine)
                            machine_present = maas_observed = True
                            erase = Erase(input.decommission.erase)
                            if machine.status == S.READY and erase != Erase.NONE:
                                disks_erased = await disks_erased_since_deployment(
                                    maas, state.system_id
                                )
                except (ClassifiedError, SecretStoreError, TimeoutError) as err:
                    machine_present = maas_observed = False
                    disks_erased = None
                    maas_error = str(err)[:300] or f"MAAS did not answer ({type(err).__name__})"
        live = await self._live_allocations(run.node_id)
        return Observation(
            node_status=node_status,
            machine_present=machine_present,
            maas_status=state.maas_status,
            power_state=state.power_state,
            live_allocations=len(live),
            state=state,
            maas_observed=maas_observed,
            maas_error=maas_error,
            disks_erased=disks_erased,
        )

    @activity.defn(name="decommission.compensate")
    async def compensate(self, input: StageInput) -> StageResult:
        """Cancel (docs/lifecycles/decommission.md#actions: stop and compensate where possible).
        MAAS is never touched back. The node is not left in draining/removing without an owner:
        removing → retired; draining → offline ("operator recovery stops short of retirement",
        §3.3), from where the liveness loop returns it to active — unless the agent's node.drain ran
        (its marker refuses tenant work) or MAAS already changed the machine, in which case it goes
        on to quarantined for an operator. Whether MAAS changed it is what MAAS shows, not what the
        run last believed (a release whose stage failed may have gone through)."""
        run = Run(input=input, stage=Stage.DISABLE_NODE)
        notes: list[str] = []
        agent_drained = any(f.get("kind") == "agent_drained" for f in input.state.followups)
        maas_changed = input.state.released_in_maas or await self._maas_changed(run)
        async with self.deps.sessions() as session, session.begin():
            current = await session.scalar(select(Node.status).where(Node.id == run.node_id))
            if current == NodeStatus.REMOVING:
                await transition_node(
                    session,
                    run.node_id,
                    [NodeStatus.REMOVING],
                    NodeStatus.RETIRED,
                    actor=ACTOR,
                    reason="decommission cancelled",
                )
                notes.append("removing -> retired")
            elif current == NodeStatus.DRAINING:
                path = [NodeStatus.DRAINING, NodeStatus.OFFLINE]
                if agent_drained or maas_changed:
                    path.append(NodeStatus.QUARANTINED)
                moved = await transition_path(
                    session, run.node_id, path, actor=ACTOR, reason="decommission cancelled"
                )
                notes.append(f"draining -> {moved.current}")
            await read_model.add_event(
                session,
                run.decommission_id,
                stage="cancel",
                attempt=input.attempt,
                status=EventStatus.COMPENSATED.value,
                message="; ".join(notes) or "nothing to compensate",
            )
        return StageResult(state=input.state, message="; ".join(notes) or "nothing to compensate")

    async def _maas_changed(self, run: Run) -> bool:
        """Whether MAAS may hold the machine other than deployed because of this run. Without a
        loaded site no MAAS stage can have run (each needs it): unchanged, known. With one,
        MAAS is asked; a machine not Deployed, gone, or that cannot be seen counts as changed."""
        state = run.state
        if not state.maas_managed or run.input.site is None or not state.system_id:
            return False
        try:
            async with asyncio.timeout(MAAS_TIMEOUT_SECONDS), self.maas(run) as maas:
                machine = await maas.get_machine(state.system_id)
        except (ClassifiedError, SecretStoreError, TimeoutError):
            return True
        observe_machine(state, machine)
        return machine.status != S.DEPLOYED
