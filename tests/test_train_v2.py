"""build/train_v2.py on a CPU: the smoke run writes a checkpoint the engine and the vision encoder
load, its inputs are the server's, and the vision shortcuts for images of many sizes match the
tower's own per-image loops."""
from __future__ import annotations

import json

import pytest
import torch

from zipmoe.build import taskset_v2 as ts
from zipmoe.build.train_v2 import MAX_PIXELS, SMOKE, TaskSetV2Dataset, collate
from zipmoe.build.train_v2_vision import (END, PACKED_IMAGE_ATTENTION, IGNORE, READING_SLOTS, device_pixels,
                                          grid_cached_vision_inputs, token_readings, uint8_patches)
from zipmoe.build.taskset_v2_docs import CHARSET, Mark
from zipmoe.prompt import ChatPrompt
from zipmoe.vision import patchify, pixels_of


@pytest.fixture(scope="module")
def smoke(v2_smoke):
    """conftest's v2_smoke: (checkpoint, training log) of the --smoke run."""
    return v2_smoke


def _batch(checkpoint, split: str, n: int) -> dict:
    data = TaskSetV2Dataset(checkpoint, split, n)
    image_token = json.loads((checkpoint / "config.json").read_text())["image_token_id"]
    return collate([data[i] for i in range(n)], pad_id=0, image_token=image_token)


def test_smoke_run_writes_a_servable_checkpoint(smoke):
    from zipmoe.engine.engine import EngineConfig, LLMEngine
    from zipmoe.image_pipeline import ImageConfig
    from zipmoe.sere_file import load_sere
    from zipmoe.vision import VisionEncoder

    out, log = smoke
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
            "tokenizer.json", "tokenizer_config.json", "train_log.json", "sere.safetensors"} <= names
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["steps"] == 2 and saved["task_set"] == "v2" and torch.isfinite(torch.tensor(saved["final_loss"]))
    assert 0.0 <= saved["val_f1"] <= 1.0 and set(saved["val_by_task"]) <= set(ts.TASKS)
    assert saved["val_blind_loss"] > 0 and all("blind_loss" in v for v in saved["validation"])
    assert saved["throughput"]["examples_per_second"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vision_config"].get("_attn_implementation") != PACKED_IMAGE_ATTENTION  # a training-time choice
    assert ImageConfig.from_checkpoint(out).max_pixels == MAX_PIXELS >= 896 * 896
    engine = LLMEngine(out, EngineConfig(num_kv_blocks=256, max_model_len=4096))
    assert engine.text.num_experts == 32 and engine.text.top_k == 4
    load_sere(out)  # calibrated for this checkpoint
    # the serving vision tower takes a v2 image as drawn: one merged token per 32 x 32 pixels
    image = ts.make_example(0).images[0]
    (feats,) = VisionEncoder(out, torch.device("cpu"), torch.float32).features([pixels_of(image)])
    assert feats.embeds.shape[0] == ts.merged_tokens(image.size)


def test_dataset_matches_the_server_prompt(smoke):
    out = smoke[0]
    item = TaskSetV2Dataset(out, "validation", 1)[0]
    ex = ts.make_example(ts.split_seed("validation", 0))
    prompt = ChatPrompt(out)
    image_token = json.loads((out / "config.json").read_text())["image_token_id"]
    counts = iter([ts.merged_tokens(im.size) for im in ex.images])
    expanded = [t for s in prompt.encode(ex.question, len(ex.images))
                for t in ([s] * next(counts) if s == image_token else [s])]
    ids = item["ids"].tolist()
    assert ids[:len(expanded)] == expanded
    answer = prompt.tokenizer.encode(ex.answer + "<|im_end|>", add_special_tokens=False).ids
    assert ids[len(expanded):] == answer and [t for t in item["labels"].tolist() if t != -100] == answer
    assert item["pixels"].dtype == torch.uint8
    assert item["pixels"].shape[0] == 4 * sum(ts.merged_tokens(im.size) for im in ex.images)
    assert item["readings"].shape == (sum(ts.merged_tokens(im.size) for im in ex.images), READING_SLOTS)


def test_positions_match_the_models_own_rope_index(smoke):
    from transformers import Qwen3VLMoeForConditionalGeneration
    batch = _batch(smoke[0], "validation", 2)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke[0])
    expected, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                                             None, attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["position_ids"][:, real], expected[:, real])


