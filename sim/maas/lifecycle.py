"""Machine transitions over time: commissioning (then testing) to Ready, deployment to Deployed,
release through Disk erasing and Releasing to Ready, abort, broken/fixed and power. Each starts
at once and queues its later steps on the region clock; faults armed on the physical machine
decide how a step ends. What MAAS learns of the hardware is in sim.maas.hardware, hardware sync
in sim.maas.hwsync, discovery in sim.maas.enlistment.

The side rules MAAS enforces through signals are applied here, in `set_status` and `set_owner`:
the owner is cleared whenever the status becomes New or Ready, and the node key is erased
whenever the owner changes."""

from __future__ import annotations

import base64
import binascii
import functools
from dataclasses import dataclass

from sim.maas import faults as F
from sim.maas import network
from sim.maas.enums import RELEASABLE, Ev, EventType, NodeStatus, PowerState, ScriptStatus
from sim.maas.errors import conflict
from sim.maas.hardware import apply_commissioning_config, discover_hardware, machine_faults, timings
from sim.maas.hwsync import last_sync, set_enable_hw_sync, start_sync_agent
from sim.maas.model import Hardware, Machine, NodeKey, Steppable
from sim.maas.region import Region

S = NodeStatus
INSTALL_FAILED = "Installation failed (refer to the installation log for more information)."
DEPLOY_TIMED_OUT = "Node operation 'Deploying' timed out after 30 minutes."
COMMISSION_TIMED_OUT = "Node operation 'Commissioning' timed out after 30 minutes."
COMMISSION_FAILED = "Failed to run commissioning scripts (refer to the commissioning log)."
ERASE_FAILED = "Failed to erase disks."
BMC_UNREACHABLE = (
    "Power on for the node failed: Failed talking to node's BMC: Unable to establish IPMI v2 / "
    "RMCP+ session"
)
DATASOURCE_SEARCH = "'cloudinit' searching for network data from DataSourceMAAS"
DATASOURCE_FINAL = "'cloudinit' running modules for final"
CURTIN_STEP = "'curtin' curtin command install"
CURTIN_FAILED = CURTIN_STEP
# Who acts when the simulator's control API changes something "in the MAAS UI".
OPERATOR = "ops-admin"


# --- status, owner, key, power ---


def set_status(region: Region, machine: Machine, status: NodeStatus) -> None:
    old = machine.status
    if old == status:
        return
    machine.previous_status = old
    machine.status = status
    region.log(machine, Ev.CHANGED_STATUS, f"From '{old.label}' to '{status.label}'")
    if status in (S.NEW, S.READY):
        set_owner(machine, None)
    vanish = machine_faults(machine).get(F.VANISHES)
    if vanish is not None and vanish.when.lower() == status.label.lower():
        machine_faults(machine).take(F.VANISHES)
        # Someone deletes it from outside: nothing MAAS does to the machine cancels that.
        region.schedule(Steppable(), vanish.after, lambda: region.delete_machine(machine))


def set_owner(machine: Machine, owner: str | None) -> None:
    if machine.owner != owner:
        machine.owner = owner
        machine.node_key = None  # clear_nodekey_when_owner_changes


def ensure_node_key(region: Region, machine: Machine) -> None:
    """Rendering commissioning or deployment user data creates the node's key if it has none."""
    if machine.node_key is None:
        machine.node_key = NodeKey(
            consumer_key=region.token_string(18),
            token_key=region.token_string(18),
            token_secret=region.token_string(32),
            created_at=region.now,
        )


def visible_node_key(region: Region, machine: Machine) -> NodeKey | None:
    key = machine.node_key
    delayed = machine_faults(machine).get(F.TOKEN_DELAYED)
    if key is None or delayed is None:
        return key
    visible_at = key.created_at + region.clock.real_seconds(delayed.after)
    return key if region.now >= visible_at else None


def set_power(region: Region, machine: Machine, on: bool) -> None:
    hardware = machine.hardware
    if hardware is None:
        return
    machine.power_error = False
    stuck = not on and hardware.power == PowerState.ON
    if stuck and machine_faults(machine).take(F.POWER_STUCK_ON) is not None:
        machine.power_error = True
        region.log(machine, Ev.POWER_OFF_FAILED, "the BMC did not power the machine off")
        return
    if (hardware.power == PowerState.ON) != on:
        set_hardware_power(region, hardware, on)


def set_hardware_power(region: Region, hardware: Hardware, on: bool) -> None:
    """The machine's power changes (through MAAS or at the BMC): MAAS notes it, and a deployed
    OS's hardware-sync timer stops and starts with it."""
    hardware.power = PowerState.ON if on else PowerState.OFF
    for machine in [m for m in region.machines.values() if m.hardware is hardware]:
        region.log(machine, Ev.POWERED_ON if on else Ev.POWERED_OFF)
        if not on and machine.sync_agent_since is not None:
            machine.deployed_sync = last_sync(region, machine)
            machine.sync_agent_since = None
        elif on and machine.enable_hw_sync and machine.status == S.DEPLOYED:
            start_sync_agent(region, machine)


