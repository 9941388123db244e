"""Plugins: losses, aggregation modes, KL and advantage estimators and health rules from other packages.

A package adds to a registry by declaring a Python entry point in the registry's group; the entry
point's name is the registered name, its value the object::

    # the plugin's pyproject.toml
    [project.entry-points."rlvitals.policy_losses"]
    my_loss = "my_pkg.losses:compute_my_loss"      # fn(old_log_prob, log_prob, advantages, ...)
    [project.entry-points."rlvitals.health_rules"]
    my_rule = "my_pkg.rules:MyRule"                # a health Rule subclass

=========================== =============================================== ==========================
group                       value                                           registered with
=========================== =============================================== ==========================
``rlvitals.policy_losses``  a loss function, or a :class:`PolicyLoss`       ``register_policy_loss``
``rlvitals.agg_modes``      ``fn(loss_mat, loss_mask, *, dp_size, ...)``    ``register_agg_mode``
``rlvitals.kl_estimators``  ``fn(logprob, ref_logprob)``                    ``register_kl_estimator``
``rlvitals.adv_estimators`` ``fn(token_level_rewards, response_mask, ...)`` ``register_adv_estimator``
``rlvitals.health_rules``   a :class:`~.health.Rule` subclass               ``register_rule``
=========================== =============================================== ==========================

A value may also name a module whose decorators register the name when it is imported (the way the
built-ins do); the name must then be registered once the module is loaded. :func:`load_plugins` is
idempotent: an entry whose object is already registered under its name is counted, not registered
twice. A name that a built-in or another plugin already took, an entry point that fails to import, or
an object of the wrong kind raises :class:`PluginError`, naming the distribution and the entry point:
the server refuses to start rather than refuse that plugin's batches later.

``rlvitals serve`` (and every ``create_app``) loads every installed plugin before the health rules
are read, and prints what it loaded. ``RLVITALS_PLUGINS=0`` turns loading off.
"""

from __future__ import annotations

import importlib.metadata as metadata
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GROUPS", "LoadedPlugin", "PluginError", "load_plugins"]


class PluginError(ValueError):
    """An installed plugin could not be loaded (import error, wrong kind of object, name taken)."""


@dataclass(frozen=True)
class LoadedPlugin:
    """One entry point that is now registered: its group, registered name and distribution."""

    group: str
    name: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.group.removeprefix('rlvitals.')}:{self.name} ({self.distribution} {self.version})"


def _policy_losses() -> tuple[dict, Callable[[str, Any], None]]:
    from .reference.policy_losses import POLICY_LOSSES, PolicyLoss, register_policy_loss

    def register(name: str, obj: Any) -> None:
        if isinstance(obj, PolicyLoss):
            register_policy_loss(name, random=obj.random, bounds=obj.bounds, uses_agg_mode=obj.uses_agg_mode)(
                obj.fn
            )
        elif callable(obj):
            register_policy_loss(name)(obj)
        else:
            raise TypeError(f"expected a loss function or a PolicyLoss, got {type(obj).__name__}")

    return {k: v.fn for k, v in POLICY_LOSSES.items()}, register


def _plain(module: str, registry: str, decorator: str) -> Callable[[], tuple[dict, Callable]]:
    def get() -> tuple[dict, Callable[[str, Any], None]]:
        mod = importlib_module(module)

        def register(name: str, obj: Any) -> None:
            if not callable(obj):
                raise TypeError(f"expected a function, got {type(obj).__name__}")
            getattr(mod, decorator)(name)(obj)

        return getattr(mod, registry), register

    return get


def _health_rules() -> tuple[dict, Callable[[str, Any], None]]:
    from .health.registry import RULES, Rule, register_rule

    def register(name: str, obj: Any) -> None:
        if not (isinstance(obj, type) and issubclass(obj, Rule)):
            raise TypeError(f"expected a health Rule subclass, got {obj!r}")
        register_rule(name)(obj)

    return dict(RULES), register


def importlib_module(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(f"{__package__}.{name}")


# group -> () -> (the registry as {name: registered object}, register(name, obj))
GROUPS: dict[str, Callable[[], tuple[dict, Callable[[str, Any], None]]]] = {
    "rlvitals.policy_losses": _policy_losses,
    "rlvitals.agg_modes": _plain("reference.losses", "AGG_MODES", "register_agg_mode"),
    "rlvitals.kl_estimators": _plain("reference.losses", "KL_ESTIMATORS", "register_kl_estimator"),
    "rlvitals.adv_estimators": _plain("reference.advantages", "ADV_ESTIMATORS", "register_adv_estimator"),
    "rlvitals.health_rules": _health_rules,
}


def _where(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else ("?", "?")


def load_plugins(groups: tuple[str, ...] | None = None) -> list[LoadedPlugin]:
    """Register every installed entry point of ``groups`` (default: all of :data:`GROUPS`).

    Returns what is registered, in group then entry-point order. Raises :class:`PluginError` on the
    first entry point that cannot be registered.
    """
    loaded: list[LoadedPlugin] = []
    installed: metadata.EntryPoints | None = None  # read once: each read opens every distribution's metadata
    for group in groups or tuple(GROUPS):
        if group not in GROUPS:
            raise PluginError(f"unknown plugin group {group!r}; groups: {', '.join(GROUPS)}")
        if installed is None:
            installed = metadata.entry_points()
        for ep in sorted(installed.select(group=group), key=lambda e: e.name):
            dist, version = _where(ep)
            where = f"plugin {dist} {version}: entry point {ep.name} = {ep.value!r} in {group}"
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginError(f"{where} failed to import: {exc.__class__.__name__}: {exc}") from exc
            registry, register = GROUPS[group]()
            current = registry.get(ep.name)
            if isinstance(obj, types.ModuleType):
                if current is None:
                    raise PluginError(f"{where}: importing the module did not register {ep.name!r}")
            elif current is None:
                try:
                    register(ep.name, obj)
                except (TypeError, ValueError) as exc:
                    raise PluginError(f"{where}: {exc}") from exc
            elif current is not _unwrap(obj):
                raise PluginError(f"{where}: the name {ep.name!r} is already registered by {current!r}")
            loaded.append(LoadedPlugin(group, ep.name, dist, version))
    return loaded


def _unwrap(obj: Any) -> Any:
    from .reference.policy_losses import PolicyLoss

    return obj.fn if isinstance(obj, PolicyLoss) else obj