def test_read_entry_and_knowledge_shares_are_training_only(smoke):
    """--read f: that share of the train split's examples are read-entry questions, by index (the
    same pick for every worker); --knowledge g: the next share g are knowledge questions, the rest
    the task set's own mix; validation keeps neither."""
    from zipmoe.build.train_v2 import TRAIN_TASKS
    from zipmoe.build.training import is_training_only

    data = TaskSetV2Dataset(smoke[0], "train", 12, read_fraction=0.3, knowledge_fraction=0.3)
    tasks = [TRAIN_TASKS[data[i]["task"]] for i in range(12)]
    assert [t == ts.READ_TASK for t in tasks] == [is_training_only(i, 0.3) for i in range(12)]
    extra = [is_training_only(i, 0.6) and not is_training_only(i, 0.3) for i in range(12)]
    assert any(extra) and all(t in ts.KNOWLEDGE_TASKS for t, e in zip(tasks, extra) if e)
    # the rest are the seed's own draw, as without the option
    assert all(t == ts.make_example(ts.split_seed("train", i)).task
               for i, (t, e) in enumerate(zip(tasks, extra)) if not e and t != ts.READ_TASK)
    assert ts.READ_TASK not in {TRAIN_TASKS[TaskSetV2Dataset(smoke[0], "validation", 6)[i]["task"]] for i in range(6)}


