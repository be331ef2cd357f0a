"""MaasClient against the MAAS simulator: block devices and the flat layout on a chosen boot disk,
interfaces and their subnet links, subnets, and the events query."""

from __future__ import annotations

import pytest

from activities.maas.client import MaasClient
from activities.maas.errors import MaasNotFound, MaasStateConflict, MaasValidationError
from activities.maas.types import LinkMode, MachineStatus
from core.failures import FailureClass
from tests.maas_fixtures import MaasSim
from tests.test_maas_client import client, system_id_of, wait_for


@pytest.fixture(autouse=True)
def clean_db() -> None:
    """These tests talk to the MAAS simulator only: no database to clean."""


async def test_block_devices_as_typed_values(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        disks = {d.name: d for d in await maas.list_block_devices(system_id)}
    boss = disks["sda"]
    assert boss.model == "Dell BOSS-N1"
    assert "BOSS" in boss.id_path
    assert boss.type == "physical"
    assert boss.size == 480103981056
    assert [p.mount_point for p in boss.partitions] == ["/boot/efi", "/"]
    assert disks["nvme0n1"].used_for == "Unused"
    assert disks["nvme0n1"].partitions == ()


async def test_boot_disk_is_chosen_before_the_flat_layout(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        disks = {d.name: d for d in await maas.list_block_devices(system_id)}
        nvme = disks["nvme0n1"]
        machine = await maas.apply_flat_layout(system_id, nvme.id)
        assert machine.boot_disk_id == nvme.id
        laid_out = {d.name: d for d in machine.block_devices}
        assert [p.mount_point for p in laid_out["nvme0n1"].partitions] == ["/boot/efi", "/"]
        assert laid_out["sda"].partitions == ()
        with pytest.raises(MaasNotFound) as unknown:
            await maas.set_boot_disk(system_id, 9999)
        assert unknown.value.failure_class == FailureClass.STATE_AMBIGUITY
        await maas.deploy(system_id, distro_series="noble")
        with pytest.raises(MaasStateConflict) as not_ready:
            await maas.set_storage_layout(system_id)
    assert not_ready.value.status_code == 409
    counters = await maas_sim.counters()
    assert counters["ops"]["blockdevice.set_boot_disk"] == 2
    assert counters["ops"]["machine.set_storage_layout"] == 2


async def test_unlink_then_link_the_pxe_interface_auto(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        interfaces = {i.name: i for i in await maas.list_interfaces(system_id)}
        pxe = interfaces["eno8303"]
        assert pxe.vlan is not None
        assert pxe.vlan.vid == 46
        [auto] = pxe.links
        assert (auto.mode, auto.ip_address) == (LinkMode.AUTO, None)  # no address before deploy
        assert auto.subnet is not None
        assert auto.subnet.cidr == "10.176.46.0/24"
        assert pxe.subnet_links() == (auto,)

        unlinked = await maas.unlink_subnet(system_id, pxe.id, auto.id)
        assert [link.mode for link in unlinked.links] == [LinkMode.LINK_UP]
        assert unlinked.subnet_links() == ()
        with pytest.raises(MaasValidationError) as no_network:
            await maas.deploy(system_id, distro_series="noble")
        assert set(no_network.value.field_errors) == {"network"}
        with pytest.raises(MaasValidationError) as bad_link:
            await maas.unlink_subnet(system_id, pxe.id, 999)
        assert set(bad_link.value.field_errors) == {"id"}

        dhcp = await maas.link_subnet(system_id, pxe.id, mode=LinkMode.DHCP, subnet=auto.subnet.id)
        [dhcp_link] = dhcp.subnet_links()
        assert dhcp_link.mode == LinkMode.DHCP
        await maas.unlink_subnet(system_id, pxe.id, dhcp_link.id)
        relinked = await maas.link_subnet(
            system_id, pxe.id, mode=LinkMode.AUTO, subnet="cidr:10.176.46.0/24"
        )
        [link] = relinked.subnet_links()
        assert link.mode == LinkMode.AUTO
        assert link.subnet is not None
        assert link.subnet.name == "pxe"
        deploying = await maas.deploy(system_id, distro_series="noble")
        assert deploying.status == MachineStatus.DEPLOYING
    with pytest.raises(ValueError, match="needs a subnet"):
        await maas.link_subnet(system_id, pxe.id, mode=LinkMode.STATIC)


async def test_a_static_link_on_a_new_roce_subnet(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        roce = next(i for i in await maas.list_interfaces(system_id) if i.name == "ens1f0np0")
        assert await maas.find_subnet_by_cidr("172.30.9.60/31") is None
        subnet = await maas.create_subnet("172.30.9.60/31", name="roce-c07u43-a")
        assert await maas.find_subnet_by_cidr("172.30.9.60/31") == subnet
        linked = await maas.link_subnet(
            system_id, roce.id, mode=LinkMode.STATIC, subnet=subnet.id, ip_address="172.30.9.61"
        )
        [static] = linked.subnet_links()
        assert (static.mode, static.ip_address) == (LinkMode.STATIC, "172.30.9.61")
        machine = await maas.get_machine(system_id)
        assert "172.30.9.61" in machine.ip_addresses
        await maas_sim.set_status(system_id, "Deployed")
        with pytest.raises(MaasStateConflict):
            await maas.link_subnet(system_id, roce.id, mode=LinkMode.DHCP)
    counters = await maas_sim.counters()
    assert sum(counters["answers"]["interface.link_subnet"].values()) == 2  # never retried


async def test_subnets_list_get_and_create(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        [pxe] = await maas.list_subnets()
        assert (pxe.name, pxe.cidr, pxe.gateway_ip) == ("pxe", "10.176.46.0/24", "10.176.46.1")
        assert pxe.vlan is not None
        assert pxe.vlan.vid == 46
        assert await maas.get_subnet(pxe.id) == pxe
        assert await maas.get_subnet("name:pxe") == pxe
        with pytest.raises(ValueError, match="no '/'"):
            await maas.get_subnet("cidr:10.176.46.0/24")
        created = await maas.create_subnet(
            "10.176.47.0/24",
            name="pxe-b",
            vlan_id=pxe.vlan.id,
            gateway_ip="10.176.47.1",
            dns_servers=["1.1.1.1", "8.8.8.8"],
        )
        assert created.dns_servers == ("1.1.1.1", "8.8.8.8")
        assert created.vlan is not None
        assert created.vlan.vid == 46
        with pytest.raises(MaasValidationError) as duplicate:
            await maas.create_subnet("10.176.46.0/24")
        assert duplicate.value.field_errors == {"cidr": ("Subnet with this Cidr already exists.",)}
        with pytest.raises(MaasNotFound):
            await maas.get_subnet(999)


async def test_events_newest_first_with_levels(maas_sim: MaasSim) -> None:
    async with client(maas_sim) as maas:
        system_id = await system_id_of(maas, "node-a")
        await maas.deploy(system_id, distro_series="noble")
        await wait_for(maas, system_id, MachineStatus.DEPLOYED)
        info = await maas.query_events(system_id=system_id)
        debug = await maas.query_events(system_id=system_id, level="DEBUG", limit=1000)
        assert info
        assert {e.level for e in info} <= {"INFO", "WARNING", "ERROR", "CRITICAL"}
        assert len(debug) > len(info)
        assert [e.id for e in debug] == sorted((e.id for e in debug), reverse=True)
        changes = [e.description for e in debug if e.type == "Node changed status"]
        assert changes[0] == "From 'Deploying' to 'Deployed'"
        assert all(e.system_id == system_id and e.created is not None for e in debug)
        older = await maas.query_events(system_id=system_id, level="DEBUG", before=debug[2].id)
        assert [e.id for e in older] == [e.id for e in debug[3:]]
        by_host = await maas.query_events(hostname="node-a", limit=2)
        assert len(by_host) == 2
        with pytest.raises(ValueError, match="limit"):
            await maas.query_events(limit=1001)
        with pytest.raises(MaasValidationError):
            await maas.query_events(level="CHATTY")


async def test_using_the_client_outside_its_context_is_a_programming_error() -> None:
    maas = MaasClient("http://127.0.0.1:9/MAAS", "a:b:c")
    with pytest.raises(RuntimeError, match="async with"):
        await maas.version()
    with pytest.raises(ValueError, match="system_id"):
        async with maas:
            await maas.get_machine("../users")
