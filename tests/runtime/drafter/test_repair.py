"""The repair (runtime/drafter/repair.py): vLLM's vocabulary shards, one TP rank's rows read from a
checkpoint with its padding zero, the check of a repaired table against them, and repair_drafter filling
a rank's unloaded drafter tensors from the checkpoint, one tensor read each.

Oracles: vLLM's rule (VocabParallelEmbedding: pad the vocabulary to a multiple of 64, split it evenly,
refuse when it does not divide) worked out by hand below, and the tensors as safetensors writes and
reads them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.repair import check_vocab_shard, read_vocab_shard, repair_drafter
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import build_rank
from specdoctor.runtime.sharding import vocab_shard_range
from specdoctor.runtime.tensor_parallel import TensorParallel

# Rows per TP rank, worked out by hand: padded = the vocabulary rounded up to a multiple of 64, then / TP.
# 129,280 (DeepSeek-V3) = 2,020 x 64 and 151,936 (Qwen2/3) = 2,374 x 64 need no padding; 202,752 (GLM-4.5's
# padded table) = 3,168 x 64 = 3 x 67,584; 50,257 (GPT-2) pads to 50,304 = 786 x 64 = 3 x 16,768. Those are
# multiples of 128 too; 32,064 (Phi-3) = 501 x 64 is not (a multiple of 128 would pad it to 32,128).
PER_RANK = {
    (129_280, 1): 129_280,
    (129_280, 2): 64_640,
    (129_280, 4): 32_320,
    (129_280, 8): 16_160,
    (151_936, 1): 151_936,
    (151_936, 2): 75_968,
    (151_936, 4): 37_984,
    (151_936, 8): 18_992,
    (202_752, 1): 202_752,
    (202_752, 2): 101_376,
    (202_752, 3): 67_584,
    (202_752, 4): 50_688,
    (202_752, 8): 25_344,
    (50_257, 1): 50_304,
    (50_257, 2): 25_152,
    (50_257, 3): 16_768,
    (50_257, 8): 6_288,
    (32_064, 1): 32_064,
    (32_064, 2): 16_032,
    (32_064, 3): 10_688,
    (32_064, 4): 8_016,
    (32_064, 8): 4_008,
}
# 129,280 / 3 and 151,936 / 3 or / 6 leave a remainder (2,020 and 2,374 are not multiples of 3); vLLM's
# divide() asserts, so the padded table does not split.
REFUSED = [(129_280, 3), (151_936, 3), (151_936, 6), (202_752, 5), (50_257, 5), (32_064, 5)]


@pytest.mark.parametrize("vocab, tp", sorted(PER_RANK))
def test_vocab_shard_ranges_follow_vllms_padding_and_even_split(vocab, tp):
    size = PER_RANK[vocab, tp]
    assert [vocab_shard_range(vocab, tp, rank) for rank in range(tp)] == [
        (rank * size, (rank + 1) * size) for rank in range(tp)
    ]


@pytest.mark.parametrize("vocab, tp", REFUSED)
def test_a_padded_vocabulary_that_does_not_split_is_refused(vocab, tp):
    with pytest.raises(SpecdoctorError, match=f"does not split over {tp} tensor-parallel ranks"):
        vocab_shard_range(vocab, tp, 0)


VOCAB, HIDDEN, KEY = 150, 8, "model.embed_tokens.weight"  # 150 rows pad to 192 (3 x 64)


@pytest.fixture
def table_checkpoint(tmp_path) -> tuple[Checkpoint, torch.Tensor]:
    """A checkpoint directory holding a [150, 8] bf16 embedding (and one other tensor), written by safetensors."""
    config = json.loads((DEMO_MODELS["demo"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB, "hidden_size": HIDDEN}))
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16)
    other = torch.randn(3, HIDDEN, generator=generator).to(torch.bfloat16)
    save_file({KEY: table, "model.norm.weight": other}, str(tmp_path / "model.safetensors"))
    return Checkpoint(tmp_path), table


# (TP, rank) -> (rows of the padded vocabulary, real rows, padding rows): 192 rows split evenly.
SHARDS = {
    (1, 0): ((0, 192), 150, 42),
    (2, 0): ((0, 96), 96, 0),
    (2, 1): ((96, 192), 54, 42),
    (3, 2): ((128, 192), 22, 42),
    (4, 3): ((144, 192), 6, 42),
    (8, 6): ((144, 168), 6, 18),
    (8, 7): ((168, 192), 0, 24),  # all padding
}


@pytest.mark.parametrize("tp, rank", sorted(SHARDS))
def test_read_vocab_shard_gives_the_ranks_real_rows_then_zero_padding_reading_only_them(table_checkpoint, tp, rank):
    checkpoint, table = table_checkpoint
    (start, end), real, padding = SHARDS[tp, rank]
    shard = read_vocab_shard(checkpoint, KEY, tp, rank)
    assert shard.shape == (end - start, HIDDEN) and shard.dtype == torch.bfloat16
    assert torch.equal(shard[:real], table[start : start + real])
    assert torch.equal(shard[real:], torch.zeros(padding, HIDDEN, dtype=torch.bfloat16))
    assert checkpoint.bytes_read == real * HIDDEN * 2  # only the rank's real rows were read (bf16)


@pytest.mark.parametrize("tp, rank", sorted(SHARDS))
def test_check_vocab_shard_passes_the_right_table(table_checkpoint, tp, rank):
    checkpoint, table = table_checkpoint
    (start, end), real, padding = SHARDS[tp, rank]
    loaded = read_vocab_shard(checkpoint, KEY, tp, rank).float()  # the runtime holds it in fp32
    check = check_vocab_shard(checkpoint, KEY, loaded, TensorParallel(rank, tp))
    assert (check.tp_size, check.tp_rank, check.rows, check.real_rows, check.padded_rows) == (
        tp,
        rank,
        [start, end],
        real,
        padding,
    )
    assert check.matches_table and check.padding_zero and check.ok


def test_check_vocab_shard_reports_a_wrong_row_in_the_ranks_slice_and_only_there(table_checkpoint):
    checkpoint, table = table_checkpoint
    first, second = table.float()[:96].clone(), table.float()[96:].clone()  # TP 2: rows [0, 96), [96, 150) + padding
    second[120 - 96] += 1.0
    second = torch.cat([second, torch.zeros(42, HIDDEN)])
    inside = check_vocab_shard(checkpoint, KEY, second, TensorParallel(1, 2))
    assert not inside.matches_table and inside.padding_zero and not inside.ok
    assert check_vocab_shard(checkpoint, KEY, first, TensorParallel(0, 2)).ok  # rank 0's rows are all right
    second[-1] = 1.0  # a padding row that is not zero
    assert not check_vocab_shard(checkpoint, KEY, second, TensorParallel(1, 2)).padding_zero
    with pytest.raises(SpecdoctorError, match="does not split over 5"):
        check_vocab_shard(checkpoint, KEY, table.float(), TensorParallel(0, 5))


EMBEDDING, HEAD = "embed_tokens.weight", "layers.4.shared_head.head.weight"
EMBEDDING_KEY, HEAD_KEY = "model.embed_tokens.weight", "model.layers.4.shared_head.head.weight"


def stored(key: str) -> torch.Tensor:
    """The demo checkpoint's tensor as safetensors reads it."""
    root = DEMO_MODELS["demo"]
    shard = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(root / shard), "pt") as handle:
        return handle.get_tensor(key)


