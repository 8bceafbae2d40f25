"""Images through the mm_qa ensemble: decode -> vision + VisionZip -> decoder, on a real server."""
from __future__ import annotations

import io

import pytest
from PIL import Image, ImageDraw

from zipmoe.clients.triton_client import ServerError, grpc_generate

pytestmark = pytest.mark.integration


def note(i: int) -> bytes:
    """A small deterministic note image; odd ones are plain, even ones carry text."""
    img = Image.new("RGB", (96 + 32 * (i % 3), 64 + 32 * (i % 2)), (40 * i % 255, 120, 200))
    if i % 2 == 0:
        ImageDraw.Draw(img).text((4, 4), f"note {i}: $ {i}.50", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="JPEG" if i % 3 else "PNG")
    return buf.getvalue()


def answer(server, images, keep=None, **extra):
    inputs = dict(text_input="What do these notes say?", max_tokens=12, ignore_eos=True, **extra)
    if images:
        inputs["images"] = images
    if keep is not None:
        inputs["visual_keep_ratio"] = keep
    responses = list(grpc_generate(server.url_grpc, stream=True, **inputs))
    return "".join(r["text_output"] for r in responses), responses[-1]


@pytest.mark.parametrize("n", [0, 1, 3, 30])
def test_images_answer_and_report_tokens_kept(zipmoe_server, n):
    images = [note(i) for i in range(n)]
    full_text, full = answer(zipmoe_server, images, keep=1.0)
    text, pruned = answer(zipmoe_server, images, keep=0.6)
    assert len(full["visual_tokens_kept"]) == len(pruned["visual_tokens_kept"]) == n
    assert full["output_token_count"] == pruned["output_token_count"] == 12
    if n:
        total = sum(full["visual_tokens_kept"])
        assert sum(pruned["visual_tokens_kept"]) == max(round(0.6 * total), sum(min(k, 4) for k in full["visual_tokens_kept"]))
        assert full["input_token_count"] - pruned["input_token_count"] == total - sum(pruned["visual_tokens_kept"])
    assert answer(zipmoe_server, images, keep=0.6)[0] == text  # deterministic greedy


@pytest.mark.parametrize("images, message", [
    ([b""], "image 0"),
    ([note(0), b"not an image at all"], "image 1"),
    ([note(1), note(2)[:40]], "image 1"),
])
def test_bad_images_are_named_and_server_keeps_answering(zipmoe_server, images, message):
    with pytest.raises(ServerError, match=message):
        answer(zipmoe_server, images)
    assert answer(zipmoe_server, [note(3)])[1]["output_token_count"] == 12


def test_keep_ratio_out_of_range_is_refused(zipmoe_server):
    with pytest.raises(ServerError, match="visual_keep_ratio"):
        answer(zipmoe_server, [note(0)], keep=1.5)


def test_too_many_images_is_refused(zipmoe_server):
    with pytest.raises(ServerError, match="at most 64"):
        answer(zipmoe_server, [note(0)] * 65)


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_a_prompt_longer_than_the_context_names_both_numbers(zipmoe_server, model):
    big = io.BytesIO()
    Image.effect_noise((512, 512), 60).convert("RGB").save(big, format="PNG")
    images = [big.getvalue()] * 20  # 20 x 256 kept tokens at keep 1.0: past max_model_len 4096
    with pytest.raises(ServerError, match=r"has \d+ tokens, 5120 of them the images' kept visual tokens; "
                                          r"the context holds max_model_len 4096"):
        answer(zipmoe_server, images, keep=1.0, model=model)
    assert answer(zipmoe_server, [note(3)], model=model)[1]["output_token_count"] == 12
