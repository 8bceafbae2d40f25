"""The training script end to end on a CPU, at the tiny checkpoint's size: it writes a checkpoint
the engine and the vision encoder load, with inputs built exactly as the server builds them."""
from __future__ import annotations

import json

import pytest
import torch

from zipmoe.build import notes_data
from zipmoe.build.train_tiny import NotesDataset, answer_exact_match, collate, train
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.prompt import ChatPrompt


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke-sized trained checkpoint (a single step) for the tests that only read it."""
    out = tmp_path_factory.mktemp("smoke")
    train(out, size="smoke", steps=1, batch=1, minutes=5, device="cpu", workers=0, val_examples=1,
          calibrate_sere=False)
    return out


def smoke_batch(checkpoint, split: str, n: int, **dataset) -> dict:
    """The first n examples of a split, collated as training does."""
    data = NotesDataset(checkpoint, split, n, **dataset)
    image_token = json.loads((checkpoint / "config.json").read_text())["image_token_id"]
    return collate([data[i] for i in range(n)], pad_id=0, image_token=image_token)


def test_train_smoke_writes_a_servable_checkpoint(tmp_path):
    log = train(tmp_path, size="smoke", steps=3, batch=2, minutes=5, device="cpu", workers=0, val_examples=2,
                calibrate_sere=False)
    assert log["steps"] == 3 and torch.isfinite(torch.tensor(log["final_loss"]))
    assert 0.0 <= log["val_exact_match"] <= 1.0 and set(log["val_by_task"]) <= set(notes_data.TASKS)
    assert json.loads((tmp_path / "train_log.json").read_text())["seed"] == 0
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=16, max_model_len=256))
    assert engine.text.num_experts == 16 and engine.text.top_k == 4


def test_dataset_matches_the_server_prompt(smoke):
    item = NotesDataset(smoke, "validation", 1)[0]
    ex = notes_data.make_example(notes_data.split_seed("validation", 0))
    prompt = ChatPrompt(smoke)
    cfg = json.loads((smoke / "config.json").read_text())
    image_token = cfg["image_token_id"]
    server_ids = prompt.encode(ex.question, len(ex.images))
    ids = item["ids"].tolist()
    # The server's prompt with each image placeholder expanded to 16 merged tokens (128 x 128 pixels) ...
    expanded = [t for s in server_ids for t in ([s] * 16 if s == image_token else [s])]
    assert ids[:len(expanded)] == expanded
    # ... then the answer and <|im_end|>, the only labelled tokens.
    answer = prompt.tokenizer.encode(ex.answer + "<|im_end|>", add_special_tokens=False).ids
    assert ids[len(expanded):] == answer
    assert [t for t in item["labels"].tolist() if t != -100] == answer
    assert len(prompt.tokenizer.encode("37", add_special_tokens=False).ids) == 2  # digits split, as Qwen does
    assert item["pixels"].shape == (len(ex.images) * 64, 3 * 2 * 16 * 16)
    batch = collate([item, item], pad_id=0, image_token=image_token)
    assert batch["mm_token_type_ids"].sum() == 2 * 16 * len(ex.images)


def test_answer_exact_match_needs_every_answer_token():
    labels = torch.tensor([[-100, -100, 5, 6], [-100, -100, 5, 6]])
    logits = torch.zeros(2, 4, 10)
    logits[0, 1, 5] = logits[0, 2, 6] = 1  # both answer tokens right
    logits[1, 1, 5] = logits[1, 2, 7] = 1  # the second one wrong
    assert answer_exact_match(logits, labels).tolist() == [True, False]


def test_positions_match_the_models_own_rope_index(smoke):
    """The workers' mRoPE positions (the engine's splice) equal what the HF model computes itself."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    batch = smoke_batch(smoke, "validation", 3)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke)
    expected, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                                             None, attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["position_ids"][:, real], expected[:, real])


