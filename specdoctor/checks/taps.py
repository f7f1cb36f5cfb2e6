"""Findings from the tap probe (runtime/tap_probe.py): which target layer each tap a drafter reads really
holds, measured through the live pipeline. docs/dspark.md says what vLLM 0.32 does with taps."""

from __future__ import annotations

from specdoctor.report import Finding

TAP_HINTS = {
    "zeros": "the engine must send each rank's taps on with the hidden states (vLLM 0.32: "
    "supports_aux_hidden_states_over_pp); a tap read where its layer does not run is zeros",
    "entry": "the engine captures other states than the drafter's config names: DSpark's target_layer_ids name a "
    "layer's output, which vLLM captures as entry id + 1; EAGLE-3's aux ids name the state entering a layer, with "
    "no + 1; ids the engine does not read are replaced by its default (2, L // 2, L - 3)",
    "unknown": "the tap matches no layer's output on the probe: the engine feeds the drafter something else",
}


def tap_findings(readings, stage: str) -> list[Finding]:
    wrong = [r for r in readings if r.found != "ok"]
    if not wrong:
        layers = ", ".join(str(r.layer_id) for r in readings)
        return [Finding("drafter.taps", "info", f"every tap holds its layer's output (layers {layers})", stage=stage)]
    findings = []
    for reading in wrong:
        kind = reading.found.split()[0]
        if kind == "entry":
            held = int(reading.found.split()[1]) - 1
            what = f"holds layer {held}'s output instead (off by {held - reading.layer_id})"
        elif kind == "zeros":
            what = "reaches the drafter as zeros"
        else:
            what = "matches no layer's output"
        findings.append(
            Finding(
                "drafter.taps",
                "error",
                f"the tap of target layer {reading.layer_id} (rank {reading.owner}) {what}",
                TAP_HINTS[kind],
                stage,
                {"layer_id": reading.layer_id, "owner": reading.owner, "found": reading.found},
            )
        )
    return findings
