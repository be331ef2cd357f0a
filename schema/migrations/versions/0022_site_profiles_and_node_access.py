"""site profiles as the policy surface (docs/maas-sites.md#site-profiles: every run knob per
profile, status, description, the site's default profile), the node's access fields
(docs/lifecycles/node.md#access-fields), and no recommended operator action on closed jobs

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-25 00:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Each knob a run uses (contracts.onboarding.SitePolicyView, but enable_phase2_roce, which the
# profile has had since 0009): NULL falls back to the site policy's value.
_KNOBS: list[tuple[str, sa.types.TypeEngine[object]]] = [
    ("strict_pxe_preflight", sa.Boolean()),
    ("require_hw_sync", sa.Boolean()),
    ("hardware_sync_interval", sa.String(length=16)),
    ("release_fallback_no_erase", sa.Boolean()),
    ("enable_deploy_retry_on_datasource_failure", sa.Boolean()),
    ("max_deploy_retry_attempts", sa.Integer()),
    ("auto_claim_single_new_machine", sa.Boolean()),
    ("batch_max_parallel", sa.Integer()),
    ("site_bootstrap_bundle_ref", sa.String(length=300)),
    ("enrollment_token_ttl_seconds", sa.Integer()),
    ("maas_poll_interval_ms", sa.Integer()),
    ("discovery_timeout_seconds", sa.Integer()),
    ("commission_timeout_seconds", sa.Integer()),
    ("deploy_timeout_seconds", sa.Integer()),
    ("hw_sync_seed_timeout_seconds", sa.Integer()),
    ("hw_sync_health_timeout_seconds", sa.Integer()),
    ("enrollment_timeout_seconds", sa.Integer()),
    ("roce_failures_stop_job", sa.Boolean()),
    ("pxe_vlan_vid", sa.Integer()),
]

# The bounds of maas_site_policies' checks (a NULL override passes them).
_CHECKS = {
    "profile_deploy_retries": "max_deploy_retry_attempts BETWEEN 0 AND 10",
    "profile_batch_parallel": "batch_max_parallel BETWEEN 1 AND 500",
    "profile_enrollment_ttl": "enrollment_token_ttl_seconds > 0",
    "profile_hw_sync_interval": "hardware_sync_interval ~ '^[0-9]+[smh]$'",
    "profile_poll_interval": "maas_poll_interval_ms BETWEEN 10 AND 600000",
    "profile_timeouts_positive": (
        "LEAST(discovery_timeout_seconds, commission_timeout_seconds, deploy_timeout_seconds,"
        " hw_sync_seed_timeout_seconds, hw_sync_health_timeout_seconds,"
        " enrollment_timeout_seconds) > 0"
    ),
    "profile_vlan": "pxe_vlan_vid BETWEEN 0 AND 4094",
    "maas_site_profiles_status": "status IN ('active', 'disabled')",
}


def upgrade() -> None:
    op.add_column("maas_site_profiles", sa.Column("description", sa.Text(), nullable=True))
    op.add_column(
        "maas_site_profiles",
        sa.Column(
            "status", sa.String(length=16), server_default=sa.text("'active'"), nullable=False
        ),
    )
    for name, type_ in _KNOBS:
        op.add_column("maas_site_profiles", sa.Column(name, type_, nullable=True))
    for name, condition in _CHECKS.items():
        op.create_check_constraint(name, "maas_site_profiles", condition)

    op.add_column("maas_sites", sa.Column("default_profile_id", sa.UUID(), nullable=True))
    op.create_foreign_key(
        "maas_sites_default_profile_id_fkey",
        "maas_sites",
        "maas_site_profiles",
        ["default_profile_id"],
        ["id"],
    )
    # Until now the profile named "default" (created with the site) was the default.
    op.execute(
        "UPDATE maas_sites s SET default_profile_id = p.id FROM maas_site_profiles p"
        " WHERE p.site_id = s.id AND p.name = 'default'"
    )

    op.add_column(
        "nodes", sa.Column("port", sa.Integer(), server_default=sa.text("22"), nullable=False)
    )
    op.add_column(
        "nodes",
        sa.Column(
            "ssh_username", sa.String(length=64), server_default=sa.text("'root'"), nullable=False
        ),
    )
    op.add_column(
        "nodes",
        sa.Column(
            "access_method",
            sa.String(length=32),
            server_default=sa.text("'node_agent'"),
            nullable=False,
        ),
    )
    op.create_check_constraint("nodes_port", "nodes", "port BETWEEN 1 AND 65535")

    # A closed job recommends no operator action (cancelled ones kept their failure's).
    for table in ("node_onboardings", "node_decommissions"):
        op.execute(
            f"UPDATE {table} SET recommended_action = NULL"  # noqa: S608 - fixed table names
            " WHERE status IN ('completed', 'reconciled', 'cancelled')"
            " AND recommended_action IS NOT NULL"
        )


def downgrade() -> None:
    op.drop_constraint("nodes_port", "nodes", type_="check")
    for name in ("access_method", "ssh_username", "port"):
        op.drop_column("nodes", name)
    op.drop_constraint("maas_sites_default_profile_id_fkey", "maas_sites", type_="foreignkey")
    op.drop_column("maas_sites", "default_profile_id")
    for name in _CHECKS:
        op.drop_constraint(name, "maas_site_profiles", type_="check")
    for name, _ in reversed(_KNOBS):
        op.drop_column("maas_site_profiles", name)
    op.drop_column("maas_site_profiles", "status")
    op.drop_column("maas_site_profiles", "description")
