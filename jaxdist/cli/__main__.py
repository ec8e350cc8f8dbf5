"""``python -m jaxdist.cli`` runs the ``jaxdist`` command."""

import sys

from jaxdist.cli import main

sys.exit(main())
