"""Every runtime option declared once: vLLM's flag spellings, --speculative-config, Hugging Face ids
from the local cache, and the layering the options travel through."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.registry import options_from_speculative_config, speculative_method
from specdoctor.runtime.options import RuntimeOptions
from tests.commands.test_check import specdoctor

PACKAGE = Path(__file__).resolve().parents[2] / "specdoctor"


def generate_json(*flags: str) -> dict:
    args = ("generate", "--model", "demo", "--prompt", "def main(", "--max-tokens", "12", "--json", "-")
    result = specdoctor(*args, *flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_vllm_spellings_run_the_same_engine_as_the_short_flags():
    short = generate_json("--pp", "2", "--num-speculative-tokens", "2")
    config = '{"method":"mtp","num_speculative_tokens":2}'
    vllm = generate_json("--pipeline-parallel-size", "2", "--speculative-config", config)
    dash = generate_json(
        "-pp", "2", "--tensor-parallel-size", "1", "--speculative-config", '{"num_speculative_tokens":2}'
    )
    assert short["pp"] == vllm["pp"] == dash["pp"] == 2
    assert short["num_speculative_tokens"] == vllm["num_speculative_tokens"] == 2
    assert short["outputs"] == vllm["outputs"] == dash["outputs"]
    assert short["metrics"] == vllm["metrics"] == dash["metrics"] and short["metrics"]["num_drafts"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--speculative-config", "{not json"), "--speculative-config is not valid JSON"),
        (("--speculative-config", '{"method":"ngram","num_speculative_tokens":2}'), "method 'ngram' is not run"),
        (
            ("--speculative-config", '{"method":"mtp","num_speculative_tokens":2,"model":"x"}'),
            "'mtp' takes no \"model\"",
        ),
        (("--speculative-config", '{"method":"dspark","num_speculative_tokens":2}'), "'dspark' needs \"model\""),
        (("--speculative-config", '{"method":"mtp","num_speculative_tokens":2,"eta":1}'), "eta not supported"),
        (("--speculative-model", "/nonexistent/drafter"), "drafter directory not found"),
        (("--speculative-config", '{"method":"mtp"}'), "num_speculative_tokens must be an integer"),
        (
            ("--num-speculative-tokens", "4", "--speculative-config", '{"num_speculative_tokens":2}'),
            "contradicts --speculative-config",
        ),
        (("--tensor-parallel-size", "3"), "--tensor-parallel-size 3: 2 KV heads neither divide over nor replicate"),
        (("--pipeline-parallel-size", "0"), "--pp must be at least 1"),
        (("--num-speculative-tokens", "9"), "must be in 0..8"),
        (("--dtype", "float64"), "Invalid value for '--dtype'"),
    ],
)
def test_bad_runtime_flags_exit_2_with_one_line(flags, message):
    result = specdoctor("generate", "--model", "demo", "--prompt", "x", *flags)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_speculative_config_takes_a_dspark_drafter_checkpoint():
    config = json.dumps({"method": "dspark", "model": "/models/drafter", "num_speculative_tokens": 5})
    assert options_from_speculative_config(config) == {
        "num_speculative_tokens": 5,
        "speculative_method": "dspark",
        "speculative_model": "/models/drafter",
    }


def test_speculative_config_without_a_method_leaves_the_kind_to_the_checkpoint():
    """vLLM tells a drafter checkpoint's kind from it when the config names no method."""
    config = json.dumps({"model": "/models/drafter", "num_speculative_tokens": 4})
    assert options_from_speculative_config(config) == {
        "num_speculative_tokens": 4,
        "speculative_model": "/models/drafter",
    }


def test_speculative_config_accepts_every_mtp_method_name_vllm_registers():
    for method in ("mtp", "deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "mimo_mtp"):
        config = json.dumps({"method": method, "num_speculative_tokens": 3})
        fields = options_from_speculative_config(config)
        assert fields == {"num_speculative_tokens": 3, "speculative_method": method}
        assert speculative_method(fields["speculative_method"]) == "mtp"  # every MTP name means the MTP layers
    sampled = '{"num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}'
    assert options_from_speculative_config(sampled)["draft_sample_method"] == "probabilistic"


def test_python_api_accepts_strings_for_choices_and_names_a_bad_one():
    options = RuntimeOptions("demo", drafter_policy="engine-legacy", fill="nan")
    assert options.drafter_policy.value == "engine-legacy" and f"{options.fill}" == "nan"
    with pytest.raises(SpecdoctorError, match="--head-policy: unknown value 'broken'"):
        RuntimeOptions("demo", head_policy="broken")


def hub_cache_with(root: Path, repo: str, source: Path) -> Path:
    """A local Hugging Face hub cache holding `source` as the snapshot of `repo`, in the layout huggingface_hub
    writes: the files in blobs/ named by their hash, the snapshot's files relative links to them."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        blob = folder / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return folder / "snapshots" / commit


def test_a_hugging_face_id_resolves_through_the_local_cache_only(tmp_path, monkeypatch):
    snapshot = hub_cache_with(tmp_path / "hub", "zai-org/tiny-glm", DEMO_DIR)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = specdoctor_env(env, "inspect", "--model", "zai-org/tiny-glm", "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["path"] == str(snapshot)
    missing = specdoctor_env(env, "inspect", "--model", "zai-org/absent")
    assert missing.returncode == 2 and "not in the local Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(SpecdoctorError, match="model directory not found"):
        Checkpoint("./zai-org/tiny-glm")  # an explicit path is never looked up in the cache


def specdoctor_env(env: dict, *args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "specdoctor", *args],
        capture_output=True,
        text=True,
        env=os.environ | env | {"COLUMNS": "160"},
        timeout=120,
    )


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return modules


def test_the_runtime_never_imports_checks_commands_or_the_server():
    upward = ("specdoctor.checks", "specdoctor.commands", "specdoctor.server", "specdoctor.probe", "specdoctor.report")
    for path in (PACKAGE / "runtime").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(upward)}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_every_runtime_option_is_declared_once():
    """The option names appear as declarations only in RuntimeOptions: no command re-declares them."""
    fields = ("drafter_policy", "head_policy", "fill", "dtype", "pp_partition")
    names = [f"--{name.replace('_', '-')}" for name in fields]
    declared = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        for name in names
        if f'"{name}"' in path.read_text()
    }
    assert declared == {"runtime/options.py"}
