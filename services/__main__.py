"""``python -m services`` is the ``ratchet`` command."""

import sys

from services.cli import main

sys.exit(main())
