"""Train specdoctor's demo models, each a small MoE with one MTP layer: `demo` in GLM-4.5's layout,
`demo-mla` in GLM-5's (MLA attention with the DSA indexer), or `demo-hybrid` in Qwen3.5-MoE's (Gated
DeltaNet linear attention with gated full attention, and the `mtp.*` drafter).

Data: the Python standard library's own sources (every machine with Python has them); files
whose path hashes into the held-out bucket are never trained on. Deterministic for a given seed
and Python version. Runs on the CPU:

    python -m scripts.train_demo --out specdoctor/demo_model --steps 2400
    python -m scripts.train_demo --demo demo-mla --out specdoctor/demo_mla_model --steps 3600
    python -m scripts.train_demo --demo demo-hybrid --out specdoctor/demo_hybrid_model --steps 3600
    python -m scripts.train_demo --demo demo-dspark --out specdoctor/demo_dspark_model \
        --drafter-out specdoctor/demo_dspark_drafter --steps 3600

The MTP layer is trained jointly with the next-token objective to predict token t+2
(DeepSeek-V3's MTP loss), plus two chained steps (the MTP fed its own hidden state) so that
k > 1 drafts are useful. The checkpoint is written the way the GLM-5 family ships: bf16 shards,
an index, and the embedding only at `model.embed_tokens.weight`. `demo-dspark` is a dense Qwen3
target with a DSpark block drafter, a checkpoint of its own without embedding or head
(scripts/dspark_training.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import Progress, TextColumn, TimeElapsedColumn
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scripts import dspark_training
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.drafter.mtp import drafter_layer_key, is_drafter_head
from specdoctor.runtime.models.dspark import read_dspark_config
from specdoctor.runtime.models.moe import Router
from specdoctor.runtime.models.mtp import MtpDrafter
from specdoctor.runtime.models.registry import read_config
from specdoctor.runtime.models.stage import TargetStage
from tests.helpers.acceptance_trace import position0_acceptance
from tests.helpers.demo_corpus import corpus_files, read_texts

EOS = "<|endoftext|>"
CHAIN_WEIGHTS = (0.5, 0.2, 0.1)  # MTP loss weight for chain steps 0 (t+2), 1 (t+3), 2 (t+4)


MOE_FIELDS = {
    "vocab_size": None,  # from the tokenizer
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-5,
    "moe_intermediate_size": 128,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# GLM-4.5's and DeepSeek-V3's router, shared experts and dense first layer.
DEEPSEEK_MOE = {
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 1,
}
# Each demo: its architecture's own fields on top of the shared MoE ones.
DEMOS = {
    "demo": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "attention_bias": True,
        "use_qk_norm": False,
        **DEEPSEEK_MOE,
    },
    # GLM-5's layout at demo scale: MLA with q- and kv-LoRA and the DSA indexer. Its index_topk equals
    # max_position_embeddings, so, like GLM-5 below 2048 tokens, every query keeps its whole context.
    "demo-mla": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "q_lora_rank": 96,
        "kv_lora_rank": 96,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "head_dim": 16,
        "index_topk": 2048,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "scoring_func": "sigmoid",  # vLLM builds GLM-5 with DeepSeek-V2's MoE, which routes by these two
        "topk_method": "noaux_tc",
        "mlp_layer_types": ["dense"] + ["sparse"] * 3,
        "layer_types": ["indexed_attention"] * 4,
        "indexer_types": ["full"] * 4,
        **DEEPSEEK_MOE,
    },
    # Qwen3.5-MoE's layout: three Gated DeltaNet layers then gated full attention, softmax-routed experts
    # with a gated shared expert, and the `mtp.*` drafter.
    "demo-hybrid": {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "attention_bias": False,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "shared_expert_intermediate_size": 128,
        "mtp_num_hidden_layers": 1,
    },
}


DSPARK_DEMO = "demo-dspark"
# Qwen pads its vocabulary past the tokenizer's; demo-dspark's mask token is the first padded row.
VOCAB_PADDING = 64


def demo_config(demo: str, vocab_size: int, eos_id: int) -> dict:
    ids = {"eos_token_id": eos_id, "bos_token_id": eos_id, "pad_token_id": eos_id}
    if demo == DSPARK_DEMO:
        return {**dspark_training.TARGET_FIELDS, "vocab_size": vocab_size, **ids}
    return {**DEMOS[demo], **MOE_FIELDS, "vocab_size": vocab_size, **ids}


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class DemoModel(torch.nn.Module):
    """Target and drafter trained together; the drafter shares the target's embedding and head."""

    loss_names = ("main", "mtp0", "mtp1", "mtp2")

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.target = TargetStage(config, range(config.num_hidden_layers), True, True)
        self.drafter = MtpDrafter(config)
        self.drafter.embed_tokens = self.target.model.embed_tokens
        for layer in self.drafter.layers.values():
            layer.shared_head.head = self.target.lm_head
        for param in self.parameters():
            if param.dim() >= 2:
                torch.nn.init.normal_(param, std=0.02)

    def held_out(self, prompts: list[list[int]], new_tokens: int) -> str:
        acceptance = position0_acceptance(self.target, self.drafter, prompts, new_tokens)
        return f"held-out greedy MTP acceptance at position 0: {acceptance:.1%}"

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, list[float]]:  # batch: [B, T]
        length = batch.shape[1]
        positions = torch.arange(length).expand(batch.shape[0], -1)
        # The drafter is fed the target's output after its final norm, as engines serve it.
        hidden, logits = self.target.head(self.target(batch, positions))
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        total, parts = main, [main.item()]
        prev = hidden
        for step, weight in enumerate(CHAIN_WEIGHTS):
            # Step j at index i: token i+j+1 and the previous hidden state predict token i+j+2.
            usable = length - step - 2
            tokens = batch[:, step + 1 : step + 1 + usable]
            prev, draft_logits = self.drafter(tokens, prev[:, :usable], positions[:, :usable] + step)
            target = batch[:, step + 2 : step + 2 + usable]
            mtp = F.cross_entropy(draft_logits.flatten(0, 1), target.flatten())
            total = total + weight * mtp
            parts.append(mtp.item())
        return total, parts


