"""The one boundary where optional heavy dependencies are imported.

``import packing`` needs only torch and numpy. Readers of LeRobot and Hugging Face datasets
call :func:`require` inside functions and constructors, so the optional package is imported
the first time it is used, and a missing one fails with the command that installs it::

    lerobot_dataset = require("lerobot.datasets.lerobot_dataset", extra="lerobot")
    # ModuleNotFoundError: this feature needs 'lerobot', which is not installed;
    # install it with: pip install 'packing[lerobot]'

``extra=None`` marks a core dependency (pyarrow: the LeRobot root reader and `packing verify`
need only it); missing, it is a broken install, and the hint names the package itself.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str | None) -> ModuleType:
    """Import ``module`` or raise ``ModuleNotFoundError`` naming ``pip install 'packing[extra]'``
    (``extra=None``: a core dependency, ``pip install <module>``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        # Only translate the error when the missing module is the one we asked for; an error
        # raised *inside* an installed package (a broken install) must surface unchanged.
        if e.name is not None and e.name.split(".")[0] != top:
            raise
        fix = f"pip install {top}" if extra is None else f"pip install 'packing[{extra}]'"
        raise ModuleNotFoundError(
            f"this feature needs {top!r}, which is not installed; install it with: {fix}",
            name=e.name,
        ) from e
