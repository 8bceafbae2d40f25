"""image_decode: the DALI pipeline against Pillow and transformers (unit), and the served model (integration)."""
from __future__ import annotations

import base64
import functools
import io
import struct
import time
import zlib

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from nvidia.dali import Pipeline, pipeline_def
import nvidia.dali.fn as fn
import nvidia.dali.types as types
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from tritonclient.utils import InferenceServerException

from zipmoe.build.dali_model import build_dali_model
from zipmoe.image_pipeline import INPUT_NAME, ImageConfig, image_pipeline, smart_resize

# DALI vs Pillow, in uint8 levels of the resized image (|error| * std * 255). Both quantise the
# resized image to uint8, but PIL resizes in two passes with fixed-point weights and a uint8
# intermediate, DALI in float (the decoded pixels themselves agree: unresized images match
# exactly). Measured on these images: at most 6 levels (next to the sharp edges, where bicubic
# overshoots), mean at most 0.24, under 0.5 % of the values more than 1 level apart.
MAX_LEVELS, MEAN_LEVELS, FRACTION_OVER_ONE_LEVEL = 8, 0.4, 0.01

SIZES = [(50, 70), (64, 64), (100, 100), (333, 517), (20, 900), (768, 1024), (1200, 700)]
FORMATS = {  # format -> modes it stores
    "JPEG": ("RGB", "L"), "PNG": ("RGB", "L", "RGBA"), "BMP": ("RGB", "L"),
    "TIFF": ("RGB", "L", "RGBA"), "WEBP": ("RGB", "RGBA"),
}
CASES = [(fmt, mode, h, w) for h, w in SIZES for fmt, modes in FORMATS.items() for mode in modes]
CASES += [("JPEG", "RGB", 2000, 3000), ("PNG", "L", 2000, 3000)]  # a large downscale, in two formats only


@functools.cache
def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth colour waves, noise and one sharp-edged block: what resizing finds in photos."""
    y, x = np.mgrid[0:height, 0:width]
    a = np.stack([128 + 100 * np.sin(x / 17 + c) * np.cos(y / 23 - c) for c in range(3)], -1)
    a += np.random.default_rng(seed).normal(0, 20, a.shape)
    a[height // 3: height // 2, width // 4: width // 2] = [250, 10, 30]
    return np.clip(a, 0, 255).astype(np.uint8)


def encode(array: np.ndarray, fmt: str, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).convert(mode).save(buf, fmt)
    return buf.getvalue()


def oversized_jpeg(width: int, height: int) -> bytes:
    """A small valid JPEG whose frame header announces width x height."""
    jpeg = bytearray(encode(photo(8, 8), "JPEG"))
    sof = jpeg.index(b"\xff\xc0")  # baseline frame: marker, length, precision, height, width
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(jpeg)


def oversized_png(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR announces width x height (CRC fixed up)."""
    png = bytearray(encode(photo(8, 8), "PNG"))
    png[16:24] = struct.pack(">II", width, height)  # after signature(8), length(4), "IHDR"(4)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint) -> ImageConfig:
    return ImageConfig.from_checkpoint(tiny_checkpoint)


