"""The MAAS-side decommission stages (docs/lifecycles/decommission.md#reimage,
docs/lifecycles/decommission.md#full-decommission): release with the requested erase mode and wait
for Ready (with the site's no-erase fallback when an erase fails), power off and wait for off, and
the optional removal of the MAAS record.

Every call here is destructive on the machine, so each first re-checks that the node is not
protected, and each is status-aware: a machine already Ready is not released again, one
already off is not powered off again. Where the disks went is recorded by disk_disposition.
"""

from __future__ import annotations

from temporalio import activity

from activities.decommission.disk_disposition import (
    disks_erased_since_deployment,
    record_disk_disposition,
    release_disk_disposition,
)
from activities.decommission.stage_runtime import Run, S, StageRuntime, ambiguity
from activities.maas.client import MaasClient
from activities.maas.errors import MaasError, MaasNotFound
from activities.maas.types import EraseMode, Machine, PowerState
from activities.onboarding.stage_errors import StageError
from contracts.decommission import (
    REDEPLOY_RELEASE_NOTE,
    DecommissionState,
    Erase,
    Stage,
    StageInput,
    StageResult,
    operator_disk_disposition,
)
from core.failures import FailureClass

_ERASE = {
    Erase.NONE: EraseMode.NONE,
    Erase.QUICK: EraseMode.QUICK,
    Erase.SECURE: EraseMode.SECURE,
    Erase.STANDARD: EraseMode.STANDARD,
}
# MAAS will release these (maas-api-notes: op=release).
RELEASABLE = frozenset(
    {
        S.ALLOCATED,
        S.RESERVED,
        S.BROKEN,
        S.DEPLOYED,
        S.FAILED_DEPLOYMENT,
        S.FAILED_DISK_ERASING,
        S.FAILED_RELEASING,
    }
)
RELEASE_IN_PROGRESS = frozenset({S.RELEASING, S.DISK_ERASING})


