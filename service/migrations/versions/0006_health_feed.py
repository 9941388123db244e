"""health_feed: what each metrics write stored, for the health evaluator that runs the rules after the
write has answered (one row per write: the run, its step range and metric names; deleted in the
evaluation's own transaction, so a row present is a write not yet evaluated).

Revision ID: 0006_health_feed
Revises: 0005_incidents
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_health_feed"
down_revision = "0005_incidents"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "health_feed",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("run_id", _ID, nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("names", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_health_feed_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_health_feed")),
    )
    op.create_index("ix_health_feed_run_id_id", "health_feed", ["run_id", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_health_feed_run_id_id", table_name="health_feed")
    op.drop_table("health_feed")
