"""Block-scaled FP8 checkpoints written by transformers' own FP8 quantiser (`Fp8Quantize`, what
`FineGrainedFP8Config` applies), and transformers' dequantised model as their oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tools.quantize_run import KEEP, mtp_prefixes


def write_fp8_checkpoint(float_dir: Path, out: Path, block: tuple[int, int], also: tuple[str, ...] = ()) -> None:
    """Every target linear weight whose shape the blocks tile, quantised (transformers leaves the others in
    floating point); the embedding, heads, router and MTP layer stay unquantised, as GLM-5-FP8 ships them,
    unless named in `also`."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    skip = ["lm_head", *mtp_prefixes(float_dir)]
    config = FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=skip)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    shutil.copytree(float_dir, out, dirs_exist_ok=True)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for key, value in load_file(str(float_dir / shard)).items():
            keep = value.dim() != 2 or any(part in key for part in KEEP) or key.startswith(tuple(skip))
            keep = keep and key not in also
            tensors |= {key: value} if keep else quantize.convert({key: value.to(torch.bfloat16)})
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index["weight_map"] |= dict.fromkeys(tensors, shard)
    index_path.write_text(json.dumps(index, indent=2))
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
        "modules_to_not_convert": skip,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(raw, indent=2))


def dequantised_model(path: Path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config).eval()
