"""``python -m flashinfer_jit``: the ``flashinfer-jit`` command, where no script is installed."""

import sys

from .cli import main

sys.exit(main())
