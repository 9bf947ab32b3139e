"""The job-contract variables that point a job at a rollout server (the remote backend,
:mod:`services.inference.remote`, reads them; the worker sets them from its settings).

Standard library only: the worker builds them for every job, and the api reaches the
worker's job code through the workflows, so this module must not bring torch along.
"""

from __future__ import annotations

ENV_PREFIX = "RATCHET_ROLLOUT_"
URL_ENV = f"{ENV_PREFIX}URL"
MODEL_ENV = f"{ENV_PREFIX}MODEL"
SHARED_DIR_ENV = f"{ENV_PREFIX}SHARED_DIR"
API_KEY_ENV = f"{ENV_PREFIX}API_KEY"  # the default variable holding the server's key
