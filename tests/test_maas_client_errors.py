"""MaasClient's failures against the MAAS simulator: 5xx and slow answers (retried only where the
request is safe to repeat), unreachable MAAS, machines deleted behind its back, the mapping of
MAAS's status codes to the docs/runbooks/index.md taxonomy, and the API key and BMC passwords never
showing up in exceptions or logs."""

from __future__ import annotations

import logging
import socket
import traceback
from typing import Any

import httpx
import pytest

from activities.maas.client import MaasClient
from activities.maas.errors import (
    MaasAuthError,
    MaasBmcError,
    MaasCapabilityMissing,
    MaasError,
    MaasNotFound,
    MaasStateConflict,
    MaasUnavailable,
    MaasValidationError,
)
from activities.maas.transport import classify
from activities.maas.types import EraseMode, IpmiPowerParameters, MachineStatus
from core.failures import FailureClass, to_application_error
from tests.maas_fixtures import MaasSim
from tests.test_maas_client import client, system_id_of, wait_for


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """These tests talk to the MAAS simulator only: no database to clean."""


def answers(counters: dict[str, Any], op: str) -> dict[str, int]:
    return dict(counters["answers"].get(op, {}))


# ---------------------------------------------------------------------------- 5xx


async def test_reads_are_retried_through_transient_5xx(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("http_error", op="machines.read", times=2)
    async with client(maas_sim) as maas:
        machines = await maas.list_machines()
    assert {m.hostname for m in machines} == {"node-a", "node-b"}
    assert answers(await maas_sim.counters(), "machines.read") == {"503": 2, "200": 1}


async def test_reads_give_up_after_max_attempts_as_upstream_transient(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("http_error", op="version.read", status=502)
    async with client(maas_sim, max_attempts=4) as maas:
        with pytest.raises(MaasUnavailable) as info:
            await maas.version()
    error = info.value
    assert (error.status_code, error.failure_class) == (502, FailureClass.UPSTREAM_TRANSIENT)
    assert not error.maybe_applied  # a GET changes nothing
    assert not to_application_error(error).non_retryable  # the activity may retry, bounded
    assert answers(await maas_sim.counters(), "version.read") == {"502": 4}


async def test_a_deploy_whose_answer_is_lost_is_not_repeated(maas_sim: MaasSim) -> None:
    await maas_sim.set_fault("node-a", "http_error", op="machine.deploy", times=1, applied=True)
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        with pytest.raises(MaasUnavailable) as info:
            await maas.deploy(system_id, distro_series="noble")
        assert info.value.maybe_applied  # and it was: refresh before deciding what next
        machine = await maas.get_machine(system_id)
    assert machine.status in (MachineStatus.DEPLOYING, MachineStatus.DEPLOYED)
    assert answers(await maas_sim.counters(), "machine.deploy") == {"503": 1}


async def test_a_release_without_erase_is_safe_to_repeat(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble")
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        await maas_sim.set_fault(system_id, "http_error", op="machine.release", times=1,
                                 applied=True)  # fmt: skip
        released = await maas.release(system_id)  # Releasing/Ready again: a no-op success
    assert released.status in (MachineStatus.RELEASING, MachineStatus.READY)
    assert answers(await maas_sim.counters(), "machine.release") == {"503": 1, "200": 1}


async def test_a_release_with_erase_is_not_repeated(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble")
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        await maas_sim.set_fault(system_id, "http_error", op="machine.release", times=1)
        with pytest.raises(MaasUnavailable):
            await maas.release(system_id, erase=EraseMode.SECURE)
    assert answers(await maas_sim.counters(), "machine.release") == {"503": 1}


async def test_accept_is_safe_to_repeat(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("http_error", op="machines.accept", times=1, applied=True)
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-b")
        accepted = await maas.accept_machines(system_id)
    # The lost answer's accept happened; the repeat found it Commissioning and skipped it.
    assert accepted == []
    assert answers(await maas_sim.counters(), "machines.accept") == {"503": 1, "200": 1}
    assert (await maas_sim.machine(system_id))["status_name"] in ("Commissioning", "Testing")


# ---------------------------------------------------------------------------- timeouts


async def test_slow_reads_time_out_and_are_retried(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("slow", delay=0.6, op="machines.read", times=1)
    async with client(maas_sim, timeout=0.2) as maas:
        machines = await maas.list_machines()
    assert len(machines) == 2
    assert (await maas_sim.counters())["ops"]["machines.read"] == 2  # the first went unanswered


async def test_a_read_that_stays_slow_is_upstream_transient(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("slow", delay=0.6, op="rackcontrollers.read")
    async with client(maas_sim, timeout=0.2, max_attempts=2) as maas:
        with pytest.raises(MaasUnavailable, match="timed out") as info:
            await maas.rack_controllers()
    assert info.value.failure_class == FailureClass.UPSTREAM_TRANSIENT
    assert info.value.status_code is None


async def test_a_slow_post_times_out_once_and_may_have_applied(maas_sim: MaasSim) -> None:
    await maas_sim.add_request_fault("slow", delay=0.6, op="machine.commission", times=1)
    async with client(maas_sim, timeout=0.2) as maas:
        system_id = await system_id_of(maas, "node-a")
        with pytest.raises(MaasUnavailable, match="timed out") as info:
            await maas.commission(system_id)
    assert info.value.maybe_applied
    assert info.value.failure_class == FailureClass.UPSTREAM_TRANSIENT
    counters = await maas_sim.counters()
    assert counters["ops"]["machine.commission"] == 1


async def test_an_unreachable_maas_is_upstream_transient() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with MaasClient(f"http://127.0.0.1:{port}/MAAS", "a:b:c", backoff_initial=0.01) as maas:
        with pytest.raises(MaasUnavailable, match="unreachable") as read:
            await maas.version()
        with pytest.raises(MaasUnavailable) as write:
            await maas.deploy("abc123", distro_series="noble")
    assert read.value.failure_class == FailureClass.UPSTREAM_TRANSIENT
    assert not write.value.maybe_applied  # never connected: nothing was sent


# ---------------------------------------------------------------------------- drift


async def test_a_machine_deleted_behind_our_back_is_state_ambiguity(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas_sim.delete(system_id)
        with pytest.raises(MaasNotFound) as info:
            await maas.get_machine(system_id)
    assert info.value.status_code == 404
    assert info.value.failure_class == FailureClass.STATE_AMBIGUITY
    assert to_application_error(info.value).non_retryable
    assert answers(await maas_sim.counters(), "machine.read") == {"404": 1}


async def test_a_release_behind_our_back_shows_up_as_observed_state(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble")
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        await maas_sim.release(system_id)
        released = await wait_for(maas, system_id, MachineStatus.READY)
        assert released.owner is None
        with pytest.raises(MaasStateConflict) as info:
            await maas.power_on(system_id)
    assert info.value.failure_class == FailureClass.STATE_AMBIGUITY


# ---------------------------------------------------------------------------- status mapping


def _answer(status: int, body: str, content_type: str = "text/plain") -> httpx.Response:
    return httpx.Response(status, text=body, headers={"content-type": content_type})


@pytest.mark.parametrize(
    ("response", "error_type", "failure_class"),
    [
        (_answer(401, "Authorization Error: Invalid API key."), MaasAuthError,
         FailureClass.SITE_CAPABILITY_MISSING),
        (_answer(403, ""), MaasAuthError, FailureClass.SITE_CAPABILITY_MISSING),
        (_answer(500, "Internal Server Error"), MaasUnavailable, FailureClass.UPSTREAM_TRANSIENT),
        (_answer(503, "Service Unavailable"), MaasUnavailable, FailureClass.UPSTREAM_TRANSIENT),
        (_answer(429, "Too Many Requests"), MaasUnavailable, FailureClass.UPSTREAM_TRANSIENT),
        (_answer(503, "Failed talking to node's BMC: Failed to power abc123."), MaasBmcError,
         FailureClass.BMC_POWER_FAILURE),
        (_answer(503, "Could not contact node's BMC: timed out"), MaasBmcError,
         FailureClass.BMC_POWER_FAILURE),
        (_answer(404, "Unknown API endpoint: /MAAS/api/2.0/nope/."), MaasCapabilityMissing,
         FailureClass.SITE_CAPABILITY_MISSING),
        (_answer(400, "Unrecognised signature: method=POST op=foo"), MaasCapabilityMissing,
         FailureClass.SITE_CAPABILITY_MISSING),
        (_answer(405, ""), MaasCapabilityMissing, FailureClass.SITE_CAPABILITY_MISSING),
        (_answer(404, "<html>Not Found</html>", "text/html"), MaasCapabilityMissing,
         FailureClass.SITE_CAPABILITY_MISSING),
        (_answer(404, "No Machine matches the given query."), MaasNotFound,
         FailureClass.STATE_AMBIGUITY),
        (_answer(409, "Can't deploy a machine that is in the 'New' state"), MaasStateConflict,
         FailureClass.STATE_AMBIGUITY),
        (_answer(400, '{"__all__": ["Commission is not available because of the current state '
                      'of the node."]}', "application/json"), MaasStateConflict,
         FailureClass.STATE_AMBIGUITY),
        (_answer(400, '{"distro_series": ["\'x\' is not a valid distro_series."]}',
                 "application/json"), MaasValidationError, FailureClass.INPUT_CONFIG_ERROR),
        (_answer(400, "Requested number of events 1001 is greater than limit: 1000"),
         MaasValidationError, FailureClass.INPUT_CONFIG_ERROR),
    ],
)  # fmt: skip
def test_maas_answers_map_to_the_failure_taxonomy(
    response: httpx.Response, error_type: type[MaasError], failure_class: FailureClass
) -> None:
    error = classify(response, "POST", "POST machines/abc123/?op=deploy", ())
    assert type(error) is error_type
    assert error.failure_class == failure_class
    assert error.status_code == response.status_code
    assert "POST machines/abc123/?op=deploy" in str(error)
    application = to_application_error(error)
    assert application.type == failure_class.value


# ---------------------------------------------------------------------------- secrets


def _everything_about(error: BaseException) -> str:
    """What could end up in logs or Temporal history: message, repr, attributes, the chain."""
    return "\n".join(
        [
            str(error),
            repr(error),
            repr(vars(error)),
            "".join(traceback.format_exception(error)),
            str(to_application_error(error)) if isinstance(error, MaasError) else "",
        ]
    )


async def test_the_api_key_and_bmc_passwords_never_reach_errors_or_logs(
    maas_sim: MaasSim, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, token, secret = maas_sim.api_key.split(":")
    bmc_password = "bmc-pass-5f2e9a"
    secrets = [consumer, token, secret, bmc_password]
    caplog.set_level(logging.DEBUG)  # httpx, httpcore and ours, at their chattiest
    errors: list[BaseException] = []
    await maas_sim.add_request_fault("http_error", op="machines.read", times=2)
    async with client(maas_sim) as maas:
        await maas.list_machines()  # two retries logged on the way
        power = IpmiPowerParameters(power_address="10.0.0.1", power_pass=bmc_password)
        with pytest.raises(MaasValidationError) as duplicate:
            await maas.create_machine(hostname="node-a", power=power)
        errors.append(duplicate.value)
    for wrong in (f"{consumer}:{token}:wrong", f"{consumer}:other{token}:{secret}"):
        async with MaasClient(maas_sim.base_url, wrong) as maas:
            with pytest.raises(MaasAuthError) as refused:
                await maas.list_machines()
            errors.append(refused.value)
    with pytest.raises(ValueError, match="MAAS API key") as malformed:
        MaasClient(maas_sim.base_url, f"{consumer}:{token}")
    errors.append(malformed.value)
    # MAAS's "Invalid signature" body quotes the valid secret: it must be withheld.
    assert "[withheld]" in str(errors[1])
    assert "MAAS GET machines/ answered 503" in caplog.text
    for error in errors:
        text = _everything_about(error)
        for value in secrets:
            assert value not in text, (type(error).__name__, value)
    for value in secrets:
        assert value not in caplog.text
    assert "calvin" not in repr(IpmiPowerParameters(power_address="x", power_pass="calvin"))
    assert secret not in repr(MaasClient(maas_sim.base_url, maas_sim.api_key))
