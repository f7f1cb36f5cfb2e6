"""Quantised checkpoints written by the formats' own tools: the runtime's logits at every position equal
the same tool's dequantised model (fp32), for GLM-4.5 and an MLA family (DeepSeek-V3), with the weights held
packed (the quantised GEMMs) and dequantised at load."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.loader import load_full_target
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.models.packed import PackedLinear
from specdoctor.runtime.options import RuntimeOptions
from tests.commands.test_cli import rename_key, specdoctor
from tests.conftest import make_hf_checkpoint
from tests.helpers.families import make_family_checkpoint
from tests.helpers.fp8_checkpoint import dequantised_model, write_fp8_checkpoint
from tests.helpers.tool_env import ROOT, PeerUnavailable
from tests.oracles.test_model_parity import relative_error
from tests.tools.quant_env import QUANT, TOOL_ENV

pytestmark = [pytest.mark.timeout(600), pytest.mark.tool_env("quant")]
GROUP = 16  # columns per scale: every width of the tiny models (48, 64, 96) holds several groups
IDS = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(5))
# AutoAWQ's packer needs output widths in multiples of 32 (DeepSeek-V3's own are): MLA sizes that give them
AWQ_SHAPES = dict(q_lora_rank=64, kv_lora_rank=48, qk_rope_head_dim=16)
FAMILIES = ["Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"]


@pytest.fixture(scope="session")
def quant_python():
    try:
        return QUANT.ensure()
    except PeerUnavailable as err:
        pytest.fail(f"quantisation tools: {err}", pytrace=False)


@pytest.fixture(scope="module", params=FAMILIES)
def float_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "Glm4MoeForCausalLM":
        make_hf_checkpoint(path)
    else:
        make_family_checkpoint(path, request.param, **AWQ_SHAPES)
    return path


def tool_quantize(quant_python, form: str, float_dir, out) -> torch.Tensor:
    """Quantise with the tool in its own environment; the logits of the tool's dequantised model."""
    command = [str(quant_python), "tests/tools/quantize_run.py", form, str(float_dir), str(out), str(GROUP)]
    result = subprocess.run(command + [json.dumps(IDS.tolist())], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env=TOOL_ENV)  # fmt: skip
    line = next((row for row in result.stdout.splitlines() if row.startswith("RESULT ")), None)
    assert line, result.stderr[-3000:]
    return torch.load(json.loads(line.removeprefix("RESULT "))["logits"])


def runtime_logits(path, packed: bool) -> torch.Tensor:
    """The runtime's logits with the weights held packed (the quantised GEMMs) or dequantised at load."""
    stage = load_full_target(Checkpoint(path), packed=packed)
    assert any(isinstance(module, PackedLinear) for module in stage.modules()) == packed
    with torch.no_grad():
        return stage.logits(stage(IDS, torch.arange(IDS.shape[1]).expand(IDS.shape[0], -1)))


def assert_both_paths_equal(path, expected: torch.Tensor) -> None:
    for packed in (True, False):
        ours = runtime_logits(path, packed)
        assert relative_error(ours, expected) < 1e-4, packed
        assert relative_error(ours[:, -1], expected[:, -1]) < 1e-4, packed


def tp_2_pp_2_logits(path) -> torch.Tensor:
    """The logits of four rank processes holding their slices of the packed words, scales and zero points."""
    with Engine(RuntimeOptions(str(path), tp=2, pp=2, timeout=120)) as engine:
        return engine.prompt_logits(IDS.tolist())


@pytest.mark.parametrize("form", ["w4a16", "w4a16-asym", "awq"])
def test_w4a16_logits_equal_the_tools_dequantised_model(quant_python, float_checkpoint, tmp_path, form):
    out = tmp_path / form
    expected = tool_quantize(quant_python, form, float_checkpoint, out)
    checkpoint = Checkpoint(out)
    assert checkpoint.quantized and not checkpoint.quantization_problems
    assert_both_paths_equal(out, expected)
    assert relative_error(tp_2_pp_2_logits(out), expected) < 1e-4


