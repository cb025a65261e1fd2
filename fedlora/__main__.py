"""``python -m fedlora …`` is the ``fedlora`` command (works from a source checkout, without an install)."""
import sys

from .cli import main

sys.exit(main())