# --- progress events: what the status bar shows while a transition runs ---

_COMMISSIONING_PROGRESS = (
    (0.1, Ev.PERFORMING_PXE_BOOT, ""),
    (0.3, Ev.LOADING_EPHEMERAL, ""),
    (0.5, Ev.GATHERING_INFO, ""),
)
_DEPLOYMENT_PROGRESS = (
    (0.05, Ev.PERFORMING_PXE_BOOT, ""),
    (0.15, Ev.LOADING_EPHEMERAL, ""),
    (0.3, Ev.CONFIGURING_STORAGE, ""),
    (0.45, Ev.INSTALLING_OS, ""),
    (0.46, Ev.INSTALL_EVENT, CURTIN_STEP),
    (0.7, Ev.CONFIGURING_OS, ""),
    (0.85, Ev.REBOOTING, ""),
)


def _schedule_progress(
    region: Region,
    machine: Machine,
    duration: float,
    phases: tuple[tuple[float, EventType, str], ...],
) -> None:
    for fraction, etype, description in phases:
        log = functools.partial(region.log, machine, etype, description)
        region.schedule(machine, duration * fraction, log)


# --- commissioning ---


def start_commissioning(
    region: Region,
    machine: Machine,
    user: str,
    enable_ssh: bool = False,
    skip_networking: bool = False,
    skip_storage: bool = False,
) -> None:
    machine.cancel_steps()
    resume = machine.status
    machine.enable_ssh = enable_ssh
    machine.error_description = ""
    region.log(machine, Ev.START_COMMISSIONING, "", user)
    set_status(region, machine, S.COMMISSIONING)
    region.log(machine, Ev.COMMISSIONING)
    machine.commissioning_status = ScriptStatus.RUNNING
    machine.testing_status = ScriptStatus.PENDING
    ensure_node_key(region, machine)
    machine.resume_status = resume  # where abort returns to
    duration = timings(region, machine).commissioning
    if machine.hardware is None:
        # Nothing answers at the power address (or nobody powers a manual machine on): the
        # node never boots and the operation times out.
        if machine.power_type == "ipmi":
            machine.power_error = True
            region.log(machine, Ev.POWER_ON_FAILED, BMC_UNREACHABLE)
        region.schedule(
            machine, duration, lambda: fail_commissioning(region, machine, COMMISSION_TIMED_OUT)
        )
        return
    set_power(region, machine, True)
    _schedule_progress(region, machine, duration, _COMMISSIONING_PROGRESS)
    region.schedule(
        machine,
        duration,
        lambda: _finish_commissioning(region, machine, not skip_networking, not skip_storage),
    )


def _finish_commissioning(region: Region, machine: Machine, networking: bool, disks: bool) -> None:
    failure = machine_faults(machine).take(F.COMMISSIONING_FAILS)
    if failure is not None:
        region.log(machine, Ev.COMMISSIONING_EVENT_FAILED, "'maas-run-remote-scripts' failed")
        fail_commissioning(region, machine, failure.message or COMMISSION_FAILED)
        return
    discover_hardware(region, machine, networking, disks)
    apply_commissioning_config(region, machine, networking, disks)
    machine.commissioning_status = ScriptStatus.PASSED
    machine.testing_status = ScriptStatus.RUNNING
    set_status(region, machine, S.TESTING)
    region.log(machine, Ev.RUNNING_TEST, "smartctl-validate")
    region.schedule(
        machine, timings(region, machine).testing, lambda: _finish_testing(region, machine)
    )


def _finish_testing(region: Region, machine: Machine) -> None:
    machine.testing_status = ScriptStatus.PASSED
    set_status(region, machine, S.READY)
    region.log(machine, Ev.READY)
    if not machine.enable_ssh:
        set_power(region, machine, False)


def fail_commissioning(region: Region, machine: Machine, message: str) -> None:
    machine.commissioning_status = ScriptStatus.FAILED
    machine.error_description = message
    region.log(machine, Ev.MARK_FAILED_SYSTEM, message)
    set_status(region, machine, S.FAILED_COMMISSIONING)
    set_power(region, machine, False)


def accept(region: Region, machine: Machine, user: str) -> bool:
    """op=accept: New starts commissioning; Ready and Commissioning are skipped."""
    if machine.status in (S.READY, S.COMMISSIONING):
        return False
    if machine.status != S.NEW:
        raise conflict(
            f"Cannot accept node enlistment: node {machine.system_id} is in state "
            f"{machine.status.label}."
        )
    # accept_enlistment starts commissioning directly: no network interface needed.
    start_commissioning(region, machine, user)
    return True