def test_fp8_block_logits_equal_transformers_dequantised_model(float_checkpoint, tmp_path):
    out = tmp_path / "fp8"
    write_fp8_checkpoint(float_checkpoint, out, (32, 32))
    assert any(info.dtype == "F8_E4M3" for info in Checkpoint(out).stored.values())
    with torch.no_grad():
        expected = dequantised_model(out)(IDS).logits
    assert_both_paths_equal(out, expected)
    # At TP 2 a rank's k_proj is one 16-row KV head, half a 32-row scale block: refused before any rank starts,
    # as vLLM's block-FP8 layers refuse it ("output_partition_size = 16 is not divisible by block_n = 32").
    with pytest.raises(SpecdoctorError, match="--tensor-parallel-size 2: a rank's slice of a packed weight"):
        tp_2_pp_2_logits(out)


def test_shipped_w4a16_demo_is_what_llm_compressor_writes(quant_python, tmp_path):
    """demo-w4a16 is reproducible: the project's script, with llm-compressor, writes the same bytes."""
    out = tmp_path / "demo-w4a16"
    command = [str(quant_python), "-m", "scripts.quantize_demo", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=TOOL_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    shipped = DEMO_MODELS["demo-w4a16"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (shipped / path.name).read_bytes(), path.name


def preflight_of(path) -> list[dict]:
    result = specdoctor("inspect", "--model", str(path), "--pp", "4", "--json", "-")
    assert result.returncode == 0, result.stderr
    return [f for f in json.loads(result.stdout)["preflight"] if f["check"].startswith("quantization")]


def test_preflight_names_the_scheme_and_what_it_covers():
    findings = preflight_of("demo-w4a16")
    by_check = {f["check"]: f for f in findings}
    assert "compressed-tensors (pack-quantized, 4-bit, group 64, symmetric)" in by_check["quantization"]["message"]
    # layer 0: attention's 4 linears and the dense MLP's 3; layers 1-3: attention's 4, 8 experts' and the shared
    # expert's 27: 7 + 3 * 31
    assert by_check["quantization"]["data"]["target_formats"] == {"pack-quantized": 100}
    assert by_check["quantization.mtp"]["severity"] == "info"  # bf16 and named in the ignore list
    assert [f for f in findings if f["severity"] != "info"] == []


@pytest.fixture
def w4a16_copy(tmp_path):
    path = tmp_path / "w4a16"
    shutil.copytree(DEMO_MODELS["demo-w4a16"], path)
    return path


def test_an_mtp_layer_the_config_would_quantise_is_a_hazard(w4a16_copy):
    config_path = w4a16_copy / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"] = [p for p in config["quantization_config"]["ignore"] if "re:" not in p]
    config_path.write_text(json.dumps(config))
    (finding,) = [f for f in preflight_of(w4a16_copy) if f["check"] == "quantization.mtp"]
    assert finding["severity"] == "warning" and "does not exempt it" in finding["message"]


def test_a_missing_scale_is_an_error_and_the_runtime_refuses_it(w4a16_copy):
    key = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
    rename_key(w4a16_copy, key, None)
    errors = [f for f in preflight_of(w4a16_copy) if f["severity"] == "error"]
    assert errors and key in errors[0]["message"]
    result = specdoctor("generate", "--model", str(w4a16_copy), "--prompt", "def")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert key in result.stderr and "Traceback" not in result.stderr


def test_a_quantised_embedding_is_a_hazard(tmp_path):
    write_fp8_checkpoint(DEMO_MODELS["demo"], tmp_path / "fp8", (64, 64), also=("model.embed_tokens.weight",))
    warnings = {f["check"]: f for f in preflight_of(tmp_path / "fp8") if f["severity"] == "warning"}
    assert "model.embed_tokens.weight is stored quantised (fp8-block)" in warnings["quantization.embedding"]["message"]


def test_a_quantization_config_with_nothing_quantised_is_a_hazard(tmp_path):
    shutil.copytree(DEMO_MODELS["demo"], tmp_path / "demo")
    config_path = tmp_path / "demo" / "config.json"
    config = json.loads(config_path.read_text())
    quantised = json.loads((DEMO_MODELS["demo-w4a16"] / "config.json").read_text())["quantization_config"]
    config_path.write_text(json.dumps(config | {"quantization_config": quantised}))
    warnings = [f["check"] for f in preflight_of(tmp_path / "demo") if f["severity"] == "warning"]
    assert "quantization.config" in warnings
