"""Hardware sync as the REST API shows it (enable_hw_sync, sync_interval, last_sync; next_sync is
last_sync + sync_interval). end_deployment sets last_sync; afterwards the deployed OS's
hardware-sync timer posts every `timings.hw_sync` simulated seconds while the machine is powered
on, unless the hw_sync_never_healthy fault is armed. Ticks are computed, not scheduled. The
deployed OS can also stop its timer (`stop_sync_timer`: no more posts) and restart it
(`restart_sync_timer`, what `systemctl restart` of the timer does after a re-seed: a post at once,
then every period)."""

from __future__ import annotations

from sim.maas import faults as F
from sim.maas.enums import NodeStatus, PowerState
from sim.maas.hardware import machine_faults, timings
from sim.maas.model import Machine
from sim.maas.region import Region

S = NodeStatus


def start_sync_agent(region: Region, machine: Machine) -> None:
    """The deployed OS's hardware-sync timer starts posting, unless that fault is armed."""
    if machine_faults(machine).has(F.HW_SYNC_NEVER_HEALTHY):
        machine.sync_agent_since = None
    elif machine.sync_agent_since is None:
        machine.sync_agent_since = region.now


def last_sync(region: Region, machine: Machine) -> float | None:
    """Wall-clock time of the latest sync: end of deployment, or the timer's latest tick."""
    if not machine.enable_hw_sync:
        return None
    latest = machine.deployed_sync
    if machine.sync_agent_since is not None:
        period_s = timings(region, machine).hw_sync or float(machine.sync_interval or 900)
        period = region.clock.real_seconds(period_s)
        ticks = int((region.now - machine.sync_agent_since) // period) if period > 0 else 0
        if ticks > 0:
            tick = region.clock.wall(machine.sync_agent_since + ticks * period)
            latest = max(latest or tick, tick)
    return latest


def set_enable_hw_sync(region: Region, machine: Machine, enabled: bool) -> None:
    """Saving enable_hw_sync sets sync_interval from the site config."""
    machine.enable_hw_sync = enabled
    if enabled:
        machine.sync_interval = region.hardware_sync_seconds()
        if machine.status == S.DEPLOYED and machine.power_state == PowerState.ON:
            start_sync_agent(region, machine)
    else:
        machine.sync_interval = None
        machine.deployed_sync = None
        machine.sync_agent_since = None


def sync_timer_running(machine: Machine) -> bool:
    return machine.sync_agent_since is not None


def stop_sync_timer(region: Region, machine: Machine) -> None:
    """The deployed OS's hardware-sync timer stops (disabled, its unit or credentials lost):
    last_sync stays at its latest post and goes stale."""
    if machine.sync_agent_since is not None:
        machine.deployed_sync = last_sync(region, machine)
        machine.sync_agent_since = None


def restart_sync_timer(region: Region, machine: Machine) -> bool:
    """`systemctl restart` of the deployed OS's hardware-sync timer: its service posts at once
    (MAAS records last_sync = now), then every period. Nothing posts while MAAS has sync
    disabled for the machine, it is not Deployed and powered on, or hw_sync_never_healthy is
    armed (the OS still cannot reach MAAS); whether it posted."""
    if not machine.enable_hw_sync or machine.status != S.DEPLOYED:
        return False
    if machine.power_state != PowerState.ON or machine_faults(machine).has(F.HW_SYNC_NEVER_HEALTHY):
        return False
    machine.deployed_sync = region.wall_now()
    machine.sync_agent_since = region.now
    return True
