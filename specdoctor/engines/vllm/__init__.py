"""The vLLM plugin (entry point `vllm.general_plugins: specdoctor`): inert unless specdoctor starts vLLM with
REPORTS set; then each worker, once its target and drafter are loaded, writes the report of its drafter tables.
docs/vllm-plugin.md says what it touches in vLLM and why."""

REPORTS = "SPECDOCTOR_VLLM_REPORTS"  # a directory: each worker writes `tp{T}-pp{P}.json` there
REPAIR = "SPECDOCTOR_VLLM_REPAIR"  # "1": repair what the examination finds, examine again, stop if still wrong
FAULT = "SPECDOCTOR_VLLM_FAULT"  # a fault made in the worker's drafter before it is examined (the tests' switch)
SUPPORTED_VERSIONS = ("0.32",)  # the vLLM releases whose loading the plugin was read against and tested with
