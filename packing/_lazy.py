"""The one boundary where optional heavy dependencies are imported.

``import packing`` needs only torch and numpy. Readers of LeRobot and Hugging Face datasets
call :func:`require` inside functions and constructors, so the optional package is imported
the first time it is used, and a missing one fails with the command that installs it::

    pa = require("pyarrow", extra="lerobot")
    # ModuleNotFoundError: this feature needs 'pyarrow', which is not installed;
    # install it with: pip install 'packing[lerobot]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str) -> ModuleType:
    """Import ``module`` or raise ``ModuleNotFoundError`` naming ``pip install 'packing[extra]'``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        # Only translate the error when the missing module is the one we asked for; an error
        # raised *inside* an installed package (a broken install) must surface unchanged.
        if e.name is not None and e.name.split(".")[0] != top:
            raise
        raise ModuleNotFoundError(
            f"this feature needs {top!r}, which is not installed; "
            f"install it with: pip install 'packing[{extra}]'",
            name=e.name,
        ) from e
