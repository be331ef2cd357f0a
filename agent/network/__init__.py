"""Host networking for the node agent, through pyroute2 (netlink), never a shell.

* `allocation_network`: slice networks: a per-allocation isolated bridge (with an optional VLAN
  and taps), or an allocation's membership of its project's per-VLAN segment.
* `encapsulation`: how a segment crosses the node's uplink: 802.1Q (`Vlan8021Q`, the default) or
  VXLAN (`Vxlan`, VNI = the segment's VLAN id, multicast group or static peers).
* `slice_networks`: what the libvirt slice backend prepares and removes per allocation.
* `roce`: RoCE phase-2 policy routing (address, table, routes and rule per interface).

Every operation is declarative and idempotent and takes `netns` (None: the host's namespace).
"""

from agent.network.allocation_network import (
    AllocationNetworkSpec,
    NetworkApplyResult,
    NetworkRemoveResult,
    VlanSegmentMember,
    allocation_link_name,
    allocation_tag,
    apply_allocation_network,
    bridge_name,
    join_vlan_segment,
    prune_vlan_segments,
    remove_allocation_network,
    segment_bridge_name,
    segment_link_name,
    segment_member_name,
    segment_tag,
    segment_vlan_name,
    tap_names,
    vlan_name,
)
from agent.network.encapsulation import (
    DEFAULT_VXLAN_GROUP,
    VLAN_8021Q,
    VXLAN_PORT,
    SegmentEncapsulation,
    Vlan8021Q,
    Vxlan,
)
from agent.network.errors import (
    InvalidNetworkSpec,
    MissingInterface,
    NamespaceNotFound,
    NetworkConflict,
    NetworkError,
    NetworkOperationFailed,
)
from agent.network.netns import dump_state
from agent.network.roce import (
    RoceApplyResult,
    RoceAssignment,
    RoceRemoveResult,
    apply_roce_policy,
    remove_roce_policy,
    roce_rule_priority,
    roce_table_id,
)

__all__ = [
    "DEFAULT_VXLAN_GROUP",
    "VLAN_8021Q",
    "VXLAN_PORT",
    "AllocationNetworkSpec",
    "InvalidNetworkSpec",
    "MissingInterface",
    "NamespaceNotFound",
    "NetworkApplyResult",
    "NetworkConflict",
    "NetworkError",
    "NetworkOperationFailed",
    "NetworkRemoveResult",
    "RoceApplyResult",
    "RoceAssignment",
    "RoceRemoveResult",
    "SegmentEncapsulation",
    "Vlan8021Q",
    "VlanSegmentMember",
    "Vxlan",
    "allocation_link_name",
    "allocation_tag",
    "apply_allocation_network",
    "apply_roce_policy",
    "bridge_name",
    "dump_state",
    "join_vlan_segment",
    "prune_vlan_segments",
    "remove_allocation_network",
    "remove_roce_policy",
    "roce_rule_priority",
    "roce_table_id",
    "segment_bridge_name",
    "segment_link_name",
    "segment_member_name",
    "segment_tag",
    "segment_vlan_name",
    "tap_names",
    "vlan_name",
]
