"""build/routing_truncation.py on the v2 smoke checkpoint (conftest's v2_smoke): the router cut to K'
experts acts on the answer tokens only, K' = top-K is the model as trained, the routers come back
unchanged, and the probe and train_v2's validation report it; and on the committed checkpoints/v2,
whose recalled prices need its experts."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO
from zipmoe.build.routing_truncation import answer_nll, answer_rows, main, prices_right, probe, truncated_routing
from zipmoe.build.train_v2 import TaskSetV2Dataset, collate, device_pixels


@pytest.fixture(scope="module")
def model_and_batch(v2_smoke):
    from transformers import Qwen3VLMoeForConditionalGeneration

    checkpoint = v2_smoke[0]
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    data = TaskSetV2Dataset(checkpoint, "validation", 2)
    cfg = model.config
    batch = collate([data[i] for i in range(2)], pad_id=cfg.text_config.pad_token_id, image_token=cfg.image_token_id)
    for training_only in ("task", "readings", "attend"):
        batch.pop(training_only)
    batch["pixel_values"] = device_pixels(batch["pixel_values"], cfg.vision_config.temporal_patch_size)
    return model, batch


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def test_cut_acts_on_the_answer_tokens_only_and_is_undone(model_and_batch):
    model, batch = model_and_batch
    top_k = model.config.text_config.num_experts_per_tok
    rows = answer_rows(batch["labels"])
    first_answer = int(rows[0].nonzero()[0])
    full = _logits(model, batch)
    with truncated_routing(model, top_k, rows):
        torch.testing.assert_close(_logits(model, batch), full)  # K' = K: the model as trained
    mass: list[float] = []
    with truncated_routing(model, 1, rows, mass):
        cut = _logits(model, batch)
    # Causal: the prompt's positions never see an answer token, so their logits are untouched.
    torch.testing.assert_close(cut[0, :first_answer], full[0, :first_answer])
    assert not torch.allclose(cut[0, first_answer:], full[0, first_answer:])
    assert len(mass) == model.config.text_config.num_hidden_layers and all(0 < m < 1 for m in mass)
    with truncated_routing(model, 0, rows):  # no experts at the answer tokens: finite, and different
        none = _logits(model, batch)
    assert torch.isfinite(none).all() and not torch.allclose(none[0, first_answer:], cut[0, first_answer:])
    torch.testing.assert_close(_logits(model, batch), full)  # the routers are back


def test_answer_nll_scores_answer_tokens_only():
    logits = torch.zeros(1, 4, 5)
    logits[0, 2, 3] = 10.0  # predicts token 3 at position 3
    labels = torch.tensor([[-100, -100, -100, 3]])
    assert float(answer_nll(logits, labels)[0]) < 1e-3
    assert float(answer_nll(logits, torch.tensor([[-100, -100, -100, 1]]))[0]) > 5


def test_prices_right_counts_whole_prices_of_the_answer():
    words = ["FRESH", " MART", "3", ".", "1", "5", ",", "<|im_end|>", "Q"]
    tokenizer = type("Words", (), {"decode": staticmethod(lambda ids: "".join(words[i] for i in ids))})()
    answer = [0, 1, 2, 3, 4, 5, 6, 2, 3, 5, 7]  # FRESH MART 3.15,3.5<|im_end|>
    guess = [0, 1, 2, 3, 4, 5, 6, 2, 3, 4, 7]  # the second price's last digit wrong
    labels = torch.tensor([[-100, -100] + answer, [-100, -100] + answer])
    logits = torch.zeros(2, labels.shape[1], len(words))
    for row, tokens in enumerate((answer, guess)):
        logits[row, torch.arange(1, 1 + len(tokens)), torch.tensor(tokens)] = 1.0  # position i predicts i + 1
    assert prices_right(logits, labels, tokenizer) == [(2, 2), (1, 2)]
    assert prices_right(logits[:, :3], torch.tensor([[-100, 8, 0]] * 2), tokenizer) == [(0, 0), (0, 0)]


def test_probe_on_the_smoke_checkpoint(v2_smoke, tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["--checkpoint", str(v2_smoke[0]), "--n", "2", "--keep", "4,2", "--device", "cpu",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 2 and result["top_k"] == 4 and [r["keep"] for r in result["rows"]] == [4, 2]
    full, two = result["rows"]
    assert full["top_weight_kept"] == pytest.approx(1.0) and 0 < two["top_weight_kept"] < 1
    for group in ("knowledge", "reading"):
        assert 0 <= two[group]["prices_right"] <= 1 and two[group]["prices"] == full[group]["prices"] >= 0
    assert "answer loss" in capsys.readouterr().out


def test_train_v2_validation_reports_the_top2_loss(v2_smoke):
    log = v2_smoke[1]
    assert log["val_top2_loss"] > 0 and all("top2_loss" in v for v in log["validation"])


def test_the_committed_v2_checkpoint_recalls_the_price_lists_with_its_experts():
    """checkpoints/v2 (the tenth H200 run) learned taskset_v2.PRICE_LISTS: a change to the task set's
    knowledge (items, stores, the lists' seed) would leave it answering another world's prices. And
    the recall lives in the experts: cut to one, it is gone (docs/QUALITY.md, the tenth run)."""
    result = probe(REPO / "checkpoints" / "v2", n=8, keeps=(8, 1), device="cpu", knowledge_only=True)
    full, one = result["rows"]
    assert result["n"] == full["knowledge"]["n"] == 8 and full["reading"]["n"] == 0
    assert full["knowledge"]["prices"] >= 16 and full["knowledge"]["prices_right"] >= 0.9
    assert one["knowledge"]["prices_right"] <= full["knowledge"]["prices_right"] - 0.5
