"""The oracle tools' environments (speculators, the quantisation tools) and the scripts run inside them."""

from pathlib import Path

TOOLS = Path(__file__).resolve().parent
