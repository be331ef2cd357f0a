"""The per-allocation network a slice VM plugs into: an isolated bridge per allocation, joined to
the node's uplink through a VLAN sub-interface when the control plane assigned the allocation a
VLAN. The libvirt backend prepares it before defining the domain and removes it on release."""

from __future__ import annotations

from dataclasses import dataclass

from agent.network.allocation_network import (
    AllocationNetworkSpec,
    apply_allocation_network,
    bridge_name,
    remove_allocation_network,
)


@dataclass(frozen=True)
class SliceNetworks:
    uplink: str | None = None  # the node's tenant-facing NIC (VLANs hang off it)
    netns: str | None = None  # None: the host's namespace (tests use their own)

    def prepare(self, allocation_id: str, vlan_id: int | None) -> str:
        """Apply (idempotently) and answer the bridge the domain's NIC attaches to."""
        with_vlan = self.uplink is not None and vlan_id is not None
        apply_allocation_network(
            AllocationNetworkSpec(
                allocation_id,
                uplink=self.uplink if with_vlan else None,
                vlan_id=vlan_id if with_vlan else None,
            ),
            netns=self.netns,
        )
        return bridge_name(allocation_id)

    def remove(self, allocation_id: str) -> int:
        return len(remove_allocation_network(allocation_id, netns=self.netns).deleted)