# --- allocation and deployment ---


def allocate(region: Region, machine: Machine, user: str, agent_name: str = "") -> None:
    region.log(machine, Ev.ACQUIRE, "", user)
    set_owner(machine, user)
    machine.agent_name = agent_name
    set_status(region, machine, S.ALLOCATED)


@dataclass(frozen=True)
class DeployRequest:
    osystem: str
    distro_series: str
    user_data: bytes | None = None
    hwe_kernel: str | None = None
    enable_hw_sync: bool = False
    agent_name: str = ""


def decode_user_data(text: str) -> bytes:
    """metadataserver prepare_user_data: valid base64 is decoded, anything else kept as is."""
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError):
        return text.encode()


def start_deployment(region: Region, machine: Machine, user: str, request: DeployRequest) -> None:
    """From Ready (auto-allocated to `user`) or Allocated; callers have validated the request."""
    machine.cancel_steps()
    if machine.status == S.READY:
        allocate(region, machine, user, request.agent_name)
    machine.osystem, machine.distro_series = request.osystem, request.distro_series
    machine.hwe_kernel = request.hwe_kernel
    machine.user_data = request.user_data
    machine.error_description = ""
    if request.enable_hw_sync:
        machine.enable_hw_sync = True
        machine.sync_interval = region.hardware_sync_seconds()
    ensure_node_key(region, machine)  # the deploy call renders the curtin preseed
    region.log(machine, Ev.START_DEPLOYMENT, "", user)
    network.claim_auto_ips(region, machine)
    set_status(region, machine, S.DEPLOYING)
    region.log(machine, Ev.DEPLOYING)
    set_power(region, machine, True)
    duration = timings(region, machine).deploying
    _schedule_progress(region, machine, duration, _DEPLOYMENT_PROGRESS)
    region.schedule(machine, duration, lambda: _finish_deployment(region, machine))


def _finish_deployment(region: Region, machine: Machine) -> None:
    faults = machine_faults(machine)
    if machine.hardware is None:
        _fail_deployment(region, machine, DEPLOY_TIMED_OUT)
        return
    datasource = faults.take(F.DEPLOY_FAILS_DATASOURCE)
    if datasource is not None:
        region.log(machine, Ev.INSTALL_EVENT, DATASOURCE_SEARCH)
        if datasource.variant == "timeout":
            _fail_deployment(region, machine, datasource.message or DEPLOY_TIMED_OUT)
        else:
            region.log(machine, Ev.INSTALL_EVENT_FAILED, datasource.message or DATASOURCE_FINAL)
            _fail_deployment(region, machine, INSTALL_FAILED)
        return
    generic = faults.take(F.DEPLOY_FAILS)
    if generic is not None:
        region.log(machine, Ev.INSTALL_EVENT_FAILED, generic.message or CURTIN_FAILED)
        _fail_deployment(region, machine, INSTALL_FAILED)
        return
    region.log(machine, Ev.INSTALLATION_FINISHED)
    network.lease_dhcp_ips(region, machine)
    set_status(region, machine, S.DEPLOYED)
    region.log(machine, Ev.DEPLOYED)
    if machine.enable_hw_sync:
        machine.deployed_sync = region.wall_now()  # end_deployment sets last_sync = now
        start_sync_agent(region, machine)


def _fail_deployment(region: Region, machine: Machine, message: str) -> None:
    machine.error_description = message
    region.log(machine, Ev.MARK_FAILED_SYSTEM, message)
    set_status(region, machine, S.FAILED_DEPLOYMENT)


# --- release ---


def release(
    region: Region,
    machine: Machine,
    user: str,
    erase: bool = False,
    comment: str = "",
    erase_method: str = "plain",
) -> None:
    if machine.status in (S.READY, S.RELEASING):
        return
    if machine.status not in RELEASABLE:
        raise conflict(
            f"Machine cannot be released in its current state ('{machine.status.label}')."
        )
    machine.cancel_steps()
    region.log(machine, Ev.RELEASE, comment, user)
    machine.osystem = machine.distro_series = ""
    machine.hwe_kernel = None
    set_enable_hw_sync(region, machine, False)
    if erase or region.config["enable_disk_erasing_on_release"]:
        region.log(machine, Ev.ERASE_DISK, "", user)
        set_status(region, machine, S.DISK_ERASING)
        set_power(region, machine, True)
        region.schedule(
            machine,
            timings(region, machine).disk_erasing,
            lambda: _finish_erasing(region, machine, erase_method),
        )
    else:
        _begin_releasing(region, machine)


