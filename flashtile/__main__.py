"""``python -m flashtile <command>``; see :mod:`flashtile.cli`."""
from .cli import main

raise SystemExit(main())
