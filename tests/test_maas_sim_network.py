"""Interfaces, links, subnets, rack controllers and the events query of the simulated region."""

from __future__ import annotations

from typing import Any

from tests.maas_fixtures import MaasSim


async def _ids(sim: MaasSim, ref: str, interface: str = "eno8303") -> tuple[str, dict[str, Any]]:
    system_id = str((await sim.machine(ref))["system_id"])
    async with sim.client() as maas:
        interfaces = (await maas.get(f"nodes/{system_id}/interfaces/")).json()
    return system_id, next(i for i in interfaces if i["name"] == interface)


async def test_interfaces_list_and_read(maas_sim: MaasSim) -> None:
    system_id, pxe = await _ids(maas_sim, "node-a")
    assert pxe["type"] == "physical"
    assert pxe["vlan"]["vid"] == 46
    assert [link["mode"] for link in pxe["links"]] == ["auto"]
    async with maas_sim.client() as maas:
        one = (await maas.get(f"nodes/{system_id}/interfaces/{pxe['id']}/")).json()
        assert one == pxe
        missing = await maas.get(f"nodes/{system_id}/interfaces/4242/")
        assert (missing.status_code, missing.text) == (404, "No Interface matches the given query.")
        no_node = await maas.get("nodes/zzzzzz/interfaces/")
        assert (no_node.status_code, no_node.text) == (404, "No Node matches the given query.")


async def test_unlink_then_link_pxe_interface_auto(maas_sim: MaasSim) -> None:
    system_id, pxe = await _ids(maas_sim, "node-a")
    url = f"nodes/{system_id}/interfaces/{pxe['id']}/"
    async with maas_sim.client() as maas:
        link_id = pxe["links"][0]["id"]
        bad = await maas.post(url, params={"op": "unlink_subnet"}, data={"id": "999"})
        assert bad.status_code == 400
        assert bad.json() == {
            "id": [f"'999' is not a valid id.  It should be one of: '{link_id}'."]
        }
        unlinked = await maas.post(url, params={"op": "unlink_subnet"}, data={"id": link_id})
        assert [link["mode"] for link in unlinked.json()["links"]] == ["link_up"]
        no_net = await maas.post(f"machines/{system_id}/?op=deploy")
        assert no_net.json() == {"network": ["Node must be configured to use a network"]}
        no_subnet = await maas.post(url, params={"op": "link_subnet"}, data={"mode": "AUTO"})
        assert no_subnet.json() == {"subnet": ["This field is required."]}
        bad_mode = await maas.post(url, params={"op": "link_subnet"}, data={"mode": "magic"})
        assert bad_mode.status_code == 400
        assert "mode" in bad_mode.json()
        linked = await maas.post(
            url,
            params={"op": "link_subnet"},
            data={"mode": "AUTO", "subnet": "cidr:10.176.46.0/24"},
        )
        assert linked.status_code == 200, linked.text
        links = linked.json()["links"]
        assert [(lk["mode"], lk["subnet"]["cidr"]) for lk in links] == [("auto", "10.176.46.0/24")]
        assert "ip_address" not in links[0]


async def test_static_links_on_a_roce_subnet(maas_sim: MaasSim) -> None:
    system_id, roce = await _ids(maas_sim, "node-a", "ens1f0np0")
    url = f"nodes/{system_id}/interfaces/{roce['id']}/"
    async with maas_sim.client() as maas:
        subnet = (
            await maas.post("subnets/", data={"cidr": "10.200.0.0/31", "name": "roce-a"})
        ).json()
        assert subnet["vlan"]["vid"] == 0
        outside = await maas.post(
            url, params={"op": "link_subnet"},
            data={"mode": "STATIC", "subnet": subnet["id"], "ip_address": "10.201.0.1"},
        )  # fmt: skip
        assert outside.json() == {
            "ip_address": ["IP address is not in the given subnet '10.200.0.0/31'."]
        }
        linked = await maas.post(
            url, params={"op": "link_subnet"},
            data={"mode": "STATIC", "subnet": subnet["id"], "ip_address": "10.200.0.1"},
        )  # fmt: skip
        assert linked.status_code == 200, linked.text
        static = [lk for lk in linked.json()["links"] if lk["mode"] == "static"]
        assert [(lk["ip_address"], lk["subnet"]["name"]) for lk in static] == [
            ("10.200.0.1", "roce-a")
        ]
        # A subnet on another VLAN is not a choice without force.
        pxe_subnet = await maas.get("subnets/name:pxe/")
        other_vlan = await maas.post(
            url,
            params={"op": "link_subnet"},
            data={"mode": "DHCP", "subnet": pxe_subnet.json()["id"]},
        )
        assert other_vlan.json() == {
            "subnet": ["Select a valid choice. That choice is not one of the available choices."]
        }
        machine = (await maas.get(f"machines/{system_id}/")).json()
        assert "10.200.0.1" in machine["ip_addresses"]  # STATIC addresses show at once
        await maas_sim.set_status(system_id, "Deployed")
        locked = await maas.post(url, params={"op": "link_subnet"}, data={"mode": "DHCP"})
        assert (locked.status_code, locked.text) == (
            409,
            "Cannot link subnet interface because the machine is not New, Ready, Allocated, "
            "or Broken.",
        )


