"""toolcalc: arithmetic and price lookups through a tool API that drifts (v1, v2, v3)."""

from services.environments.toolcalc.api import TOOLCALC_API_VERSIONS, ToolAPI, get_api
from services.environments.toolcalc.env import REWARD_ID, ToolcalcEnvironment
from services.environments.toolcalc.tasks import PRICES_USD, UnverifiableRequest, solve

__all__ = [
    "PRICES_USD",
    "REWARD_ID",
    "TOOLCALC_API_VERSIONS",
    "ToolAPI",
    "ToolcalcEnvironment",
    "UnverifiableRequest",
    "get_api",
    "solve",
]
