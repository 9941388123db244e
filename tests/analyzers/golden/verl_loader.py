"""Import the real verl 0.9.1 loss code without its heavy runtime (only the golden generator and the
benchmark use this; the test suite never needs verl).

verl imports ray, datasets, PIL and pandas at module level but never touches them on the loss paths
(``core_algos.agg_loss`` / ``compute_policy_loss_vanilla`` / ``kl_penalty`` /
``compute_grpo_outcome_advantage`` and ``workers.utils.losses.ppo_loss``). Inert stand-ins in
``sys.modules`` let those modules import; any real use of a stand-in fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import ClassVar

_STUBBED = ("ray", "datasets", "PIL", "pandas", "pyarrow", "wandb", "mlflow", "swanlab")


class _Inert(types.ModuleType):
    """A module whose every attribute is another inert module (classes/decorators resolve to it)."""

    __path__: ClassVar[list[str]] = []

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _Inert(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        # used as a decorator (@ray.remote) or a base class factory: hand back the wrapped thing
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module):
        return None


def load_verl():
    """Return ``(core_algos, losses_module, torch_functional)`` from the installed verl."""
    if not any(isinstance(f, _InertFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _InertFinder())
    import verl
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional
    from verl.workers.utils import losses

    if verl.__version__ != "0.9.1":
        raise RuntimeError(f"golden data must come from verl 0.9.1; found {verl.__version__}")
    return core_algos, losses, torch_functional
