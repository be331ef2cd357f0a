"""MaasClient.delete_machine (docs/lifecycles/decommission.md#full-decommission RemoveMaasRecord)
against the MAAS simulator: the record goes, the hardware stays, and a second delete is MaasNotFound
(callers treat it as done)."""

from __future__ import annotations

import pytest

from activities.maas.client import MaasClient
from activities.maas.errors import MaasNotFound
from tests.maas_fixtures import MaasSim, sim_machine, sim_scenario


@pytest.mark.maas_scenario(sim_scenario(sim_machine("del-a", "10.176.19.10")))
async def test_delete_machine_removes_the_record_once(maas_sim: MaasSim) -> None:
    async with MaasClient(maas_sim.api_url, maas_sim.api_key) as maas:
        (machine,) = await maas.list_machines(hostnames=["del-a"])
        await maas.delete_machine(machine.system_id)
        assert await maas.list_machines(hostnames=["del-a"]) == []
        with pytest.raises(MaasNotFound):
            await maas.delete_machine(machine.system_id)
    counters = await maas_sim.counters()
    assert counters["machines"][machine.system_id].get("machine.delete") == 2