async def test_subnets_and_fabrics(maas_sim: MaasSim) -> None:
    async with maas_sim.client() as maas:
        subnets = (await maas.get("subnets/")).json()
        assert [(s["name"], s["cidr"], s["vlan"]["vid"]) for s in subnets] == [
            ("pxe", "10.176.46.0/24", 46)
        ]
        pxe_id = subnets[0]["id"]
        for ref in (str(pxe_id), "name:pxe"):
            assert (await maas.get(f"subnets/{ref}/")).json()["id"] == pxe_id
        # A CIDR specifier holds a "/", which the URL pattern ([^/]+) never matches.
        assert (await maas.get("subnets/cidr:10.176.46.0/24/")).status_code == 404
        missing = await maas.get("subnets/999/")
        assert (missing.status_code, missing.text) == (404, "No Subnet matches the given query.")
        duplicate = await maas.post("subnets/", data={"cidr": "10.176.46.0/24"})
        assert duplicate.json() == {"cidr": ["Subnet with this Cidr already exists."]}
        fabrics = (await maas.get("fabrics/")).json()
        vlan_46 = next(v for f in fabrics for v in f["vlans"] if v["vid"] == 46)
        on_vlan = await maas.post(
            "subnets/", data={"cidr": "10.176.47.0/24", "vlan": vlan_46["id"],
                              "gateway_ip": "10.176.47.1", "dns_servers": "1.1.1.1 8.8.8.8"},
        )  # fmt: skip
        assert on_vlan.status_code == 200, on_vlan.text
        assert on_vlan.json()["dns_servers"] == ["1.1.1.1", "8.8.8.8"]
        bad_gateway = await maas.post(
            "subnets/", data={"cidr": "10.1.0.0/24", "gateway_ip": "10.2.0.1"}
        )
        assert bad_gateway.json() == {"gateway_ip": ["Gateway IP must be within CIDR range."]}
        no_vid = await maas.post("subnets/", data={"cidr": "10.1.0.0/24", "fabric": "fabric-0",
                                                   "vid": "77"})  # fmt: skip
        assert no_vid.status_code == 400
        assert "vid" in no_vid.json()
        deleted = await maas.delete(f"subnets/{on_vlan.json()['id']}/")
        assert deleted.status_code == 204
        racks = (await maas.get("rackcontrollers/")).json()
        assert racks[0]["node_type_name"] == "Region and rack controller"


async def test_events_query_filters_and_pages(maas_sim: MaasSim) -> None:
    a = str((await maas_sim.machine("node-a"))["system_id"])
    b = str((await maas_sim.machine("node-b"))["system_id"])
    async with maas_sim.client() as maas:
        await maas.post(f"machines/{a}/?op=deploy")
        await maas.post("machines/?op=accept", data={"machines": b})
        await maas_sim.wait_for_status(a, "Deployed")
        await maas_sim.wait_for_status(b, "Ready")

        async def query(**params: Any) -> Any:
            response = await maas.get("events/", params={"op": "query", **params})
            assert response.status_code == 200, response.text
            return response.json()

        info = await query(id=a)
        assert info["count"] == len(info["events"]) > 0
        assert {e["level"] for e in info["events"]} <= {"INFO", "WARNING", "ERROR", "CRITICAL"}
        assert {e["node"] for e in info["events"]} == {a}
        debug = await query(id=a, level="DEBUG")
        assert debug["count"] > info["count"]
        ids = [e["id"] for e in debug["events"]]
        assert ids == sorted(ids, reverse=True)  # newest first
        event = debug["events"][0]
        assert set(event) == {"username", "node", "hostname", "id", "level", "created", "type",
                              "description"}  # fmt: skip
        by_host = await query(hostname="node-b", level="DEBUG")
        assert {e["hostname"] for e in by_host["events"]} == {"node-b"}
        by_owner = await query(level="DEBUG", owner="admin")
        assert by_owner["count"] > 0
        assert {e["username"] for e in by_owner["events"]} == {"admin"}
        page = await query(id=a, level="DEBUG", limit=3)
        assert [e["id"] for e in page["events"]] == ids[:3]
        older = await query(id=a, level="DEBUG", limit=3, before=page["events"][-1]["id"])
        assert [e["id"] for e in older["events"]] == ids[3:6]
        assert f"before={page['events'][-1]['id']}" in page["prev_uri"]
        assert f"after={page['events'][0]['id']}" in page["next_uri"]
        newer = await query(id=a, level="DEBUG", after=ids[3])
        assert [e["id"] for e in newer["events"]] == ids[:3]
        for params, message in (
            ({"limit": 1001}, "Requested number of events 1001 is greater than limit: 1000"),
            ({"level": "CHATTY"}, "Unrecognised log level: CHATTY"),
            ({"before": 5, "after": 1},
             "There is undetermined behaviour when both `after` and `before` are specified."),
        ):  # fmt: skip
            refused = await maas.get("events/", params={"op": "query", **params})
            assert (refused.status_code, refused.text) == (400, message)
