"""``python -m packing verify``: the same as the ``packing`` console script."""

from packing.cli import main

raise SystemExit(main())
