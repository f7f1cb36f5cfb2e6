"""The oracle tools' environments by the name `pytest.mark.tool_env` gives them."""

from tests.peer.vllm_env import VLLM
from tests.tools.quant_env import QUANT
from tests.tools.speculators_env import SPECULATORS

TOOL_ENVS = {env.name: env for env in (VLLM, QUANT, SPECULATORS)}