@pytest.fixture(scope="module")
def legacy_rank():
    """The demo's PP 2 drafter rank as an engine-legacy loader leaves it: the MTP layer's embedding (PP > 1)
    and its own head left as allocated, filled with NaN."""
    options = RuntimeOptions("demo", pp=2, drafter_policy="engine-legacy", head_policy="unloaded", fill="nan")
    model, _ = build_rank(options, 1)
    return model


def test_repair_drafter_fills_the_unloaded_tensors_from_the_checkpoint_bit_for_bit(legacy_rank):
    model = legacy_rank
    assert model.provenance.labels()[EMBEDDING] == model.provenance.labels()[HEAD] == "unfilled:nan"
    assert model.drafter.get_parameter(EMBEDDING).isnan().all() and model.drafter.get_parameter(HEAD).isnan().all()
    before = sum(c.bytes_read for c in model.kind.checkpoints)

    result = repair_drafter(model, [EMBEDDING, HEAD])

    assert result.repaired == {EMBEDDING: EMBEDDING_KEY, HEAD: HEAD_KEY} and result.tp_shard is None
    embedding, head = stored(EMBEDDING_KEY), stored(HEAD_KEY)
    for name, tensor in ((EMBEDDING, embedding), (HEAD, head)):
        live = model.drafter.get_parameter(name)
        assert live.dtype == model.dtype and live.device == model.device
        assert torch.equal(live, tensor.to(model.dtype))  # bf16 -> fp32 is exact: bit for bit
        assert model.provenance.labels()[name] == f"checkpoint:{result.repaired[name]}"
    # One read of each tensor, nothing more: their sizes as stored (bf16).
    sizes = embedding.numel() * embedding.element_size() + head.numel() * head.element_size()
    assert result.bytes_read == sizes == sum(c.bytes_read for c in model.kind.checkpoints) - before
    assert result.seconds >= 0


