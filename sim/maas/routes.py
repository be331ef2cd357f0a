"""The MAAS 2.0 API resources the simulator serves, and which handler answers each (method, op).

Paths are relative to /MAAS/api/2.0/ and written without their trailing slash: a resource
answers at `<path>/` (op from the query string, else from the form body) and at the older
`<path>/op-<name>` form. Every (method, op) pair a resource exports is listed; a method it never
exports is a 405, an unlisted op a 400 "Unrecognised signature". `anonymous` lists what an
unsigned request may do; an unsigned request to anything else is a 401 "Forbidden"."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sim.maas import api_machines as machines
from sim.maas import api_misc as misc
from sim.maas import api_nodes as nodes

Handler = Callable[..., Any]
Key = tuple[str, str | None]  # (HTTP method, op or None)


@dataclass(frozen=True)
class Resource:
    name: str  # how counters name its operations: "<name>.<op or read/create/update/delete>"
    path: str  # a regex with named groups, relative to /MAAS/api/2.0/, no trailing slash
    ops: Mapping[Key, Handler]
    anonymous: Mapping[Key, Handler] = field(default_factory=dict)

    @property
    def methods(self) -> frozenset[str]:
        return frozenset(m for m, _ in self.ops) | frozenset(m for m, _ in self.anonymous)

    @property
    def anonymous_methods(self) -> frozenset[str]:
        return frozenset(m for m, _ in self.anonymous)

    def matcher(self) -> re.Pattern[str]:
        return re.compile(rf"{self.path}(?:/|/op-(?P<path_op>[A-Za-z0-9_]+))")


DEFAULT_OP_NAMES = {"GET": "read", "POST": "create", "PUT": "update", "DELETE": "delete"}
_SID = r"(?P<system_id>[^/]+)"

RESOURCES: tuple[Resource, ...] = (
    Resource("version", "version", {("GET", None): misc.version}, {("GET", None): misc.version}),
    Resource("users", "users", {("GET", "whoami"): misc.whoami}),
    Resource(
        "maas",
        "maas",
        {("GET", "get_config"): misc.get_config, ("POST", "set_config"): misc.set_config},
    ),
    Resource("rackcontrollers", "rackcontrollers", {("GET", None): misc.rack_controllers}),
    Resource("fabrics", "fabrics", {("GET", None): misc.list_fabrics}),
    Resource(
        "machines",
        "machines",
        {
            ("GET", None): machines.list_machines,
            ("POST", None): machines.create_machine,
            ("POST", "accept"): machines.accept,
            ("POST", "accept_all"): machines.accept_all,
            ("POST", "allocate"): machines.allocate,
            ("GET", "power_parameters"): machines.power_parameters_all,
            ("GET", "is_registered"): machines.anonymous_is_registered,
        },
        anonymous={
            ("GET", "is_registered"): machines.anonymous_is_registered,
            ("POST", None): machines.anonymous_enlist,
            ("POST", "accept"): machines.anonymous_accept,
        },
    ),
    Resource(
        "machine",
        f"machines/{_SID}",
        {
            ("GET", None): machines.read_machine,
            ("PUT", None): machines.update_machine,
            ("DELETE", None): machines.delete_machine,
            ("POST", "commission"): machines.commission,
            ("POST", "deploy"): machines.deploy,
            ("POST", "release"): machines.release,
            ("POST", "abort"): machines.abort,
            ("POST", "mark_broken"): machines.mark_broken,
            ("POST", "mark_fixed"): machines.mark_fixed,
            ("POST", "power_on"): machines.power_on,
            ("POST", "power_off"): machines.power_off,
            ("POST", "set_storage_layout"): machines.set_storage_layout,
            ("GET", "query_power_state"): machines.query_power_state,
            ("GET", "get_token"): machines.get_token,
            ("GET", "power_parameters"): machines.power_parameters,
        },
    ),
    Resource(
        "blockdevices",
        f"nodes/{_SID}/blockdevices",
        {("GET", None): nodes.list_block_devices},
    ),
    Resource(
        "blockdevice",
        f"nodes/{_SID}/blockdevices/(?P<device_id>[^/]+)",
        {
            ("GET", None): nodes.read_block_device,
            ("POST", "set_boot_disk"): nodes.set_boot_disk,
        },
    ),
    Resource(
        "interfaces",
        f"nodes/{_SID}/interfaces",
        {("GET", None): nodes.list_interfaces},
    ),
    Resource(
        "interface",
        f"nodes/{_SID}/interfaces/(?P<interface_id>[^/]+)",
        {
            ("GET", None): nodes.read_interface,
            ("POST", "link_subnet"): nodes.link_subnet,
            ("POST", "unlink_subnet"): nodes.unlink_subnet,
        },
    ),
    Resource(
        "subnets",
        "subnets",
        {("GET", None): misc.list_subnets, ("POST", None): misc.create_subnet},
    ),
    Resource(
        "subnet",
        "subnets/(?P<subnet_id>[^/]+)",
        {("GET", None): misc.read_subnet, ("DELETE", None): misc.delete_subnet},
    ),
    Resource("events", "events", {("GET", "query"): misc.query_events}),
)


# Operations only a superuser may call (maasserver/api: `@admin_method`, or an admin permission
# check on the node): a non-admin's valid key gets 403 with an empty body, as PermissionDenied
# answers. What a non-admin may do to a machine otherwise needs the machine to be unowned or its
# own (NodePermission.edit): MACHINE_EDIT_OPS.
ADMIN_ONLY_OPS = frozenset(
    {
        "machines.create",
        "machines.accept",
        "machines.accept_all",
        "machines.power_parameters",
        "machine.update",
        "machine.delete",
        "machine.commission",
        "machine.mark_fixed",
        "machine.set_storage_layout",
        "machine.get_token",
        "machine.power_parameters",
        "blockdevice.set_boot_disk",
        "interface.link_subnet",
        "interface.unlink_subnet",
        "subnets.create",
        "subnet.delete",
        "maas.set_config",
    }
)
MACHINE_EDIT_OPS = frozenset(
    {
        "machine.deploy",
        "machine.release",
        "machine.abort",
        "machine.power_on",
        "machine.power_off",
    }
)


@dataclass(frozen=True)
class Match:
    resource: Resource
    args: dict[str, str]  # path parameters for the handler
    path_op: str | None


_COMPILED = [(r, r.matcher()) for r in RESOURCES]


def match(relative_path: str) -> Match | None:
    for resource, pattern in _COMPILED:
        found = pattern.fullmatch(relative_path)
        if found is not None:
            groups = found.groupdict()
            path_op = groups.pop("path_op", None)
            return Match(resource, {k: v for k, v in groups.items() if v is not None}, path_op)
    return None
