"""``python -m services.modelserver --checkpoint DIR``: the model server (as ``ratchet serve``)."""

import sys

from services.cli.serve import main

sys.exit(main())
