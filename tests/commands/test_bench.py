"""`specdoctor bench` run as a real process on the demo model, and the step profile it reports."""

from __future__ import annotations

import json

import pytest

from tests.commands.test_cli import specdoctor


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "battery.jsonl"
    prompts = ["def read_config(path):\n", "The quick brown fox jumps over the lazy dog. The dog"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def test_bench_compares_speculative_with_plain_decoding_per_pipeline_size(two_prompts, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "demo", "--pp", "1", "--pp", "2", "--num-speculative-tokens", "2", "--no-compile"]
    result = specdoctor(*args, "--max-tokens", "12", "--battery", str(two_prompts), "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "speed-up" in result.stdout and "lossless" in result.stdout
    report = json.loads(out.read_text())
    assert [(row["pp"], row["k"]) for row in report["rows"]] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    for row in report["rows"]:
        assert row["lossless"] and row["tokens"] == 24 and row["tokens_per_s"] > 0
        assert len(row["rank_times"]) == row["pp"]
        split = row["last_rank_ms_per_step"]
        # target is what is left of the step after draft and transfer: over-counting either drives it negative.
        assert split["target"] > 0 and split["host"] > 0
        assert (split["draft"] > 0) == (row["k"] > 0)
        assert (split["transfer"] > 0) == (row["pp"] > 1)
        # The profiler counts steps on the last rank, the metrics count drafts as each rank commits: at batch 1
        # every decode step drafts once, so the two independent counts agree (plain decoding: one token a
        # step, after the first token of each of the 2 prompts, which the prefill emits).
        assert row["steps"] == (row["num_drafts"] if row["k"] else row["tokens"] - 2)
    plain, speculative = report["rows"][2], report["rows"][3]
    assert plain["mean_acceptance_length"] == 1.0 and speculative["mean_acceptance_length"] > 1.4
    assert speculative["steps"] < plain["steps"]  # accepted drafts mean fewer steps for the same tokens
    assert speculative["speedup"] == pytest.approx(speculative["tokens_per_s"] / plain["tokens_per_s"])

    # The bound: the acceptance length times the plain pass over the verify pass and the k draft steps, per step,
    # each pass through both stages (rank_times holds each stage's seconds; steps are counted on the last).
    def pass_ms(row):
        return 1000 * sum(stage["target_s"] for stage in row["rank_times"]) / row["steps"]

    split = speculative["last_rank_ms_per_step"]
    allowed = speculative["mean_acceptance_length"] * pass_ms(plain) / (pass_ms(speculative) + split["draft"])
    assert speculative["speedup_bound"] == pytest.approx(allowed)
    assert speculative["speedup_of_bound"] == pytest.approx(speculative["speedup"] / allowed)
    assert speculative["draft_step_ms"] == pytest.approx(split["draft"] / 2)
    assert "bound" in result.stdout and "eager" in result.stdout


def test_bench_rejects_a_zero_batch_size():
    result = specdoctor("bench", "--model", "demo", "--batch-size", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--batch-size" in result.stderr


def test_a_run_without_decode_steps_has_no_bound(two_prompts, tmp_path):
    """--max-tokens 1: the prompt pass makes the only token, no step runs, so there is nothing to bound."""
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "demo", "--num-speculative-tokens", "2", "--no-compile", "--max-tokens", "1"]
    result = specdoctor(*args, "--battery", str(two_prompts), "--json", str(out))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    speculative = json.loads(out.read_text())["rows"][1]
    assert (
        speculative["tokens"] == 2 and speculative["speedup_bound"] is None and speculative["speedup_of_bound"] is None
    )


def divergence(within_rounding: bool, gap: float = 0.01) -> dict:
    return {"prompt": 0, "token": 3, "target": 5, "speculative": 6, "gap": gap, "tolerance": 0.02,
            "within_rounding": within_rounding}  # fmt: skip


@pytest.mark.parametrize(
    "lossless, divergences, label",
    [
        (True, [], "yes"),
        (False, [divergence(True), divergence(True)], "ties"),
        (False, [divergence(True), divergence(False, gap=0.5)], "NO"),
        (False, [], "NO"),  # outputs that differ with no evidence are never called ties
    ],
)
def test_lossless_reads_ties_only_when_every_difference_is_within_rounding(lossless, divergences, label):
    from specdoctor.commands.bench import lossless_label

    assert lossless_label({"lossless": lossless, "divergences": divergences}) == label


def test_bf16_differences_carry_check_s_evidence_and_only_ties_exit_0(tmp_path):
    """In bf16 a verify pass and a one-token step can round a near tie differently. Whatever this machine's bf16
    rounding gives: a row differs exactly where it has evidence (check's: the gap against 16 units of bf16's
    rounding at the best logit), and bench exits 1 only for a difference beyond it."""
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "demo", "--num-speculative-tokens", "3", "--no-compile", "--dtype", "bfloat16"]
    result = specdoctor(*args, "--json", str(out))
    assert "Traceback" not in result.stderr, result.stderr
    rows = json.loads(out.read_text())["rows"]
    labels = []
    for row in rows:
        assert row["lossless"] == (row["divergences"] == [])
        for evidence in row["divergences"]:
            gap, tolerance = evidence["gap"], evidence["tolerance"]
            assert tolerance >= 16 * 2**-7  # 16 units of bf16's rounding at a logit of magnitude 1 or more
            assert evidence["within_rounding"] == (gap is not None and gap <= tolerance)
        ties = row["divergences"] and all(d["within_rounding"] for d in row["divergences"])
        labels.append("yes" if row["lossless"] else "ties" if ties else "NO")
    assert result.returncode == (1 if "NO" in labels else 0)
    assert all(label in result.stdout for label in labels)
