"""The public surface: every exported name resolves; `import packing` stays light."""

from __future__ import annotations

import subprocess
import sys
import types

import packing


def test_every_exported_name_resolves():
    missing = [n for n in packing.__all__ if getattr(packing, n, None) is None]
    assert missing == []


def test_submodules_are_not_shadowed_by_exported_names():
    import packing.attention as attention_module

    assert isinstance(attention_module, types.ModuleType)
    assert callable(attention_module.packed_attention)


def test_import_packing_needs_only_torch_numpy_einops():
    code = (
        "import sys, packing; "
        "heavy = [m for m in ('lerobot', 'datasets', 'pyarrow', 'matplotlib', 'pandas', 'diffusers') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
