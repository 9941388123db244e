"""rlvitals.service: the server (FastAPI + SQLAlchemy) that ingests metrics and tensor batches,
audits them with ``rlvitals.analyzers``, raises alerts and serves the dashboard.

``create_app(settings)`` in ``app``; ``Settings`` in ``settings``; ``rlvitals serve`` in ``cli``.
"""
