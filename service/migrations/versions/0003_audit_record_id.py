"""audits.record_id: the client's id of an upload, unique per run, so a resent batch is stored (and
audited) once.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audits") as batch:
        batch.add_column(sa.Column("record_id", sa.String(length=128), nullable=True))
        batch.create_index("uq_audits_run_id_record_id", ["run_id", "record_id"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("audits") as batch:
        batch.drop_index("uq_audits_run_id_record_id")
        batch.drop_column("record_id")
