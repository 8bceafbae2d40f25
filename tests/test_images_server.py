"""Images through the mm_qa ensemble: decode -> vision + VisionZip -> decoder, on a real server; over gRPC
(file bytes) and over HTTP generate (base64 text, data URLs)."""
from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import pytest
from PIL import Image, ImageDraw

from zipmoe.clients.triton_client import ServerError, grpc_generate, http_generate, http_generate_stream

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


def _post(server, model: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{server.url_http}/v2/models/{model}/generate", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read())}


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_images_over_http_generate_answer_as_over_grpc(zipmoe_server, model):
    images = [note(0), note(1), note(2)]
    text, ref = answer(zipmoe_server, images, model=model)
    options = dict(text_input="What do these notes say?", max_tokens=12, ignore_eos=True, images=images)
    assert http_generate(zipmoe_server.url_http, model=model, **options)["text_output"] == text
    sse = list(http_generate_stream(zipmoe_server.url_http, model=model, **options))
    assert "".join(r["text_output"] for r in sse) == text and sse[-1]["visual_tokens_kept"] == ref["visual_tokens_kept"]
    # A JSON body written by hand: a data URL, plain base64, and base64 wrapped as `base64` prints it.
    body = {**options, "images": ["data:image/png;base64," + base64.b64encode(images[0]).decode(),
                                  base64.b64encode(images[1]).decode(), base64.encodebytes(images[2]).decode()]}
    assert _post(zipmoe_server, model, body)["text_output"] == text


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_broken_base64_over_http_is_a_400_naming_the_image(zipmoe_server, model):
    body = {"text_input": "What?", "images": [base64.b64encode(note(0)).decode(), "aGVsbG8gd"]}
    out = _post(zipmoe_server, model, body)
    assert out["status"] == 400 and "image 1: not valid base64" in out["error"]
    # generate_stream answers a refusal as a server-sent event, which the client reads as the error
    with pytest.raises(ServerError, match="image 1"):
        list(http_generate_stream(zipmoe_server.url_http, model=model, text_input="What?",
                                  images=[note(0), b"not an image"]))