def pillow_reference(data: bytes, cfg: ImageConfig) -> np.ndarray:
    """The same preprocessing with Pillow: RGB, smart resize, bicubic, (x/255 - mean)/std, CHW."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    h, w = hf_smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    x = np.asarray(image.resize((w, h), Image.BICUBIC), np.float32) / 255
    return ((x - np.float32(cfg.mean)) / np.float32(cfg.std)).transpose(2, 0, 1)


def run_pipeline(pipe, images: list[bytes]):
    pipe.feed_input(INPUT_NAME, [np.frombuffer(d, np.uint8) for d in images])
    return pipe.run()


def levels(a: np.ndarray, b: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    return np.abs(a - b) * np.float32(cfg.std)[:, None, None] * 255


# ---------------------------------------------------------------- unit: no server


def test_smart_resize_matches_transformers_exactly():
    """The in-graph smart resize gives transformers' integers: ties of round(), both scaling branches,
    tiny and huge images, several processor configurations."""
    rng = np.random.default_rng(0)
    ties = (14, 16, 42, 48, 70, 80, 112)  # round() ties for factors 28 and 32, odd and even quotients
    edges = [(h, w) for h in (1, 2, 15, 17, 31, 32, 33, *ties) for w in (1, 16, 48, 200, 333, *ties)]
    hw = np.concatenate([rng.integers(1, 12000, (3000, 2)), rng.integers(1, 300, (1000, 2)), np.array(edges)])
    hw = hw[hw.max(1) / hw.min(1) <= 200]  # transformers refuses the rest (the model checks it)
    for factor, min_pixels, max_pixels in [(32, 64 * 64, 512 * 512), (28, 56 * 56, 28 * 28 * 1280),
                                           (32, 4 * 32 * 32, 16384 * 32 * 32)]:
        @pipeline_def(batch_size=len(hw), num_threads=2, device_id=None, prefetch_queue_depth=1)
        def pipe():
            shape = fn.external_source(name="hw", dtype=types.INT64)
            h, w = smart_resize(shape[0], shape[1], factor, min_pixels, max_pixels)
            return fn.cast(fn.stack(h, w), dtype=types.INT64)

        p = pipe()
        p.feed_input("hw", list(hw))
        got = p.run()[0].as_array()
        want = np.array([hf_smart_resize(int(h), int(w), factor, min_pixels, max_pixels) for h, w in hw])
        assert np.array_equal(got, want), hw[(got != want).any(1)][:5]


def test_pillow_reference_is_transformers(cfg, tiny_checkpoint):
    """Our Pillow reference computes what transformers' Qwen2-VL PIL processor computes (its patches,
    put back into CHW), so matching it means matching the Hugging Face preprocessing."""
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_checkpoint)
    p, m = processor.patch_size, processor.merge_size
    for h, w in [(50, 70), (333, 517), (768, 1024)]:
        data = encode(photo(h, w), "PNG")
        out = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        _, gh, gw = out["image_grid_thw"][0]
        ref = pillow_reference(data, cfg)
        assert ref.shape == (3, gh * p, gw * p)
        patches = out["pixel_values"].reshape(gh // m, gw // m, m, m, 3, processor.temporal_patch_size, p, p)[..., 0, :, :]
        hf = patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(ref.shape)
        np.testing.assert_allclose(hf, ref, atol=1e-6)


@pytest.fixture(scope="module")
def pipeline_outputs(cfg):
    images = [encode(photo(h, w, seed=h + w), fmt, mode) for fmt, mode, h, w in CASES]
    pipe = image_pipeline(cfg, batch_size=len(images), num_threads=2, device_id=None, gpu=False)
    pixels, sizes = run_pipeline(pipe, images)
    return images, [np.asarray(t) for t in pixels], sizes.as_array()


@pytest.mark.parametrize("index", range(len(CASES)), ids=["%s-%s-%dx%d" % c for c in CASES])
def test_pipeline_matches_pillow(index, cfg, pipeline_outputs):
    images, pixels, sizes = pipeline_outputs
    ref = pillow_reference(images[index], cfg)
    out = pixels[index]
    assert out.dtype == np.float32 and out.shape == ref.shape and tuple(sizes[index]) == ref.shape[1:]
    err = levels(out, ref, cfg)
    assert err.max() <= MAX_LEVELS and err.mean() <= MEAN_LEVELS and (err > 1.01).mean() <= FRACTION_OVER_ONE_LEVEL


def test_serialised_pipeline_pads_rows(tiny_checkpoint, tmp_path, pipeline_outputs):
    """model.dali (its CPU variant here) runs the same graph; each row is one image's CHW values,
    zero-padded to the longest of the batch, as the native DALI backend needs."""
    path = build_dali_model(tmp_path, tiny_checkpoint, max_images=4, gpu=False)
    assert path == tmp_path / "model.dali"
    images, pixels, sizes = pipeline_outputs
    pick = [0, len(CASES) // 2, len(CASES) - 1]
    rows, got_sizes = run_pipeline(Pipeline.deserialize(filename=str(path)), [images[i] for i in pick])
    rows = rows.as_array()
    assert rows.shape == (3, max(pixels[i].size for i in pick))
    for row, i in zip(rows, pick):
        n = pixels[i].size
        assert np.array_equal(row[:n], pixels[i].ravel()) and not row[n:].any()
    assert np.array_equal(got_sizes.as_array(), sizes[pick])


# ---------------------------------------------------------------- integration: the served model


@pytest.fixture(scope="module")
def client(zipmoe_server):
    with grpcclient.InferenceServerClient(zipmoe_server.url_grpc) as c:
        yield c


def decode(client, images: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    inp = grpcclient.InferInput("images", [len(images)], "BYTES")
    inp.set_data_from_numpy(np.array(images, dtype=object))
    result = client.infer("image_decode", [inp])
    return result.as_numpy("pixel_values"), result.as_numpy("image_sizes")


def split(pixel_values: np.ndarray, image_sizes: np.ndarray) -> list[np.ndarray]:
    ends = np.cumsum([3 * h * w for h, w in image_sizes])
    assert ends[-1] == pixel_values.size
    return [p.reshape(3, h, w) for p, (h, w) in zip(np.split(pixel_values, ends[:-1]), image_sizes)]


GOOD = [encode(photo(768, 1024), "JPEG"), encode(photo(50, 70, 1), "PNG", "L"), encode(photo(333, 517, 2), "WEBP", "RGBA")]


def assert_good_request_works(client, cfg):
    pixel_values, image_sizes = decode(client, GOOD)
    assert pixel_values.dtype == np.float32 and image_sizes.dtype == np.int32
    for out, data in zip(split(pixel_values, image_sizes), GOOD):
        ref = pillow_reference(data, cfg)
        assert out.shape == ref.shape
        err = levels(out, ref, cfg)
        assert err.max() <= MAX_LEVELS and err.mean() <= MEAN_LEVELS


@pytest.mark.integration
def test_served_three_images(client, cfg):
    pixel_values, image_sizes = decode(client, GOOD)
    assert image_sizes.tolist() == [[416, 576], [64, 64], [320, 512]]
    assert_good_request_works(client, cfg)


@pytest.mark.integration
def test_served_no_images(client):
    """`images` is optional (mm_qa passes it on only when the client sent it): empty outputs."""
    result = client.infer("image_decode", [])
    assert result.as_numpy("pixel_values").shape == (0,) and result.as_numpy("image_sizes").shape == (0, 2)


@pytest.mark.integration
def test_served_sizes_alone_when_only_sizes_are_asked(client):
    """A caller asking only for image_sizes gets them (the same as with the pixels), and no pixels."""
    inp = grpcclient.InferInput("images", [len(GOOD)], "BYTES")
    inp.set_data_from_numpy(np.array(GOOD, dtype=object))
    result = client.infer("image_decode", [inp], outputs=[grpcclient.InferRequestedOutput("image_sizes")])
    assert result.as_numpy("image_sizes").tolist() == [[416, 576], [64, 64], [320, 512]]
    assert result.as_numpy("pixel_values") is None


@pytest.mark.integration
def test_served_base64_and_data_urls_decode_as_file_bytes(client):
    """Images as HTTP clients send them (mm_qa hands the client's images to this model unchanged)."""
    encoded = [base64.b64encode(GOOD[0]), b"data:image/jpeg;base64," + base64.b64encode(GOOD[1]), GOOD[2]]
    assert [s.tolist() for s in decode(client, encoded)] == [s.tolist() for s in decode(client, GOOD)]


@pytest.mark.integration
def test_served_expected_images_must_match(client, cfg):
    """mm_qa passes preprocess's image count: a request whose images number otherwise is refused."""
    images = grpcclient.InferInput("images", [len(GOOD)], "BYTES")
    images.set_data_from_numpy(np.array(GOOD, dtype=object))
    expected = grpcclient.InferInput("expected_images", [1], "INT32")
    expected.set_data_from_numpy(np.array([len(GOOD)], np.int32))
    assert client.infer("image_decode", [images, expected]).as_numpy("image_sizes").shape == (len(GOOD), 2)
    expected.set_data_from_numpy(np.array([len(GOOD) + 1], np.int32))
    with pytest.raises(InferenceServerException, match=f"{len(GOOD)} images, but the prompt has places for {len(GOOD) + 1}"):
        client.infer("image_decode", [images, expected])
    assert_good_request_works(client, cfg)


JPEG = encode(photo(100, 100), "JPEG")
BAD_REQUESTS = {
    "undecodable": ([JPEG, b"this is not an image at all" * 4], "image 1: cannot decode"),
    "truncated": ([JPEG, JPEG, JPEG[: len(JPEG) // 2]], "image 2: cannot decode"),
    "empty": ([JPEG, JPEG, b""], "image 2: empty"),
    # The IHDR says 20000x20000 but the file is tiny: refused from the header, before decoding
    # (decoding would fail differently, with "cannot decode").
    "oversized header": ([oversized_png(20000, 20000), JPEG], "image 0: 20000x20000 = 400000000 pixels"),
    # The same from a JPEG's frame header (read without DALI), behind two images that pass.
    "oversized JPEG header": ([JPEG, encode(photo(30, 40), "PNG"), oversized_jpeg(30000, 20000)],
                              "image 2: 30000x20000 = 600000000 pixels"),
    "too many": ([JPEG] * 65, "65 images; this deployment accepts at most 64"),
    "aspect ratio": ([JPEG, encode(photo(10, 2500), "PNG")], "image 1: 2500x10: aspect ratio above 200:1"),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_served_bad_request_names_the_image_and_the_next_works(name, client, cfg):
    images, message = BAD_REQUESTS[name]
    with pytest.raises(InferenceServerException, match=message):
        decode(client, images)
    assert_good_request_works(client, cfg)


@pytest.mark.integration
def test_served_thirty_photos(client):
    """The design's request: 30 photos of 1024x768. Prints the CPU throughput (pytest -s)."""
    images = [encode(photo(768, 1024), "JPEG")] * 30  # DALI caches nothing: 30 full decodes
    decode(client, images)  # this request's shapes are warm from load; one more run for the timing
    start = time.perf_counter()
    pixel_values, image_sizes = decode(client, images)
    seconds = time.perf_counter() - start
    assert image_sizes.tolist() == [[416, 576]] * 30 and pixel_values.size == 30 * 3 * 416 * 576
    print(f"\nimage_decode: 30 JPEGs 1024x768 ({sum(map(len, images)) / 30e3:.0f} kB each) in "
          f"{seconds * 1e3:.0f} ms, {30 / seconds:.0f} images/s")