class MaasReleaseStages(StageRuntime):
    @activity.defn(name="decommission.release_maas_node")
    async def release_maas_node(self, input: StageInput) -> StageResult:
        """§5.3/§5.4 ReleaseMaasNode: release with the requested erase mode and wait for Ready.
        An erase that fails (Failed disk erasing) is retried as a no-erase release only when
        the site policy allows it (release_fallback_no_erase); the fallback is recorded as a
        follow-up, since the disks were not wiped. Not converging is manual intervention."""
        async with self.stage(input, Stage.RELEASE_MAAS_NODE) as run:
            if not run.state.maas_managed:
                run.skipped("the node is not MAAS-managed")
            elif run.state.machine_absent:
                run.state.released_in_maas = True
                # Where an operator recorded the disks went (record_disk_disposition) stands.
                disposition = operator_disk_disposition(
                    run.state.followups
                ) or record_disk_disposition(
                    run.state,
                    "not_erased",
                    reason="machine_absent",
                    detail="the machine is gone from MAAS (adopted): this job erased nothing",
                )
                run.skipped("the machine is gone from MAAS (adopted)", disk_disposition=disposition)
            else:
                await self._refuse_if_protected(run, "MAAS release (and erase)")
                async with self.maas(run) as maas:
                    await self._release(run, maas)
        assert run.result is not None
        return run.result

    async def _release(self, run: Run, maas: MaasClient) -> None:
        state, site = run.state, run.input.site
        assert site is not None
        assert state.system_id is not None
        erase = Erase(run.input.decommission.erase)
        # A reimage's redeploy after Failed deployment releases without an erase (the note).
        redeploy = run.input.note == REDEPLOY_RELEASE_NOTE
        if redeploy:
            erase = Erase.NONE
        machine = await self._machine(run, maas)
        if machine.status == S.READY and state.released_in_maas:
            run.skipped("already Ready")
            return
        if machine.status == S.READY:
            # Released by someone else while we drained (or by an attempt of ours whose answer
            # was lost): adopt, but say so, and only with the erase asked for seen done.
            if erase != Erase.NONE and not await disks_erased_since_deployment(
                maas, state.system_id
            ):
                raise ambiguity(
                    "erase_not_observed",
                    f"the machine is Ready but MAAS shows no disk erase since it was deployed; "
                    f"the requested {erase.value} erase was not seen done",
                    maas_status=machine.status.label,
                    erase=erase.value,
                )
            state.released_in_maas = True
            disposition = await release_disk_disposition(run, maas, erase, out_of_band=True)
            run.done(
                "the machine was already Ready (released out of band); adopted",
                disk_disposition=disposition,
            )
            return
        if machine.status == S.DEPLOYING:
            machine = await maas.abort(state.system_id, comment="gpucloud decommission")
        if machine.status in RELEASABLE:
            mode = erase
            if (
                machine.status == S.FAILED_DISK_ERASING
                and erase != Erase.NONE
                and site.policy.release_fallback_no_erase
            ):
                mode = Erase.NONE  # an earlier erase failed: the site allows the fallback
                self._note_fallback(state, erase)
            await maas.release(
                state.system_id,
                erase=_ERASE[mode],
                comment=f"gpucloud decommission {run.input.decommission.decommission_id}",
            )
            if not redeploy:  # erase_used stays what this job's release of the OS used
                state.erase_used = mode.value
        elif machine.status not in RELEASE_IN_PROGRESS:
            raise ambiguity(
                "maas_changed_out_of_band",
                f"the machine is {machine.status.label}; it cannot be released from there",
                maas_status=machine.status.label,
            )
        ready = await self._wait_ready(run, maas)
        if ready is None:
            current = state.maas_status
            if current == S.FAILED_DISK_ERASING.label:
                if not site.policy.release_fallback_no_erase:
                    raise StageError(
                        FailureClass.STATE_AMBIGUITY,
                        "erase_failed",
                        "disk erasing failed and the site does not allow a no-erase release",
                        details={"erase": erase.value, "maas_status": state.maas_status},
                        non_retryable=True,
                    )
                await maas.release(
                    state.system_id,
                    erase=EraseMode.NONE,
                    comment="gpucloud decommission: erase failed, releasing without erase",
                )
                state.erase_used = Erase.NONE.value
                self._note_fallback(state, erase)
                ready = await self._wait_ready(run, maas)
            if ready is None:
                code = "release_failed" if state.maas_status != S.RELEASING.label else ""
                raise StageError(
                    FailureClass.STATE_AMBIGUITY,
                    code or "release_timeout",
                    f"the machine did not reach Ready (it is {state.maas_status})",
                    details={"maas_status": state.maas_status},
                    non_retryable=True,
                )
        state.released_in_maas = True
        if redeploy:
            run.done("released back to Ready for a redeploy (no erase)", erase=Erase.NONE.value)
            return
        note = " (erase fell back to none)" if state.erase_fell_back else ""
        disposition = await release_disk_disposition(run, maas, erase)
        run.done(
            f"released to Ready, erase {state.erase_used}{note}; disks "
            f"{disposition['disposition'].replace('_', ' ')}",
            erase=state.erase_used,
            disk_disposition=disposition,
        )

    @staticmethod
    def _note_fallback(state: DecommissionState, erase: Erase) -> None:
        """The disks were not wiped: a follow-up for whoever handles the hardware next."""
        state.erase_fell_back = True
        if not any(f.get("kind") == "erase_fallback" for f in state.followups):
            state.followups.append(
                {
                    "kind": "erase_fallback",
                    "message": f"{erase.value} erase failed; released without erasing",
                }
            )

    async def _wait_ready(self, run: Run, maas: MaasClient) -> Machine | None:
        """Ready, or None when the release stopped in a failure state or timed out."""
        site = run.input.site
        assert site is not None
        stopped: list[bool] = [False]

        async def check() -> Machine | None:
            machine = await self._machine(run, maas)
            if machine.status == S.READY:
                return machine
            if machine.status in (S.FAILED_DISK_ERASING, S.FAILED_RELEASING, S.BROKEN):
                stopped[0] = True
                return machine
            if machine.status in RELEASE_IN_PROGRESS:
                return None
            raise ambiguity(
                "maas_changed_out_of_band",
                f"the machine went {machine.status.label} while releasing",
                maas_status=machine.status.label,
            )

        found: Machine | None = await self._poll(run, site.policy.deploy_timeout_seconds, check)
        if found is None or stopped[0]:
            return None
        return found

    @activity.defn(name="decommission.power_off_maas_node")
    async def power_off_maas_node(self, input: StageInput) -> StageResult:
        """§5.4 PowerOffMaasNode, and wait until MAAS reports it off. Not converging is manual
        intervention: full decommission is never reported complete with the machine on."""
        async with self.stage(input, Stage.POWER_OFF_MAAS_NODE) as run:
            if not run.state.maas_managed:
                run.skipped("the node is not MAAS-managed")
            elif run.state.machine_absent:
                run.skipped("the machine is gone from MAAS (adopted)")
            else:
                await self._refuse_if_protected(run, "MAAS power-off")
                async with self.maas(run) as maas:
                    machine = await self._machine(run, maas)
                    if machine.power_state == PowerState.OFF:
                        run.state.powered_off = True
                        run.skipped("already off")
                    else:
                        answer = await maas.power_off(
                            machine.system_id, comment="gpucloud full decommission"
                        )
                        if answer is None:
                            raise StageError(
                                FailureClass.BMC_POWER_FAILURE,
                                "power_off_failed",
                                "MAAS cannot control this machine's power",
                                non_retryable=True,
                            )

                        async def off() -> bool | None:
                            current = await self._machine(run, maas)
                            return True if current.power_state == PowerState.OFF else None

                        timeout = input.decommission.policy.power_off_timeout_seconds
                        if await self._poll(run, timeout, off) is None:
                            raise StageError(
                                FailureClass.BMC_POWER_FAILURE,
                                "power_off_failed",
                                f"the machine is still {run.state.power_state} after power-off",
                                non_retryable=True,
                            )
                        run.state.powered_off = True
                        run.done("powered off")
        assert run.result is not None
        return run.result

    @activity.defn(name="decommission.remove_maas_record")
    async def remove_maas_record(self, input: StageInput) -> StageResult:
        """§5.4 RemoveMaasRecord, only when the request asks (default: the record is kept for
        MAAS-side audit). Best effort: a failed delete leaves the record and a follow-up."""
        async with self.stage(input, Stage.REMOVE_MAAS_RECORD) as run:
            if not run.state.maas_managed:
                run.skipped("the node is not MAAS-managed")
            elif run.state.machine_absent:
                run.skipped("the machine is already gone from MAAS")
            elif not input.decommission.remove_maas_record:
                run.skipped("kept in MAAS (remove_maas_record is false)")
            else:
                assert run.state.system_id is not None
                await self._refuse_if_protected(run, "MAAS delete")
                try:
                    async with self.maas(run) as maas:
                        await maas.delete_machine(run.state.system_id)
                    run.state.maas_status = None
                    run.done(f"machine {run.state.system_id} deleted from MAAS")
                except MaasNotFound:
                    run.skipped("the machine is already gone from MAAS")
                except MaasError as err:
                    run.state.followups.append(
                        {"kind": "maas_record_retained", "message": err.message[:300]}
                    )
                    run.done("MAAS delete failed: the record stays (follow-up recorded)")
        assert run.result is not None
        return run.result
