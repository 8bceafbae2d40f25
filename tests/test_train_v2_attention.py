"""build/train_v2_attention.py: answer tokens aligned with the visual tokens they are read from, and
the supervised head's attention scored as the model computes it."""
from __future__ import annotations

import json

import torch

from zipmoe.build.taskset_v2_docs import CHARSET, Mark
from zipmoe.build.train_v2 import TaskSetV2Dataset, collate
from zipmoe.build.train_v2_attention import ATTENTION, AnswerAttention, attention_targets, char_marks
from zipmoe.build.train_v2_vision import device_pixels
from zipmoe.prompt import ChatPrompt


def test_char_marks_prefer_the_named_image_and_follow_on():
    marks = [tuple(Mark(10.0 * k, 5.0, ch) for k, ch in enumerate("TEA1.99")),
             tuple(Mark(10.0 * k, 40.0, ch) for k, ch in enumerate("TEA2.50MILK1.99"))]
    chars = char_marks("TEA 2.50, MILK 1.99", marks, "list the items in image 2.")
    assert [c[0] for c in chars if c is not None] == [1] * 15  # image 2 first, though image 1 also has TEA
    assert chars[3] is None and chars[8] is None  # the space; the list comma is not printed
    assert chars[15][1] == Mark(110.0, 40.0, "1")  # MILK's price, after MILK: not image 2's first "1"
    assert char_marks("a red circle", marks, "what shapes?") == [None] * 12
    found = char_marks("image 1, 1.99", marks, "which image has a tag for TEA?")  # multi_find's answer
    assert found[:9] == [None] * 9 and found[9] == (0, marks[0][3])  # not image 1's number: its price


def test_every_target_is_a_visual_token_that_prints_the_answer_tokens_first_character(v2_smoke):
    checkpoint = v2_smoke[0]
    data = TaskSetV2Dataset(checkpoint, "validation", 24)
    tokenizer = ChatPrompt(checkpoint).tokenizer
    image_token = json.loads((checkpoint / "config.json").read_text())["image_token_id"]
    found = 0
    for i in range(len(data)):
        item = data[i]
        image_index = torch.cumsum(item["ids"] == image_token, 0) - 1  # position -> index among the visual tokens
        for query, key in item["attend"].tolist():
            assert item["ids"][key] == image_token and query > key  # the images precede the answer
            text = tokenizer.decode([int(item["ids"][query + 1])]).lstrip()
            printed = item["readings"][image_index[key]].tolist()  # the characters that block holds
            assert CHARSET.index(text[0]) in printed, (i, text, printed)
            found += 1
        labels = item["labels"]
        assert all(labels[q + 1] != -100 for q, _ in item["attend"].tolist())  # answer tokens only
    assert found > 24  # most answers transcribe printed text


def test_targets_skip_tokens_without_printed_characters():
    chars = [None, (0, Mark(40.0, 70.0, "7"))]
    targets = attention_targets(" 7", [(0, 1), (1, 2), (2, 2)], answer_start=100, image_starts=[10],
                                image_cols=[14], chars=chars)
    assert targets.tolist() == [[100, 10 + 2 * 14 + 1]]  # token 1 at 101, predicted from 100; block (2, 1)


def test_collate_puts_each_examples_row_in_front_of_its_targets(v2_smoke):
    data = TaskSetV2Dataset(v2_smoke[0], "validation", 3)
    items = [data[i] for i in range(3)]
    batch = collate(items, pad_id=0, image_token=0)
    assert batch["attend"].tolist() == [[i, *t] for i, item in enumerate(items) for t in item["attend"].tolist()]


def test_head_loss_equals_the_models_own_attention(v2_smoke):
    """The captured queries and keys (after q/k norm and mRoPE) give the same attention as the
    model's eager attention weights of that layer and head."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    checkpoint = v2_smoke[0]
    data = TaskSetV2Dataset(checkpoint, "validation", 2)
    image_token = json.loads((checkpoint / "config.json").read_text())["image_token_id"]
    batch = collate([data[i] for i in range(2)], pad_id=0, image_token=image_token)
    for key in ("task", "readings"):
        del batch[key]
    targets = batch.pop("attend")
    batch["pixel_values"] = device_pixels(batch["pixel_values"], 2)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    text = model.config.text_config
    layer = text.num_hidden_layers - 1
    looking = AnswerAttention(model, layer, head=1)
    text._attn_implementation = ATTENTION
    with torch.no_grad():
        model(**batch)
        loss = looking.loss(targets)
        right, total = looking.hits(targets)
        text._attn_implementation = "eager"
        weights = model(**batch, output_attentions=True).attentions[layer][:, 1]  # [batch, length, length]
    p = weights[targets[:, 0], targets[:, 1], targets[:, 2]]
    assert torch.allclose(loss, -p.log().mean(), atol=1e-4)
    expected = (weights[targets[:, 0], targets[:, 1]].argmax(-1) == targets[:, 2]).sum()
    assert (right, total) == (int(expected), len(targets))



def test_smoke_run_trains_and_validates_the_head_and_saves_the_plain_model(v2_smoke):
    checkpoint, log = v2_smoke
    assert log["attend_loss"] > 0 and all(len(row) == 4 for row in log["losses"])  # total, reading, attention
    assert 0.0 <= log["val_looks_right"] <= 1.0
    text = json.loads((checkpoint / "config.json").read_text())["text_config"]
    assert text.get("_attn_implementation") != ATTENTION  # the capture is training's, not the checkpoint's
