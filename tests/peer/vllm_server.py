"""vLLM's OpenAI-compatible server, started from the peer environment on loopback and stopped again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from specdoctor.probe import prometheus
from specdoctor.runtime.decode.metrics import SpecMetrics
from tests.helpers.servers import free_port
from tests.peer.vllm_env import PeerUnavailable, ensure_vllm

START_TIMEOUT_S = 400  # measured start-up on 2 cores: 80-100 s compiled, about 30 s eager
# What the CPU build needs on a small machine: 1 GiB of KV cache space.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on the model, fp32 (or `dtype`), greedy-capable, MTP with k drafts
    (`drafter`: the speculative config's method and model of a drafter checkpoint instead; `schedule`: k by the
    batch's rows, vLLM's dynamic speculation; `extra_args`: more of vLLM's flags). `eager`: without
    vLLM's torch.compile step (a minute of start-up on 2 cores; the oracle tests' tokens and counters are the
    same either way, checked); the speed benchmarks keep vLLM's defaults."""

    def __init__(
        self,
        model: Path,
        k: int,
        served_name: str = "demo",
        extra_env: dict | None = None,
        eager: bool = False,
        drafter: dict | None = None,
        tp: int = 1,
        schedule: list[tuple[int, int, int]] | None = None,
        extra_args: tuple[str, ...] = (),
        dtype: str = "float32",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)
        command = [str(ensure_vllm()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        command += ["--served-model-name", served_name, "--dtype", dtype, "--max-model-len", "512"]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        # Prefix caching as vLLM defaults it (on), said aloud; its hits reported in usage for the probe's sweep.
        command += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
        if k:
            speculative = {"method": "mtp", **(drafter or {}), "num_speculative_tokens": k}
            if schedule:  # dynamic speculation: (first rows, last rows, k) ranges
                speculative["num_speculative_tokens_per_batch_size"] = schedule
            command += ["--speculative-config", json.dumps(speculative)]
        if eager:
            command += ["--enforce-eager"]
        command += extra_args
        env = os.environ | SERVER_ENV | (extra_env or {})
        if tp > 1:
            # vLLM's CPU workers bind their threads per NUMA node and refuse more workers than nodes ("Not enough
            # allowed NUMA nodes to bind threads of 2 local CPUWorkers"): one core each, bound by hand.
            command += ["--tensor-parallel-size", str(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._wait_until_healthy()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(f"vLLM's server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise PeerUnavailable(f"vLLM's server did not answer /health within {START_TIMEOUT_S} s: {self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        return " | ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the engine core is a child process of its own
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


def scrape(url: str) -> tuple[SpecMetrics, float]:
    """vLLM's speculative counters and its generation-token counter."""
    samples = prometheus.parse(httpx.get(f"{url}/metrics", timeout=30).text)
    return prometheus.spec_counters(samples), prometheus.counter(samples, "vllm:generation_tokens") or 0.0


def completion_with_counters(
    url: str, prompt_ids: list[int], max_tokens: int, extra: dict | None = None
) -> tuple[list[int], SpecMetrics]:
    """One greedy request's token ids and its own speculative counters (the /metrics difference around it;
    sent alone, so nothing else is counted). `extra`: more request fields."""
    before, generated = scrape(url)
    body = {"model": "demo", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    body |= extra or {}
    tokens = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    deadline = time.monotonic() + 30
    while True:  # the counters are recorded just after the response is sent: wait until they hold this request
        after, now = scrape(url)
        if now >= generated + len(tokens) or time.monotonic() > deadline:
            return tokens, prometheus.difference(after, before)
        time.sleep(0.05)
