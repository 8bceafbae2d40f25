"""Images end to end through our vision wrapper + engine against transformers' full model (keep 1.0)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.multimodal import VisualInputs, splice_images
from zipmoe.engine.sequence import SamplingParams
from zipmoe.prompt import ChatPrompt
from zipmoe.vision import VisionEncoder, patchify
from zipmoe.visionzip import compress

SIZES = [(64, 96), (128, 64), (32, 32)]  # (h, w), multiples of patch * merge = 32
STEPS = 16


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, h, w, generator=g) for h, w in SIZES]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def visual_request(encoder, chat, images, keep):
    """What moe_decoder builds from the vision encoder's outputs."""
    tokens = compress(encoder.features(images), keep)
    prompt = chat.encode("Compare these pictures.", len(images))
    ids, positions, delta = splice_images(
        prompt, encoder_image_token(chat), [t.embeds.shape[0] for t in tokens],
        torch.cat([t.positions for t in tokens]), [t.grid for t in tokens])
    visual = VisualInputs(torch.cat([t.embeds for t in tokens]), torch.cat([t.deepstack for t in tokens], dim=1),
                          positions, delta)
    return ids, visual, tokens


def encoder_image_token(chat):
    return chat.tokenizer.token_to_id("<|image_pad|>")


def test_keep_one_matches_transformers_full_model(tiny_checkpoint, reference, images):
    encoder = VisionEncoder(tiny_checkpoint, torch.device("cpu"), torch.float32)
    chat = ChatPrompt(tiny_checkpoint)
    ids, visual, tokens = visual_request(encoder, chat, images, 1.0)
    assert [t.embeds.shape[0] for t in tokens] == [h * w // (32 * 32) for h, w in SIZES]

    engine = LLMEngine(tiny_checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=512))
    seq = engine.add_request(ids, SamplingParams(max_tokens=STEPS, ignore_eos=True), visual=visual)
    inputs, step, _ = engine.runner.prepare_mixed(engine.scheduler.schedule())
    ours = engine.model.forward(inputs, step, engine.runner.kv, torch.arange(len(ids))).logits

    pixel_values = torch.cat([patchify(im, 16, 2, 2) for im in images])
    grid = torch.tensor([[1, h // 16, w // 16] for h, w in SIZES])
    image_id = encoder_image_token(chat)
    hf_ids = torch.tensor([ids])
    kwargs = dict(pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=(hf_ids == image_id).int())
    with torch.no_grad():
        ref = reference(input_ids=hf_ids, **kwargs).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)

    while engine.has_work:
        engine.step()
    want = reference.generate(hf_ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, **kwargs)
    assert seq.output_ids == want[0, len(ids):].tolist()


def test_pruned_request_keeps_positions_of_the_full_grid(tiny_checkpoint, images):
    encoder = VisionEncoder(tiny_checkpoint, torch.device("cpu"), torch.float32)
    chat = ChatPrompt(tiny_checkpoint)
    full_ids, full, _ = visual_request(encoder, chat, images, 1.0)
    ids, pruned, tokens = visual_request(encoder, chat, images, 0.5)
    per_image = [h * w // 1024 for h, w in SIZES]  # 6, 8, 1 merged tokens
    floors = sum(min(n, 4) for n in per_image)  # 9 > half of 15: the per-image floors win
    assert sum(t.embeds.shape[0] for t in tokens) == max(floors, round(0.5 * sum(per_image)))
    # Text after the images sits where it sat in the unpruned prompt.
    assert torch.equal(pruned.positions[:, -5:], full.positions[:, -5:])
    assert pruned.rope_delta == full.rope_delta + (len(full_ids) - len(ids))