@pytest.mark.parametrize("index", [0, 1])  # multi_store_price, store_price
def test_knowledge_answers_look_at_the_store_name_and_never_for_the_price(smoke, index):
    """A knowledge answer's printed store name gets attention targets; its recalled prices none (a
    number printed elsewhere that happens to match is not where the price comes from)."""
    data = TaskSetV2Dataset(smoke[0], "train", 2, knowledge_fraction=1.0)
    ex = ts.make_example(ts.split_seed("train", index), knowledge=True)
    inputs = data.text_inputs(ex.question, ex.answer, [(im.height // 32, im.width // 32) for im in ex.images])
    answer_start = len(inputs["ids"]) - len(inputs["answer_offsets"])
    looked = {int(q) - answer_start + 1 for q, _ in data[index]["attend"]}  # the answer tokens with a target
    texts = [ex.answer[a:b] for a, b in inputs["answer_offsets"]]
    assert looked and all(texts[k].strip() and not any(c.isdigit() for c in texts[k]) for k in looked)
    store = next(s for s in ts.STORES if ex.answer.startswith(s))  # the first store: the answer's first words
    in_name = [k for k, (a, b) in enumerate(inputs["answer_offsets"]) if b <= len(store) and texts[k].strip()]
    assert in_name and all(k in looked for k in in_name)  # every word of the name


def test_device_pixels_equal_the_servers_pixels():
    image = ts.make_example(1).images[0]
    reference = patchify(pixels_of(image), 16, 2, 2)
    torch.testing.assert_close(device_pixels(uint8_patches(image, 16, 2), 2), reference, rtol=0, atol=1e-6)


def test_grouped_vision_shortcuts_match_the_towers_per_image_loops(smoke):
    """Images of several sizes (two of one size, apart): grouped SDPA and the cached per-grid inputs
    give the tower's own result."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke[0], dtype=torch.float32).eval()
    visual = model.model.visual
    images = [im.resize(size) for im, size in zip(ts.make_example(2).images * 2,
                                                    [(448, 512), (512, 448), (448, 512), (576, 448)])]
    pixels = torch.cat([patchify(pixels_of(im), 16, 2, 2) for im in images])
    grids = torch.tensor([[1, im.height // 16, im.width // 16] for im in images])
    with torch.no_grad():
        reference = visual(pixels, grid_thw=grids).pooler_output
        visual.config._attn_implementation = PACKED_IMAGE_ATTENTION
        grid_cached_vision_inputs(visual)
        grouped = visual(pixels, grid_thw=grids).pooler_output
        again = visual(pixels, grid_thw=grids).pooler_output  # from the position cache
    torch.testing.assert_close(grouped, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_image_attention_matches_the_grouped_reference():
    """On CUDA in bf16 the packed attention is one variable-length flash call; it gives the grouped
    SDPA's output and gradients (images of three lengths, two of one length apart)."""
    from zipmoe.build.train_v2_vision import grouped_image_attention, packed_image_attention, varlen_applies

    torch.manual_seed(0)
    lengths = [448, 896, 448, 1120]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(1, 3, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    assert varlen_applies(q, 0.0)
    out, _ = packed_image_attention(None, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=max(lengths))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_out = grouped_image_attention(q, k, v, lengths, scaling=0.125).unsqueeze(0)
    ref = torch.autograd.grad(ref_out, (q, k, v), grad)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_in_bf16_match_float32_within_bf16_precision():
    """Under CUDA autocast the grouped expert GEMM runs in bf16: output and weight gradient as the
    float32 one to bf16 precision; without autocast it stays float32."""
    from transformers.integrations import moe

    from zipmoe.build.training import grouped_mm_in_bf16

    torch.manual_seed(0)
    x = torch.randn(96, 64, device="cuda")
    w = torch.randn(4, 64, 32, device="cuda", requires_grad=True)
    offs = torch.tensor([10, 40, 40, 96], device="cuda", dtype=torch.int32)
    reference = moe._grouped_mm(x, w, offs)
    (ref_grad,) = torch.autograd.grad(reference.square().sum(), w)
    grouped_mm_in_bf16()
    grouped_mm_in_bf16()  # idempotent
    assert moe._grouped_mm(x, w, offs).dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = moe._grouped_mm(x, w, offs)
    assert out.dtype == torch.bfloat16
    (grad,) = torch.autograd.grad(out.float().square().sum(), w)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=0.2)
    torch.testing.assert_close(grad, ref_grad, rtol=3e-2, atol=2.0)


def test_token_readings_label_each_block_with_its_characters():
    marks = (Mark(5, 5, "A"), Mark(20, 6, "B"), Mark(40, 10, "1"), Mark(12, 40, "."), Mark(1, 1, "Z"),
             *(Mark(70 + k, 70, "9") for k in range(6)))
    labels = token_readings(marks, (96, 96))  # a 3 x 3 grid of 32-px blocks
    assert labels.shape == (9, READING_SLOTS)
    assert labels[0].tolist() == [CHARSET.index(c) for c in "ZAB"] + [END]  # left to right
    assert labels[1].tolist() == [CHARSET.index("1"), END, IGNORE, IGNORE]
    assert labels[3].tolist() == [CHARSET.index("."), END, IGNORE, IGNORE]
    assert labels[8].tolist() == [CHARSET.index("9")] * READING_SLOTS  # more than fit: the first ones, no END
    assert labels[4].tolist() == [END, IGNORE, IGNORE, IGNORE]  # no text


def test_reading_head_trains_the_tower(smoke):
    from transformers import Qwen3VLMoeForConditionalGeneration
    from zipmoe.build.train_v2_vision import TokenReadingHead
    batch = _batch(smoke[0], "train", 2)
    readings, _ = batch.pop("readings"), batch.pop("task")
    batch["pixel_values"] = device_pixels(batch["pixel_values"], 2)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke[0], dtype=torch.float32)
    head = TokenReadingHead(model.model.visual, model.config.vision_config.out_hidden_size)
    model(**batch)
    assert head.merged.shape[0] == readings.shape[0]
    loss = head.loss(readings)
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def test_v2_size_has_room_for_routing_within_60_mb(smoke):
    """The size trained on the H200: >= 32 experts, top-k >= 4, bf16 weights <= 60 MB."""
    from transformers import PreTrainedTokenizerFast, Qwen3VLMoeForConditionalGeneration
    from zipmoe.build.tiny_checkpoint import model_config
    from zipmoe.build.train_v2 import SIZES
    text, vision = SIZES["v2"]
    config = model_config(PreTrainedTokenizerFast.from_pretrained(smoke[0]), text=text, vision=vision)
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(config)
    params = sum(p.numel() for p in model.parameters())
    assert 2 * params <= 60e6
    assert config.text_config.num_experts >= 32 and config.text_config.num_experts_per_tok >= 4
    assert config.vision_config.patch_size * config.vision_config.spatial_merge_size == ts.PATCH * ts.MERGE


def test_cli_smoke_flag_sets_the_smoke_settings_and_explicit_flags_win(monkeypatch):
    import functools

    from zipmoe.build import train_v2
    seen = {}

    @functools.wraps(train_v2.train)  # main() reads the defaults for its help from train's signature
    def fake_train(**kw):
        seen.update(kw)

    monkeypatch.setattr(train_v2, "train", fake_train)
    train_v2.main(["--out", "x", "--smoke", "--steps", "5", "--no-sere"])
    assert seen == {**SMOKE, "out": "x", "steps": 5, "calibrate_sere": False}
    seen.clear()
    train_v2.main(["--out", "y"])
    assert seen == {"out": "y"}  # everything else: train()'s defaults
    seen.clear()
    train_v2.main(["--out", "z", "--expert-width", "32", "--balance-loss", "0.001", "--router-z-loss", "0.01"])
    assert seen == {"out": "z", "expert_width": 32, "balance_loss": 0.001, "router_z_loss": 0.01}


def test_router_z_term_is_the_mean_squared_logsumexp_of_real_tokens():
    from zipmoe.build.training import router_z_term
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # 3 real tokens, 3 pads (HF flattens batch x sequence)
    layers = (torch.randn(6, 8), torch.randn(6, 8) * 3)
    real = [0, 1, 3]
    want = sum(float(torch.logsumexp(x[real], -1).square().mean()) for x in layers) / len(layers)
    assert float(router_z_term(layers, mask)) == pytest.approx(want, rel=1e-6)
    layers[1][2] = 1e4  # a pad's logits do not count
    assert float(router_z_term(layers, mask)) == pytest.approx(want, rel=1e-6)


def test_routing_knobs_reach_the_checkpoint_config_and_the_log(tmp_path):
    from zipmoe.build import train_v2
    settings = {**SMOKE, "steps": 1, "calibrate_sere": False, "val_examples": 1}
    train_v2.train(tmp_path, **settings, expert_width=16, balance_loss=0.001, router_z_loss=0.01)
    text = json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert (text["moe_intermediate_size"], text["router_aux_loss_coef"]) == (16, 0.001)
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert (log["moe_intermediate_size"], log["router_aux_loss_coef"], log["router_z_loss"]) == (16, 0.001, 0.01)


def test_common_mode_share():
    from zipmoe.build.train_v2_vision import common_mode_share
    torch.manual_seed(0)
    centred = torch.randn(512, 64)
    assert common_mode_share(centred) < 0.01
    assert common_mode_share(centred + 100.0) > 0.99  # one shared vector dominates
    assert abs(float(common_mode_share(torch.ones(4, 8))) - 1.0) < 1e-6


def test_visual_stats_cover_merged_tokens_and_deepstack(smoke):
    from transformers import Qwen3VLMoeForConditionalGeneration
    from zipmoe.build.train_v2_vision import TokenReadingHead
    batch = _batch(smoke[0], "train", 2)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke[0], dtype=torch.float32)
    head = TokenReadingHead(model.model.visual, model.config.vision_config.out_hidden_size)
    model.model.visual(device_pixels(batch["pixel_values"], 2), grid_thw=batch["image_grid_thw"])
    stats = head.visual_stats()
    n = 1 + len(model.config.vision_config.deepstack_visual_indexes)
    assert len(stats["token_norm"]) == len(stats["common_mode"]) == n
    assert all(v > 0 for v in stats["token_norm"]) and all(0 <= v <= 1 for v in stats["common_mode"])


def test_centering_penalty_centres_the_visual_tokens(smoke):
    """The tower at initialisation keeps most of its tokens' energy in their mean vector; a few
    steps on the penalty alone bring every visual feature (merged tokens, DeepStack) down to the
    allowance, and the head's loss adds the weighted penalty."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    from zipmoe.build.train_v2_vision import TokenReadingHead
    batch = _batch(smoke[0], "train", 2)
    readings = batch["readings"]
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(smoke[0], dtype=torch.float32)
    visual = model.model.visual
    head = TokenReadingHead(visual, model.config.vision_config.out_hidden_size)
    inputs = dict(hidden_states=device_pixels(batch["pixel_values"], 2), grid_thw=batch["image_grid_thw"])
    visual(**inputs)
    assert max(head.visual_stats()["common_mode"]) > head.COMMON_MODE_ALLOWANCE
    penalty, reading_only = float(head.common_mode_penalty().detach()), float(head.loss(readings).detach())
    head.centering = 2.0
    assert penalty > 0 and abs(float(head.loss(readings).detach()) - (reading_only + 2.0 * penalty)) < 1e-4
    opt = torch.optim.Adam(visual.parameters(), lr=1e-3)
    for _ in range(30):
        visual(**inputs)
        opt.zero_grad()
        head.common_mode_penalty().backward()
        opt.step()
    visual(**inputs)
    assert max(head.visual_stats()["common_mode"]) <= head.COMMON_MODE_ALLOWANCE + 0.05
