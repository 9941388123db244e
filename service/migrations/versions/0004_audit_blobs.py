"""audit_blobs: an upload's tensors in a table of their own (the blob the row's last column), so that
SQLite never rebuilds them in memory when an audit's status changes; the blobs of pending audits move
there, and audits.blob stays, always NULL.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "audit_blobs",
        sa.Column("id", _ID, autoincrement=False, nullable=False),
        sa.Column("blob", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["id"], ["audits.id"], name=op.f("fk_audit_blobs_id_audits"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_blobs")),
    )
    if op.get_bind().dialect.name == "postgresql":  # uncompressed: chunked reads are plain slices
        op.execute("ALTER TABLE audit_blobs ALTER COLUMN blob SET STORAGE EXTERNAL")
    op.execute("INSERT INTO audit_blobs (id, blob) SELECT id, blob FROM audits WHERE blob IS NOT NULL")
    op.execute("UPDATE audits SET blob = NULL WHERE blob IS NOT NULL")


def downgrade() -> None:
    op.execute("UPDATE audits SET blob = (SELECT blob FROM audit_blobs WHERE audit_blobs.id = audits.id)")
    op.drop_table("audit_blobs")
