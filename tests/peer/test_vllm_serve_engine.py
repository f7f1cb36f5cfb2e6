"""`serve --engine vllm`: vLLM's own server, specdoctor's plugin repairing each worker's drafter at load. With
the seed's failure made in the worker it comes up repaired and `probe` passes it; with a drafter it cannot repair
it does not come up (exit 2), and says which tensor on which worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from specdoctor.engines.vllm import FAULT
from tests.helpers.eagle3 import TARGET_LAYERS, write_head
from tests.helpers.families import save_dense_checkpoint
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.timeout(900), pytest.mark.tool_env("vllm"), pytest.mark.tool_env("speculators")]

START_TIMEOUT_S = 400  # an eager vLLM server starts in 50-60 s on 2 cores (tests/peer/vllm_server.py)
SERVE_FLAGS = ["--enforce-eager", "--max-model-len", "256"]  # the Llama target's position range


def serve_in_vllm(vllm_python, log_path, model: list[str], fault: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [str(vllm_python), "-m", "specdoctor", "serve", "--engine", "vllm", *model, "--port", str(port)]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", FAULT: fault}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, *SERVE_FLAGS], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return process, f"http://127.0.0.1:{port}"


def up_or_exited(process: subprocess.Popen, url: str) -> bool:
    """True once /health answers 200; False once the server has exited."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(1)
    assert process.poll() is not None, f"neither up nor exited within {START_TIMEOUT_S} s"
    return False


def stop(process: subprocess.Popen) -> int:
    """SIGTERM to specdoctor alone: it stops vLLM and everything vLLM started."""
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=120)


def test_a_vllm_deployment_with_the_seeds_failure_comes_up_repaired_and_probe_passes(vllm_python, tmp_path):
    log = tmp_path / "serve.log"
    process, url = serve_in_vllm(vllm_python, log, ["--model", "demo"], "embedding-zeroed")
    try:
        assert up_or_exited(process, url), log.read_text()[-3000:]
        probe = [sys.executable, "-m", "specdoctor", "probe", "--url", url]
        result = subprocess.run(probe, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    finally:
        code = stop(process)
    assert code == 143
    assert "specdoctor: worker TP 0, PP 0: repaired embed_tokens.weight from the checkpoint's model.embed_tokens" in (
        log.read_text()
    )


@pytest.fixture(scope="module")
def pruned_eagle3_pair(tmp_path_factory):
    """A Llama target transformers saved (head_dim 32: vLLM's CPU attention takes no smaller) and an EAGLE-3 head
    speculators wrote for it over a pruned vocabulary (200 of 320 tokens, with its d2t map)."""
    root = tmp_path_factory.mktemp("pruned-eagle3")
    save_dense_checkpoint(root / "target", "LlamaForCausalLM", 0, num_hidden_layers=TARGET_LAYERS, head_dim=32)
    return root / "target", write_head(root / "head", root / "target", 200)


def test_a_drafter_that_cannot_be_repaired_keeps_the_deployment_down_naming_it(
    vllm_python, tmp_path, pruned_eagle3_pair
):
    """The EAGLE-3 head over the pruned vocabulary replaced by the target's: the table is the target's own tensor,
    which a repair in place would change, so the worker stops and serve exits 2, naming tensor and worker."""
    target, head = pruned_eagle3_pair
    log = tmp_path / "serve.log"
    pair = ["--model", str(target), "--speculative-model", str(head), "--skip-tokenizer-init"]  # it has none
    process, url = serve_in_vllm(vllm_python, log, pair, "head-target-over-pruned-vocab")
    try:
        assert not up_or_exited(process, url)
    finally:
        if process.poll() is None:
            stop(process)
    output = log.read_text()
    assert process.returncode == 2, output[-3000:]
    assert (
        "specdoctor: error: the drafter cannot be repaired on vLLM worker tp0-pp0: lm_head.weight: rows 0..256 do not "
        "hold lm_head.weight's rows; it is the target's own tensor, which a repair in place would change" in output
    ), output[-3000:]
