"""Integrations with model libraries, one subpackage each, none imported by ``import packing``.

- ``packing.integrations.diffusers``: pretrained diffusers video transformers (Wan 2.1 / 2.2,
  LTX-Video) trained packed; needs the ``diffusers`` extra (README: Install).
"""

__all__: list[str] = []
