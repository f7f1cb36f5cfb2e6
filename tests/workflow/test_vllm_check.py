"""`check --engine vllm`'s reading of what vLLM returned (tests/peer/test_vllm_engine.py runs the real thing):
a worker that wrote no report is never called healthy, and the rounding-tie rule reads the reference's raw
logits where the outputs first differ."""

from __future__ import annotations

import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.check import CheckOptions
from specdoctor.workflow.vllm_check import VllmCheckOptions, divergence, record_vllm_run

WORKER = {"tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "label": "TP 0/2, PP 0/1"}
HEALTHY_TABLE = {
    "tensor": "embed_tokens.weight",
    "shared_with_target": True,
    "key": "model.embed_tokens.weight",
    "rows": [0, 1024],
    "ok": True,
    "problem": None,
}
ANSWER = {
    "tokens": [5, 6, 7],
    "spec": {
        "num_drafts": 1,
        "num_draft_tokens": 3,
        "num_accepted_tokens": 2,
        "num_accepted_tokens_per_pos": [1, 1, 0],
    },
}


def test_a_worker_that_wrote_no_report_is_an_error_never_healthy():
    """TP 2: vLLM came up and answered, but only worker tp0-pp0 wrote a report."""
    served = {
        "tp": 2,
        "pp": 1,
        "dtype": "float32",
        "reports": {"tp0-pp0": {"worker": WORKER, "has_drafter": True, "tables": [HEALTHY_TABLE]}},
        "before": [ANSWER],
    }
    reference = {"before": [{"tokens": [5, 6, 7], "logits": []}]}
    report = CheckReport("demo", {}, [])
    options = VllmCheckOptions(CheckOptions(RuntimeOptions("demo")))
    with pytest.raises(SpecdoctorError, match=r"worker\(s\) tp1-pp0 never reported"):
        record_vllm_run(report, options, served, reference, 3, Checkpoint("demo").config)
    assert not report.healthy
    assert [f.message for f in report.preflight] == ["vLLM worker tp1-pp0: never wrote its report: it is not verified"]


@pytest.mark.parametrize(
    "speculative_logit, within",
    [(9.0 - 2 * 2**-23 * 9, True), (8.5, False), (None, False)],
    ids=["rounding-tie", "real-miss", "outside-the-top-logits"],
)
def test_a_difference_is_a_tie_only_where_the_references_logits_are_within_rounding(speculative_logit, within):
    """The outputs first differ at token 1: the reference chose 7 (logit 9.0); the speculative run emitted 8."""
    logits = [{"6": 3.0}, {"7": 9.0, **({"8": speculative_logit} if speculative_logit is not None else {})}]
    found = divergence(0, [6, 7], [6, 8], logits, 2.0**-23)
    assert (found["token"], found["target"], found["speculative"]) == (1, 7, 8)
    assert found["within_rounding"] is within
