"""Persistence: SQLAlchemy 2 tables (``models``), engines and migrations (``database``), and the one
module every query lives in (``repository``)."""
