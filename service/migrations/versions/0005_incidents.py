"""incidents: findings of one cause and time window as one problem, and webhook deliveries that
point at the incident they announce.

Revision ID: 0005_incidents
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_incidents"
down_revision = "0004"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "incidents",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("run_id", _ID, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("cause", sa.String(length=100), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("severity", sa.String(length=20), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("primary_rule", sa.String(length=100), nullable=False),
        sa.Column("onset_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("resolved_step", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("advice", sa.Text(), nullable=False),
        sa.Column("members", sa.JSON(), nullable=False),
        sa.Column("findings", sa.JSON(), nullable=False),
        sa.Column("dropped_findings", sa.Integer(), nullable=False),
        sa.Column("reopened", sa.Integer(), nullable=False),
        sa.Column("confirmed", sa.Boolean(), nullable=False),
        sa.Column("notified_severity", sa.String(length=20), nullable=True),
        sa.Column("onset_time", sa.Double(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("resolved_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_incidents_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incidents")),
        sa.UniqueConstraint("run_id", "number", name=op.f("uq_incidents_run_id_number")),
    )
    op.create_index("ix_incidents_state", "incidents", ["state"], unique=False)
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.add_column(sa.Column("incident_id", _ID, nullable=True))
        batch.create_foreign_key(
            op.f("fk_webhook_deliveries_incident_id_incidents"),
            "incidents",
            ["incident_id"],
            ["id"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.drop_constraint(op.f("fk_webhook_deliveries_incident_id_incidents"), type_="foreignkey")
        batch.drop_column("incident_id")
    op.drop_index("ix_incidents_state", table_name="incidents")
    op.drop_table("incidents")
