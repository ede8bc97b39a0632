"""Everything packing imports later than ``import packing``, each kind of import one way.

``import packing`` needs only torch, numpy, einops and pyarrow installed, and imports none of
them until a name is used. Two kinds of import are deferred, and this module is the only
place that does it:

1. **The package's own names** (:func:`lazy_names`, PEP 562): ``packing.PackedCollator``
   imports ``packing.data._collate`` on first use, so ``packing --help`` does not pay for torch.
2. **Optional dependencies** (:func:`require`): imported inside the function or constructor
   that needs them, so a missing one fails there, with the command that installs it::

       lerobot_dataset = require("lerobot.datasets.lerobot_dataset", extra="lerobot")
       # ModuleNotFoundError: this feature needs 'lerobot', which is not installed;
       # install it with: pip install -e '.[lerobot]' -c constraints.txt (in packing's
       # checkout; from a wheel: pip install 'packing-<version>-py3-none-any.whl[lerobot]')

   ``extra=None`` marks a core dependency (pyarrow: the LeRobot root reader and `packing
   verify` need only it); missing, it is a broken install, and the hint names the package.
   An optional *accelerator* that no extra installs (flash-attn-4) is asked about with
   :func:`probe`, which says why it is unusable instead of raising: callers pick another
   kernel.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from types import ModuleType
from typing import Any

__all__ = ["install_hint", "lazy_names", "probe", "require"]

# The extras that pull lerobot, which pins torch < 2.12: pip needs constraints.txt to pick
# versions without backtracking for ever.
CONSTRAINED = frozenset({"lerobot", "encode", "lingbot"})


def install_hint(extra: str) -> str:
    """The command that installs ``extra``. packing is installed from its checkout or a built
    wheel, not from an index, where ``packing[extra]`` would name someone else's package."""
    pin = " -c constraints.txt" if extra in CONSTRAINED else ""
    return (
        f"pip install -e '.[{extra}]'{pin} (in packing's checkout; from a wheel: "
        f"pip install 'packing-<version>-py3-none-any.whl[{extra}]'{pin})"
    )


def require(module: str, *, extra: str | None) -> ModuleType:
    """Import ``module`` or raise ``ModuleNotFoundError`` naming the command that installs
    ``extra`` (`install_hint`; ``extra=None``: a core dependency, ``pip install <module>``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        # Only translate the error when the missing module is the one we asked for; an error
        # raised *inside* an installed package (a broken install) must surface unchanged.
        if e.name is not None and e.name.split(".")[0] != top:
            raise
        fix = f"pip install {top}" if extra is None else install_hint(extra)
        raise ModuleNotFoundError(
            f"this feature needs {top!r}, which is not installed; install it with: {fix}",
            name=e.name,
        ) from e


@cache
def probe(module: str, *, package: str) -> str | None:
    """None when ``module`` imports; else why not, naming ``package`` (the distribution).

    A broken install is reported as broken, not as absent::

        probe("flash_attn.cute.interface", package="flash-attn-4")
        # 'flash-attn-4 not installed', or
        # "flash-attn-4 found but flash_attn.cute.interface failed to import (ImportError(...))"

    Cached: the answer cannot change within a process.
    """
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{package} not installed"
    try:
        importlib.import_module(module)
    except Exception as err:  # any import failure makes it unusable here; say which
        return f"{package} found but {module} failed to import ({err!r})"
    return None


def lazy_names(
    namespace: dict[str, Any], modules: Mapping[str, Sequence[str]]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each name of ``modules`` ({module: names}) from
    its module on first use and stores it in ``namespace`` (later lookups skip the call)."""
    home = {name: module for module, names in modules.items() for name in names}
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in home:
            value = getattr(importlib.import_module(home[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
