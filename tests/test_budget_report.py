"""`python -m zipmoe.clients.budget_report`: the offline view of how notes share the VisionZip budget."""
from __future__ import annotations

import json

import pytest
import torch

from zipmoe.clients import budget_report as br
from zipmoe.serve import TRAINED_CHECKPOINT


def test_perplexity():
    assert br.perplexity(torch.ones(16)) == pytest.approx(16.0)
    assert br.perplexity(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(1.0)


def test_report_on_the_trained_checkpoint(tmp_path, capsys):
    assert br.main(["--n", "6", "--keep", "0.5", "--out", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["checkpoint"] == "checkpoints/notes" and result["n"] == 6
    assert list(result["layers"]) == [str(i) for i in range(6)]  # every vision layer of the checkpoint
    last = result["layers"]["5"]
    assert set(last["tokens_kept"]) == {"distinct", "size"}
    share = {w: last["tokens_kept"][w]["0.5"]["dense"] / last["tokens_kept"][w]["0.5"]["plain"]
             for w in ("distinct", "size")}
    assert share["distinct"] > 1.1  # more examples: test_budget_weighting
    assert share["size"] == pytest.approx(1.0, abs=0.05)  # notes of one size share evenly by size
    assert result["distinct_tokens"]["dense"] > result["distinct_tokens"]["plain"] >= 1.0
    assert "distinct @0.5" in capsys.readouterr().out
    assert TRAINED_CHECKPOINT.is_dir()