@pytest.fixture
def tp_rank_built_alone():
    """TP rank 1 of 2 of the demo's drafter stage at PP 2, built alone (its shapes, no process group), loaded as
    engine-legacy leaves it: its slice of the embedding left as allocated, filled with NaN."""
    options = RuntimeOptions("demo", pp=2, tp=2, drafter_policy="engine-legacy", fill="nan")
    try:
        model, _ = build_rank(options, 3)  # global rank 3: stage 1, TP rank 1
        yield model
    finally:
        tensor_parallel.use(TensorParallel())


def test_repair_drafter_of_a_tp_rank_reads_its_rows_alone_and_checks_them(tp_rank_built_alone):
    """The demo's 2,048 rows are a multiple of 64: TP rank 1 of 2 holds [1024, 2048), all real. Its repair reads
    those rows, and the check reads them once more to compare them with the repaired slice."""
    model = tp_rank_built_alone
    embedding = stored(EMBEDDING_KEY)
    assert model.drafter.get_parameter(EMBEDDING).shape == (1024, embedding.shape[1])
    assert model.drafter.get_parameter(EMBEDDING).isnan().all()
    result = repair_drafter(model, {1: [EMBEDDING]})
    assert result.repaired == {EMBEDDING: EMBEDDING_KEY} and result.tp_rank == 1
    assert torch.equal(model.drafter.get_parameter(EMBEDDING), embedding[1024:].to(model.dtype))
    shard = result.tp_shard
    assert (shard.tp_size, shard.tp_rank, shard.rows, shard.real_rows, shard.padded_rows) == (
        2,
        1,
        [1024, 2048],
        1024,
        0,
    )
    assert shard.matches_table and shard.padding_zero
    row_bytes = embedding.shape[1] * embedding.element_size()
    assert result.bytes_read == 2 * 1024 * row_bytes
    assert repair_drafter(model, {0: [EMBEDDING]}).repaired == {}  # another rank's list: nothing to do here


def test_tp_shard_check_compares_the_repaired_rows_with_the_checkpoint(tmp_path):
    """A vocabulary of 300 pads to 320 (vLLM's multiple of 64): at TP 4 the last rank holds 60 real rows
    and 20 zero rows. A repaired table whose rows are off by one fails; a TP size that does not split
    the padded vocabulary is refused, as vLLM's VocabParallelEmbedding refuses it."""
    from specdoctor.errors import SpecdoctorError
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.repair import check_vocab_shard
    from tests.conftest import make_hf_checkpoint

    make_hf_checkpoint(tmp_path, seed=41, vocab_size=300)
    checkpoint, key = Checkpoint(tmp_path), "model.embed_tokens.weight"
    table = checkpoint.read(key).float()
    last = torch.cat([table[240:], torch.zeros(20, table.shape[1])])  # TP 4 rank 3's slice, as loaded
    shard = check_vocab_shard(checkpoint, key, last, TensorParallel(3, 4))
    assert (shard.rows, shard.real_rows, shard.padded_rows) == ([240, 320], 60, 20)
    assert shard.ok
    assert not check_vocab_shard(checkpoint, key, last.roll(1, dims=0), TensorParallel(3, 4)).matches_table
    with pytest.raises(SpecdoctorError, match="does not split over 3 tensor-parallel ranks"):
        check_vocab_shard(checkpoint, key, table, TensorParallel(0, 3))
