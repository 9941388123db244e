"""Runnable examples, installed as ``rlvitals.examples`` so ``rlvitals demo`` works from a wheel."""
