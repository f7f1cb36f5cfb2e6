"""Run inside the quantisation tools' environment (quant_env.py): quantise a transformers-saved checkpoint
with the format's own tool and write the logits of that tool's dequantised model.

    python tests/tools/quantize_run.py FORMAT FLOAT_DIR OUT_DIR GROUP_SIZE IDS_JSON

FORMAT: w4a16 and w4a16-asym (llm-compressor's QuantizationModifier, round to nearest, compressed-tensors
pack-quantized without and with zero points), or awq (AutoAWQ's own round-to-nearest quantiser and GEMM
packer). The MTP layer's tensors (which transformers does not load) are copied unquantised and named in
the ignore list, as the hub's quantised MTP checkpoints leave them. Prints `RESULT {json}`; the logits of
the dequantised model in fp32 are saved to OUT_DIR/oracle_logits.pt.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

MTP_SHARD = "model-mtp.safetensors"
# Linear weights the formats leave unquantised: the embedding, the heads, the MoE router.
KEEP = ("embed_tokens", "lm_head", "mlp.gate.", "norm")
PACKED_ROLES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def mtp_prefixes(float_dir: Path) -> list[str]:
    """The DeepSeek/GLM layout's MTP layers: model.layers.{N + i}."""
    config = json.loads((float_dir / "config.json").read_text())
    first = config["num_hidden_layers"]
    return [f"model.layers.{first + i}" for i in range(config.get("num_nextn_predict_layers", 0))]


def add_mtp_shard(float_dir: Path, out: Path) -> None:
    """The MTP layers' tensors, as the float checkpoint holds them, in one more shard of `out`."""
    prefixes = tuple(f"{prefix}." for prefix in mtp_prefixes(float_dir))
    tensors = {}
    for shard in float_dir.glob("*.safetensors"):
        tensors |= {key: value for key, value in load_file(str(shard)).items() if key.startswith(prefixes)}
    save_file(tensors, str(out / MTP_SHARD), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if not index_path.exists():  # a single-file save: index it
        single = out / "model.safetensors"
        index = {"metadata": {}, "weight_map": dict.fromkeys(load_file(str(single)), single.name)}
    else:
        index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, MTP_SHARD))
    index_path.write_text(json.dumps(index, indent=2))


def llm_compressor(float_dir: Path, out: Path, group: int, symmetric: bool) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype="auto")  # scales in the weights dtype
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    add_mtp_shard(float_dir, out)
    # llm-compressor writes the ignored modules it found; the MTP layer is not one (transformers does not
    # build it), so name it as the hub's quantised MTP checkpoints do.
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"] += [f"re:{prefix}\\..*" for prefix in mtp_prefixes(float_dir)]
    (out / "config.json").write_text(json.dumps(config, indent=2))


def compressed_tensors_dequantised(out: Path) -> Path:
    """The checkpoint with every packed weight as compressed-tensors' own PackedQuantizationCompressor
    decompresses it (transformers 5.17 cannot yet decompress asymmetric MoE experts itself)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    dequantised = out.parent / f"{out.name}-dequantised"
    shutil.copytree(out, dequantised, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    scheme = QuantizationScheme(**config.pop("quantization_config")["config_groups"]["group_0"])
    (dequantised / "config.json").write_text(json.dumps(config, indent=2))
    index_path = dequantised / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(out / shard))
        modules = [key.removesuffix(".weight_packed") for key in tensors if key.endswith(".weight_packed")]
        for module in modules:
            parts = {role: tensors.pop(f"{module}.{role}") for role in PACKED_ROLES if f"{module}.{role}" in tensors}
            tensors[f"{module}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        save_file(tensors, str(dequantised / shard), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard} | dict.fromkeys(
            tensors, shard
        )
    index_path.write_text(json.dumps(index, indent=2))
    return dequantised


def autoawq(float_dir: Path, out: Path, group: int) -> Path:
    """Every target linear weight through AutoAWQ's quantiser and WQLinear_GEMM packer; returns a directory
    holding the same checkpoint with each weight as AutoAWQ's own dequantize_gemm gives it back."""
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm

    dequantised = out.parent / f"{out.name}-dequantised"
    quantiser = SimpleNamespace(w_bit=4, group_size=group, zero_point=True)
    mtp = tuple(f"{prefix}." for prefix in mtp_prefixes(float_dir))
    shutil.copytree(float_dir, out, dirs_exist_ok=True)
    shutil.copytree(float_dir, dequantised, dirs_exist_ok=True)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        packed, plain = {}, {}
        for key, value in load_file(str(float_dir / shard)).items():
            if value.dim() != 2 or any(part in key for part in KEEP) or key.startswith(mtp):
                packed[key] = plain[key] = value
                continue
            linear = torch.nn.Linear(value.shape[1], value.shape[0], bias=False)
            linear.weight.data = value.to(torch.float16)  # AutoAWQ quantises fp16 weights
            _, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(quantiser, linear.weight.data)
            awq = WQLinear_GEMM.from_linear(
                linear, 4, group, scales=scales.t().contiguous(), zeros=zeros.t().contiguous()
            )
            module = key.removesuffix(".weight")
            packed |= {f"{module}.qweight": awq.qweight, f"{module}.qzeros": awq.qzeros, f"{module}.scales": awq.scales}
            plain[key] = dequantize_gemm(awq.qweight, awq.qzeros, awq.scales, 4, group).t().float().contiguous()
        save_file(packed, str(out / shard), metadata={"format": "pt"})
        save_file(plain, str(dequantised / shard), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard} | dict.fromkeys(
            packed, shard
        )
    index_path.write_text(json.dumps(index, indent=2))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": ["lm_head", *(prefix for prefix in mtp_prefixes(float_dir))],
    }  # fmt: skip
    config_path.write_text(json.dumps(config, indent=2))
    return dequantised


def main() -> None:
    form, float_dir, out, group, ids = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    from transformers import AutoModelForCausalLM

    if form == "awq":
        model = AutoModelForCausalLM.from_pretrained(autoawq(float_dir, out, group), dtype=torch.float32)
    else:
        llm_compressor(float_dir, out, group, symmetric=form == "w4a16")
        model = AutoModelForCausalLM.from_pretrained(compressed_tensors_dequantised(out), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(json.loads(ids))).logits.float()
    torch.save(logits, out / "oracle_logits.pt")
    print("RESULT " + json.dumps({"logits": str(out / "oracle_logits.pt"), "shape": list(logits.shape)}))


if __name__ == "__main__":
    main()