def _finish_erasing(region: Region, machine: Machine, method: str = "plain") -> None:
    failure = machine_faults(machine).take(F.ERASE_FAILS)
    region.erasures.append(
        {
            "system_id": machine.system_id,
            "hostname": machine.hardware.spec.hostname if machine.hardware else None,
            "method": method,
            "outcome": "failed" if failure is not None else "erased",
            "at": region.wall_now(),
        }
    )
    if failure is not None:
        message = failure.message or ERASE_FAILED
        machine.error_description = message
        region.log(machine, Ev.MARK_FAILED_SYSTEM, message)
        set_status(region, machine, S.FAILED_DISK_ERASING)
        set_power(region, machine, False)
        return
    region.log(machine, Ev.DISKS_ERASED)
    _begin_releasing(region, machine)


def _begin_releasing(region: Region, machine: Machine) -> None:
    set_status(region, machine, S.RELEASING)
    region.log(machine, Ev.RELEASING)
    # The machine's real power, not MAAS's last view of it (which may be "error").
    if machine.hardware is None or machine.hardware.power != PowerState.ON:
        _finish_release(region, machine)  # already off: Ready at once
        return

    def power_off_then_ready() -> None:
        set_power(region, machine, False)
        if machine.hardware is not None and machine.hardware.power == PowerState.ON:
            # The BMC did not comply: MAAS gives up on the release.
            machine.error_description = "Failed to power off node."
            set_status(region, machine, S.FAILED_RELEASING)
            return
        _finish_release(region, machine)

    region.schedule(machine, timings(region, machine).releasing, power_off_then_ready)


def _finish_release(region: Region, machine: Machine) -> None:
    network.release_ips(machine)
    machine.user_data = None
    set_status(region, machine, S.READY)
    region.log(machine, Ev.RELEASED)


# --- abort, broken, fixed ---


def abort(region: Region, machine: Machine, user: str, comment: str = "") -> None:
    status = machine.status
    if status in (S.COMMISSIONING, S.TESTING):
        machine.cancel_steps()
        aborted = status == S.COMMISSIONING
        region.log(machine, Ev.ABORT_COMMISSIONING if aborted else Ev.ABORT_TESTING, comment, user)
        if aborted:
            machine.commissioning_status = ScriptStatus.ABORTED
        machine.testing_status = ScriptStatus.ABORTED
        set_power(region, machine, False)
        set_status(region, machine, machine.resume_status)
        region.log(machine, Ev.ABORTED_COMMISSIONING if aborted else Ev.ABORTED_TESTING)
    elif status == S.DEPLOYING:
        machine.cancel_steps()
        region.log(machine, Ev.ABORT_DEPLOYMENT, comment, user)
        set_power(region, machine, False)
        set_status(region, machine, S.ALLOCATED)
        region.log(machine, Ev.ABORTED_DEPLOYMENT)
    elif status == S.DISK_ERASING:
        machine.cancel_steps()
        region.log(machine, Ev.ABORT_ERASE_DISK, comment, user)
        set_power(region, machine, False)
        set_status(region, machine, S.FAILED_DISK_ERASING)
        region.log(machine, Ev.ABORTED_DISK_ERASING)
    else:
        raise conflict(
            f"Cannot abort in current state: node {machine.system_id} is in state {status.label}."
        )


def mark_broken(region: Region, machine: Machine, user: str, comment: str = "") -> None:
    """A Deployed machine stays deployed underneath (mark_fixed returns it to Deployed); other
    releasable machines are released first."""
    region.log(machine, Ev.MARK_BROKEN, comment, user)
    machine.cancel_steps()
    if machine.status in RELEASABLE and machine.status not in (S.DEPLOYED, S.BROKEN):
        network.release_ips(machine)
        set_enable_hw_sync(region, machine, False)
        machine.osystem = machine.distro_series = ""
        set_owner(machine, None)
    machine.error_description = comment
    set_status(region, machine, S.BROKEN)


def mark_fixed(region: Region, machine: Machine, user: str, comment: str = "") -> None:
    if machine.status != S.BROKEN:
        raise conflict("Can't mark a non-broken node as 'Ready'.")
    region.log(machine, Ev.MARK_FIXED, comment, user)
    machine.error_description = ""
    if machine.previous_status == S.DEPLOYED:
        set_status(region, machine, S.DEPLOYED)
    else:
        set_status(region, machine, S.READY)


# --- power ---


def power_on(region: Region, machine: Machine, user: str) -> None:
    if machine.owner is None:
        raise conflict("Can't start node: it hasn't been allocated.")
    region.log(machine, Ev.START, "", user)
    if machine.hardware is None:
        machine.power_error = True
        region.log(machine, Ev.POWER_ON_FAILED, BMC_UNREACHABLE)
        return
    set_power(region, machine, True)


def power_off(region: Region, machine: Machine, user: str) -> None:
    region.log(machine, Ev.STOP, "", user)
    set_power(region, machine, False)
