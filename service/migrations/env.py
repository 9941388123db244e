"""Alembic environment: runs on the connection ``Database.migrate`` hands over (or on the URL in
the config when invoked as ``alembic -c service/alembic.ini``)."""

from __future__ import annotations

from alembic import context
from rlvitals.service.storage.models import metadata
from sqlalchemy import create_engine

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
