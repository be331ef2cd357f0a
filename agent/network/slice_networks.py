"""The network a slice VM plugs into. With a VLAN (the control plane assigns one per project and
region), the VLAN's segment on this node: a bridge shared by the project's allocations here and
joined to the node's uplink for that id, so the project's VMs share one L2 segment across nodes
and no other project's VMs are on it. How the segment crosses the uplink is the node's
`encapsulation` (agent/network/encapsulation.py): an 802.1Q sub-interface (VLAN id = segment
id, the default) or a VXLAN device (VNI = segment id). Without an uplink the segment stays on
this node. Without a VLAN, an isolated bridge of the allocation's own. The libvirt backend
prepares it before defining the domain and removes it on release.

The VM's NIC is a tap the agent makes itself (`SliceNic.tap`): on a segment, the allocation's
member link; on an isolated bridge, its one tap (`tap_names(allocation_id, 1)`). It is created
down with IPv6 off (no link-local address, no SLAAC: the host is no IPv6 neighbour of the
tenant's VM on it), given the bridge's MTU, enslaved and brought up before libvirt opens it
(`<interface type='ethernet'>` with `<target dev=… managed='no'/>`), so there is no moment in
which the kernel could give it an address. The bridge's MTU (what the segment's encapsulation
leaves of the uplink's, or the kernel's default on a bridge of this node only) is read back from
the host and goes into the domain's `<mtu size=…/>`, which tells the guest's virtio NIC.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from agent.network.allocation_network import (
    AllocationNetworkSpec,
    VlanSegmentMember,
    apply_allocation_network,
    bridge_name,
    join_vlan_segment,
    prune_vlan_segments,
    remove_allocation_network,
    segment_bridge_name,
    segment_member_name,
    tap_names,
)
from agent.network.encapsulation import VLAN_8021Q, SegmentEncapsulation
from agent.network.errors import NetworkOperationFailed
from agent.network.netns import get_link, rtnl

# Joins and prunes of a segment must not interleave: a prune that finds a fresh segment still
# without its first member would delete it under the join. The agent is the one process that
# changes slice networks on a node, and runs host tasks on threads, so a process-wide lock
# serialises them; what a crash leaves half-done is re-derived from the links by the next call.
_SEGMENTS = threading.Lock()


@dataclass(frozen=True)
class SliceNic:
    """Where a slice VM's NIC goes: the agent's tap for it, the bridge that tap is on, and the
    MTU both have (the guest's too)."""

    bridge: str
    tap: str
    mtu: int


@dataclass(frozen=True)
class SliceNetworks:
    uplink: str | None = None  # the node's tenant-facing NIC (the segments cross it)
    netns: str | None = None  # None: the host's namespace (tests use their own)
    encapsulation: SegmentEncapsulation = VLAN_8021Q  # how a segment crosses the uplink

    def prepare(self, allocation_id: str, vlan_id: int | None) -> str:
        """Apply (idempotently) and answer the bridge the domain's NIC is on."""
        return self.prepare_nic(allocation_id, vlan_id).bridge

    def prepare_nic(self, allocation_id: str, vlan_id: int | None) -> SliceNic:
        """Apply (idempotently) and answer the VM's tap, its bridge and their MTU."""
        with _SEGMENTS:
            if vlan_id is None:
                tap = tap_names(allocation_id, 1)[0]
                spec = AllocationNetworkSpec(allocation_id, taps=(tap,))
                apply_allocation_network(spec, netns=self.netns)
                bridge = bridge_name(allocation_id)
            else:
                member = VlanSegmentMember(
                    allocation_id, vlan_id, uplink=self.uplink, encapsulation=self.encapsulation
                )
                join_vlan_segment(member, netns=self.netns)
                bridge, tap = segment_bridge_name(vlan_id), segment_member_name(allocation_id)
            # An earlier attempt may have joined another segment, and left it by now.
            prune_vlan_segments(self.netns)
            with rtnl(self.netns) as ipr:
                link = get_link(ipr, tap)
            mtu = link.get("mtu") if link is not None else None
            if not mtu:
                raise NetworkOperationFailed(f"the VM's tap {tap!r} vanished after it was made")
        return SliceNic(bridge=bridge, tap=tap, mtu=int(mtu))

    def remove(self, allocation_id: str) -> int:
        """Delete the allocation's links, then any segment it was the last one on."""
        with _SEGMENTS:
            removed = remove_allocation_network(allocation_id, netns=self.netns)
            pruned = prune_vlan_segments(self.netns)
        return len(removed.deleted) + len(pruned.deleted)
