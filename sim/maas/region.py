"""The simulated region's store and its clock-driven step queue.

Transitions are queued as steps due at a monotonic time. Nothing runs in the background: every
request first calls `advance()`, which runs the steps that are due, in due order, each with
`region.now` set to its own due time, so what a step records (event times, follow-up deadlines)
does not depend on when a request happened to arrive. Single-threaded by construction (one asyncio
loop), so a request sees and changes the state atomically.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sim.maas.clock import SimClock
from sim.maas.enums import LEVEL_NAMES, EventType
from sim.maas.errors import not_found
from sim.maas.faults import FaultSet
from sim.maas.model import Event, Fabric, Hardware, Machine, Steppable, Subnet, Vlan
from sim.maas.scenario import Scenario, parse_duration

# generate_node_system_id: a znum, 6 characters of this alphabet, value in [24^5, 24^6).
_ZNUM_ALPHABET = "34678abcdefghkmnpqrstwxy"
_ADJECTIVES = (
    "able", "brave", "calm", "clever", "eager", "fair", "fancy", "gentle", "happy", "humble",
    "jolly", "keen", "kind", "lively", "lucky", "merry", "noble", "polite", "proud", "quick",
    "quiet", "rapid", "sharp", "steady", "sunny", "swift", "tidy", "vivid", "warm", "witty",
)  # fmt: skip
_ANIMALS = (
    "ant", "badger", "bee", "bison", "cat", "crane", "deer", "dingo", "eagle", "ferret", "finch",
    "gecko", "heron", "ibex", "koala", "lemur", "lynx", "mole", "newt", "otter", "panda", "quail",
    "raven", "seal", "shrew", "sloth", "tapir", "toad", "viper", "wombat", "yak", "zebra",
)  # fmt: skip


def encode_znum(value: int) -> str:
    digits = []
    while True:
        value, rem = divmod(value, len(_ZNUM_ALPHABET))
        digits.append(_ZNUM_ALPHABET[rem])
        if value == 0:
            return "".join(reversed(digits))


@dataclass(order=True)
class _Step:
    due: float
    seq: int
    target: Steppable = field(compare=False)
    generation: int = field(compare=False)
    action: Callable[[], object] = field(compare=False)


class Region:
    """Everything one simulated MAAS region knows, plus the physical machines behind it."""

    def __init__(self, scenario: Scenario, time_scale: float | None = None) -> None:
        self.scenario = scenario
        self.site = scenario.site
        scale = time_scale if time_scale is not None else scenario.time_scale
        self.clock = SimClock(scale if scale is not None else 1.0)
        self.rng = random.Random(scenario.seed)
        self.now = self.clock.monotonic()
        self.fabrics: dict[int, Fabric] = {}
        self.vlans: dict[int, Vlan] = {}
        self.subnets: dict[int, Subnet] = {}
        self.hardware: dict[str, Hardware] = {}  # by BMC address
        self.machines: dict[str, Machine] = {}  # by system_id, in creation order
        self.events: list[Event] = []
        # What happened to the physical machines, for tests to observe (never shown through the
        # MAAS API): every BMC request in order ({"address", "action": status|on|cycle,
        # "power_before", "at"}), and every disk erase MAAS ran to its end ({"system_id",
        # "hostname" (scenario), "method": plain|quick|secure, "outcome": erased|failed, "at"}).
        self.bmc_log: list[dict[str, Any]] = []
        self.erasures: list[dict[str, Any]] = []
        # MAAS global config (maas/?op=get_config / set_config), as MAAS stores it.
        self.config: dict[str, Any] = {
            "hardware_sync_interval": _timespan(self.site.hardware_sync_interval),
            "enable_disk_erasing_on_release": self.site.enable_disk_erasing_on_release,
        }
        self.request_faults = FaultSet.of(scenario.faults)
        self._steps: list[_Step] = []
        self._seq = itertools.count()
        self._ids: dict[str, Iterator[int]] = {
            "fabric": itertools.count(0),
            "vlan": itertools.count(5001),
            "subnet": itertools.count(1),
            "interface": itertools.count(1),
            "link": itertools.count(1),
            "blockdevice": itertools.count(1),
            "partition": itertools.count(1),
            "event": itertools.count(1),
        }

    def hardware_sync_seconds(self) -> int:
        """The config hardware_sync_interval in seconds (what enable_hw_sync saves as the
        machine's sync_interval)."""
        return int(parse_duration(self.config["hardware_sync_interval"]))

    # --- identities ---

    def next_id(self, kind: str) -> int:
        return next(self._ids[kind])

    def new_system_id(self) -> str:
        low, high = len(_ZNUM_ALPHABET) ** 5, len(_ZNUM_ALPHABET) ** 6
        while True:
            system_id = encode_znum(self.rng.randrange(low, high))
            if system_id not in self.machines:
                return system_id

    def petname(self) -> str:
        taken = {m.hostname for m in self.machines.values()}
        while True:
            name = f"{self.rng.choice(_ADJECTIVES)}-{self.rng.choice(_ANIMALS)}"
            if name not in taken:
                return name

    def token_string(self, length: int) -> str:
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
        return "".join(self.rng.choice(alphabet) for _ in range(length))

    def uuid(self) -> str:
        return "-".join(
            "".join(self.rng.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12)
        )

    # --- time ---

    def schedule(self, target: Steppable, delay: float, action: Callable[[], object]) -> None:
        """Run `action` `delay` simulated seconds from now, unless `target` cancels its steps."""
        due = self.now + self.clock.real_seconds(delay)
        heapq.heappush(self._steps, _Step(due, next(self._seq), target, target.generation, action))

    def advance(self) -> None:
        """Run every step that is due by the clock, in order."""
        until = self.clock.monotonic()
        while self._steps and self._steps[0].due <= until:
            step = heapq.heappop(self._steps)
            if step.generation != step.target.generation:
                continue  # cancelled
            if isinstance(step.target, Machine) and step.target.system_id not in self.machines:
                continue  # deleted
            self.now = max(self.now, step.due)
            step.action()
        self.now = max(self.now, until)

    def pending_steps(self, target: Steppable) -> int:
        return sum(
            1 for s in self._steps if s.target is target and s.generation == target.generation
        )

    def wall_now(self) -> float:
        return self.clock.wall(self.now)

    # --- events ---

    def log(
        self, machine: Machine, etype: EventType, description: str = "", username: str = "unknown"
    ) -> Event:
        event = Event(
            id=self.next_id("event"),
            system_id=machine.system_id,
            hostname=machine.hostname,
            type=etype,
            description=description,
            created=self.wall_now(),
            username=username,
        )
        self.events.append(event)
        return event

    def status_message(self, machine: Machine) -> str:
        """ "<type> - <description>" of the newest INFO-or-above event (Node.status_message)."""
        for event in reversed(self.events):
            if event.system_id == machine.system_id and event.type.level >= 20:
                if event.description:
                    return f"{event.type.description} - {event.description}"
                return event.type.description
        return ""

    @staticmethod
    def level_name(level: int) -> str:
        return LEVEL_NAMES.get(level, str(level))

    # --- lookups ---

    def machine_or_404(self, system_id: str) -> Machine:
        machine = self.machines.get(system_id)
        if machine is None:
            raise not_found("Machine")
        return machine

    def machine_by_hostname(self, hostname: str) -> Machine | None:
        short = hostname.split(".")[0]
        return next((m for m in self.machines.values() if m.hostname == short), None)

    def hardware_at(self, address: str) -> Hardware | None:
        """The physical machine whose BMC answers at `address` (or reports it at enlistment)."""
        found = self.hardware.get(address)
        if found is None:
            found = next(
                (h for h in self.hardware.values() if h.spec.bmc.detected_address == address),
                None,
            )
        return found

    def machines_at_bmc(self, address: str) -> list[Machine]:
        return [m for m in self.machines.values() if m.power_address == address]

    def find_machine(self, ref: str) -> Machine | None:
        """By system_id, MAAS hostname, scenario hostname or BMC address (control API refs)."""
        if ref in self.machines:
            return self.machines[ref]
        found = self.machine_by_hostname(ref)
        if found is not None:
            return found
        hardware = self.find_hardware(ref)
        if hardware is not None:
            return next((m for m in self.machines.values() if m.hardware is hardware), None)
        return None

    def find_hardware(self, ref: str) -> Hardware | None:
        if ref in self.hardware:
            return self.hardware[ref]
        for hardware in self.hardware.values():
            if hardware.spec.hostname == ref:
                return hardware
        machine = self.machines.get(ref) or self.machine_by_hostname(ref)
        return machine.hardware if machine is not None else None

    def subnet_by_ref(self, ref: str) -> Subnet | None:
        """A database id, a `cidr:`/`name:`/`id:` specifier, or a bare CIDR or name."""
        text = ref.strip()
        if text.isdigit():
            return self.subnets.get(int(text))
        key, _, value = text.partition(":")
        if key == "id" and value.isdigit():
            return self.subnets.get(int(value))
        if key in ("cidr", "name") and value:
            text = value
        for subnet in self.subnets.values():
            if text in (subnet.cidr, subnet.name):
                return subnet
        return None

    def fabric_named(self, name: str) -> Fabric:
        for fabric in self.fabrics.values():
            if fabric.name == name:
                return fabric
        fabric = Fabric(self.next_id("fabric"), name)
        self.fabrics[fabric.id] = fabric
        self.vlan_on(fabric, 0)
        return fabric

    def vlan_on(self, fabric: Fabric, vid: int) -> Vlan:
        for vlan in self.vlans.values():
            if vlan.fabric is fabric and vlan.vid == vid:
                return vlan
        vlan = Vlan(self.next_id("vlan"), vid, fabric)
        self.vlans[vlan.id] = vlan
        return vlan

    def default_vlan(self) -> Vlan:
        return self.vlan_on(self.fabric_named("fabric-0"), 0)

    def add_subnet(self, subnet: Subnet) -> Subnet:
        self.subnets[subnet.id] = subnet
        return subnet

    def delete_machine(self, machine: Machine) -> None:
        """Gone from MAAS, events included (they cascade with the node)."""
        machine.cancel_steps()
        self.machines.pop(machine.system_id, None)
        self.events = [e for e in self.events if e.system_id != machine.system_id]


def _timespan(seconds: float) -> str:
    """Seconds as MAAS writes a systemd-style timespan ("15m", "90s", "1h")."""
    whole = int(seconds)
    if whole and whole % 3600 == 0:
        return f"{whole // 3600}h"
    if whole and whole % 60 == 0:
        return f"{whole // 60}m"
    return f"{whole}s"