def balance_routers(loads: dict[Router, torch.Tensor], rate: float = 1e-3) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's bias toward equal load."""
    for router, load in loads.items():
        router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


def track_loads(model: torch.nn.Module) -> dict[Router, torch.Tensor]:
    loads = {}
    for module in model.modules():
        if isinstance(module, Router):
            loads[module] = torch.zeros(module.config.n_routed_experts)

            def hook(router, _inputs, output):
                loads[router] += torch.bincount(output[1].flatten(), minlength=len(loads[router])).float()

            module.register_forward_hook(hook)
    return loads


def save_checkpoint(model: DemoModel, config: dict, tokenizer: Tokenizer, out: Path, shard_bytes: int) -> None:
    tensors = dict(model.target.state_dict())
    layout = model.drafter.config.mtp_keys
    for name, value in model.drafter.state_dict().items():
        # The embedding stays only at the top-level key; a layout without an own head takes lm_head.
        if name.startswith("layers.") and (layout.own_head or not is_drafter_head(name)):
            tensors[drafter_layer_key(model.drafter.config, name)] = value
    write_shards(tensors, out, shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tokenizer, out)


def save_dspark(
    model, config: dict, drafter_config: dict, tokenizer: Tokenizer, out: Path, drafter_out: Path, shard_bytes: int
) -> None:
    """The target as Qwen3 ships, and the drafter as a checkpoint of its own without the embedding and head
    it shares with the target (as DSpark checkpoints ship)."""
    for directory, tensors, fields in (
        (out, model.target.state_dict(), config),
        (drafter_out, drafter_tensors(model), drafter_config),
    ):
        write_shards(dict(tensors), directory, shard_bytes)
        (directory / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    save_tokenizer(tokenizer, out)


def drafter_tensors(model) -> dict[str, torch.Tensor]:
    shared = ("embed_tokens.weight", "lm_head.weight")
    return {name: value for name, value in model.drafter.state_dict().items() if name not in shared}


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_shards(tensors: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> None:
    """bf16 safetensors shards of at most `shard_bytes` and their index, replacing any shards there."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    # bf16 like the real checkpoints, except the router's score-correction bias, which they keep in fp32.
    tensors = {
        k: v.detach()
        .to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
        .contiguous()
        .clone()
        for k, v in sorted(tensors.items())
    }
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def train(model, label: str, loss_of, parameters, steps: int, lr: float, stream, args, generator, loads, watch) -> None:
    """AdamW on `parameters` for `steps` batches of the stream, with warm-up and a cosine decay."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), TextColumn("{task.fields[loss]}")) as progress:
        task = progress.add_task(label, total=steps, loss="")
        for step in range(steps):
            offsets = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch,), generator=generator)
            batch = torch.stack([stream[o : o + args.seq_len] for o in offsets.tolist()])
            loss, parts = loss_of(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            with torch.no_grad():
                balance_routers(loads)
            progress.update(task, advance=1, loss=f"loss {loss.item():.3f}")
            if step % 200 == 0 or step == steps - 1:
                shown = " ".join(f"{p:.3f}" for p in parts)
                names = ", ".join(model.loss_names)
                progress.console.print(f"{label} {step:5d} loss {loss.item():.3f} [{names}: {shown}]", markup=False)
            if step % 600 == 599:
                model.eval()
                progress.console.print(f"{label} {step:5d} {model.held_out(watch, 32)} (8 prompts)", markup=False)
                model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", choices=sorted([*DEMOS, DSPARK_DEMO]), default="demo", help="which demo to train")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--drafter-out", type=Path, help="demo-dspark: where its drafter checkpoint goes")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=float, default=4.0)
    parser.add_argument("--drafter-steps", type=int, default=0, help="demo-dspark: then the drafter alone")
    parser.add_argument("--drafter-lr", type=float, default=2e-3)
    parser.add_argument(
        "--init-from-out", action="store_true", help="demo-dspark: start from the weights in --out and --drafter-out"
    )
    args = parser.parse_args()
    if (args.demo == DSPARK_DEMO) != (args.drafter_out is not None):
        parser.error("--drafter-out goes with --demo demo-dspark, and only with it")
    if args.init_from_out and args.demo != DSPARK_DEMO:
        parser.error("--init-from-out goes with --demo demo-dspark")
    torch.manual_seed(args.seed)

    train_files, held_files = corpus_files()
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    stream = encode_stream(tokenizer, train_texts)
    if args.demo == DSPARK_DEMO:  # added after encoding: the text never holds it, the merges are the others'
        tokenizer.add_special_tokens([dspark_training.MASK])
    held = encode_stream(tokenizer, held_texts)
    print(
        f"train files {len(train_files)} tokens {len(stream):,}; held-out files {len(held_files)} tokens {len(held):,}"
    )

    vocab = -(-tokenizer.get_vocab_size() // VOCAB_PADDING) * VOCAB_PADDING
    raw_config = demo_config(args.demo, vocab, tokenizer.token_to_id(EOS))
    if args.demo == DSPARK_DEMO:
        mask = tokenizer.token_to_id(dspark_training.MASK)
        drafter_config = {**dspark_training.DRAFTER_FIELDS, "vocab_size": vocab, "mask_token_id": mask}
        model = dspark_training.DSparkDemoModel(read_config(raw_config), read_dspark_config(drafter_config), args.seed)
        if args.init_from_out:
            model.load(args.out, args.drafter_out)
    else:
        model = DemoModel(read_config(raw_config))
    loads = track_loads(model)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    generator = torch.Generator().manual_seed(args.seed)
    watch = [held[o : o + 64].tolist() for o in range(0, 8 * 997, 997)]  # a quick held-out reading as it trains
    start = time.time()
    phases = [("training", model.loss, model.parameters, args.steps, args.lr)] if args.steps else []
    if args.demo == DSPARK_DEMO and args.drafter_steps:  # then the drafter alone, on the frozen target
        phases.append(("drafter", model.drafter_loss, model.drafter_only, args.drafter_steps, args.drafter_lr))
    for label, loss_of, parameters_of, steps, lr in phases:
        train(model, label, loss_of, list(parameters_of()), steps, lr, stream, args, generator, loads, watch)
        # Saved after each phase, so a later one can be stopped without losing the earlier one's weights.
        save(model, args, raw_config, drafter_config if args.demo == DSPARK_DEMO else None, tokenizer, held, start)


def save(model, args, raw_config: dict, drafter_config: dict | None, tokenizer: Tokenizer, held, start: float) -> None:
    model.eval()
    offsets = torch.randint(0, len(held) - 64, (32,), generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
    prompts = [held[o : o + 64].tolist() for o in offsets]
    print(f"{model.held_out(prompts, 64)} (32 prompts x 64 tokens)")
    shard_bytes = int(args.shard_mb * 1024 * 1024)
    if drafter_config is not None:
        save_dspark(model, raw_config, drafter_config, tokenizer, args.out, args.drafter_out, shard_bytes)
    else:
        save_checkpoint(model, raw_config, tokenizer, args.out, shard_bytes)
    for directory in filter(None, (args.out, args.drafter_out)):
        size = sum(p.stat().st_size for p in directory.iterdir())
        print(f"saved {directory} ({size / 1e6:.1f} MB) after {time.time() - start:.0f}s")
    model.train()


if __name__ == "__main__":
    main()
