"""The oracle tools' environments by the name `pytest.mark.tool_env` gives them."""

from tests.eagle3.spec_env import SPECULATORS
from tests.peer.vllm_env import VLLM
from tests.quant.quant_env import QUANT

TOOL_ENVS = {env.name: env for env in (VLLM, QUANT, SPECULATORS)}
