"""Activities of NodeDecommissionWorkflow (docs/lifecycles/decommission.md): control-plane stages
(control_plane.py, composed from node_inventory, draining, maas_release, removal, operator_actions
and bookkeeping over stage_runtime; disk_disposition records where the disks went), reimage stages
that reuse the onboarding stage bodies (reimage.py), and the read model."""
