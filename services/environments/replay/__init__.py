"""replay: tasks from any OpenAI-tools agent's traces, tools replayed from recorded results."""

from services.environments.replay.env import ENVIRONMENT_NAME, REWARD_ID, ReplayEnvironment
from services.environments.replay.judge import Judge, JudgeEndpoint, JudgeError
from services.environments.replay.records import STORE_FILE, RecordedCall, recorded_calls
from services.environments.replay.tool_config import ToolEndpointConfig
from services.environments.replay.tool_endpoints import LiveToolEndpoint

__all__ = [
    "ENVIRONMENT_NAME",
    "REWARD_ID",
    "STORE_FILE",
    "Judge",
    "JudgeEndpoint",
    "JudgeError",
    "LiveToolEndpoint",
    "RecordedCall",
    "ReplayEnvironment",
    "ToolEndpointConfig",
    "recorded_calls",
]