def test_one_grid_vision_shortcuts_match_the_towers_per_image_loops(smoke):
    """Training's batched vision attention and once-built rotary positions give the tower's own result."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    from zipmoe.build.train_tiny import UNIFORM_IMAGE_ATTENTION, one_grid_vision_inputs
    cfg = json.loads((smoke / "config.json").read_text())
    assert "_attn_implementation" not in cfg["vision_config"] or cfg["vision_config"]["_attn_implementation"] != UNIFORM_IMAGE_ATTENTION
    batch = smoke_batch(smoke, "validation", 2)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke, dtype=torch.float32).eval()
    visual = model.model.visual
    with torch.no_grad():
        reference = visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
        visual.config._attn_implementation = UNIFORM_IMAGE_ATTENTION
        one_grid_vision_inputs(visual)
        batched = visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    torch.testing.assert_close(batched, reference, rtol=1e-4, atol=1e-5)


def test_describe_examples_are_mixed_in_at_the_asked_share(smoke):
    from zipmoe.build.train_tiny import TRAIN_TASKS
    from zipmoe.build.training import is_training_only as is_describe
    share = sum(is_describe(k, 0.3) for k in range(1000)) / 1000
    assert abs(share - 0.3) < 0.01
    assert not any(is_describe(k, 0.0) for k in range(1000))
    data = NotesDataset(smoke, "train", 20, describe_fraction=0.3)
    tasks = [TRAIN_TASKS[data[i]["task"]] for i in range(20)]
    assert tasks.count("describe") == sum(is_describe(k, 0.3) for k in range(20))
    k = tasks.index("describe")
    ex = notes_data.make_describe_example(notes_data.split_seed("train", k))
    prompt = ChatPrompt(smoke)
    answer = prompt.tokenizer.encode(ex.answer + "<|im_end|>", add_special_tokens=False).ids
    assert [t for t in data[k]["labels"].tolist() if t != -100] == answer
    # validation holds the six tasks only
    assert all(TRAIN_TASKS[NotesDataset(smoke, "validation", 20)[i]["task"]] != "describe" for i in range(20))


def test_grouped_mm_experts_train_like_the_expert_loop(smoke):
    """The experts implementation training uses gives the per-expert loop's loss and gradients."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    batch = smoke_batch(smoke, "train", 3, describe_fraction=0.3)
    batch.pop("task"), batch.pop("readings")
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke, dtype=torch.float32)
    results = []
    for experts in ("eager", "grouped_mm"):
        model.config.text_config._experts_implementation = experts
        model.zero_grad()
        loss = model(**batch, output_router_logits=True).loss
        loss.backward()
        results.append((loss.detach(), model.model.language_model.layers[0].mlp.experts.gate_up_proj.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


def test_reading_head_reads_each_images_digits_from_its_merged_tokens(smoke):
    from transformers import Qwen3VLMoeForConditionalGeneration
    from zipmoe.build.train_tiny import ReadingHead
    cfg = json.loads((smoke / "config.json").read_text())
    batch = smoke_batch(smoke, "train", 4)
    assert batch["readings"].shape == (batch["image_grid_thw"].shape[0], notes_data.READING_SLOTS)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke, dtype=torch.float32)
    head = ReadingHead(model.model.visual, 16, cfg["vision_config"]["out_hidden_size"])
    readings = batch.pop("readings")
    batch.pop("task")
    model(**batch)  # the hook keeps the merged tokens of this forward
    assert head.merged.shape[0] == 16 * readings.shape[0]
    loss = head.loss(readings)
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    # Only the digits an image shows count: plain images and unused slots are ignored.
    logits = head.linear(head.merged.detach().view(readings.shape[0], -1)).view(-1, 10)
    keep = readings.view(-1) != notes_data.NO_DIGIT
    expected = torch.nn.functional.cross_entropy(logits[keep], readings.view(-1)[keep])
    torch.testing.assert_close(loss.detach(), expected.detach())


def test_training_falls_back_to_the_expert_loop_without_grouped_gemm(tmp_path, monkeypatch):
    from zipmoe.build import train_tiny
    assert train_tiny.grouped_mm_trains_on(torch.device("cpu"))  # this torch has it on CPU
    monkeypatch.setattr(train_tiny, "grouped_mm_trains_on", lambda device: False)
    log = train(tmp_path, size="smoke", steps=1, batch=1, minutes=5, device="cpu", workers=0, val_examples=1,
                calibrate_sere=False)
    assert log["experts"] == "eager"
