"""``python -m services.serving``: the model server's command of earlier releases, kept so
scripts and manifests that start it this way keep working; the model server is
``python -m services.modelserver`` (and ``ratchet serve``)."""

import sys

from services.cli.serve import main

sys.exit(main())
