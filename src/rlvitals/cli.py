"""The ``rlvitals`` command line.

Each package contributes its subcommands through ``register(subparsers)``; modules are imported
lazily so a client-only install still runs ``rlvitals sync`` without the server stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = (
    "rlvitals: training-health diagnostics for PPO/GRPO trainers (loss audits, health rules, alerts, "
    "live dashboards)."
)
# Each module exposes `register(subparsers)`.
_COMMAND_MODULES = (
    "rlvitals.service.cli",
    "rlvitals.client.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from rlvitals import __version__

    parser = argparse.ArgumentParser(prog="rlvitals", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"rlvitals {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # package part not written yet
            if exc.name and exc.name.startswith("rlvitals"):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
