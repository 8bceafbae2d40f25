"""bench_image_decode runs on the CPU at a small size and writes one row per part (no timing is
asserted); on a GPU every decoder option builds and decodes to the CPU graph's shapes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zipmoe.clients.bench_common import synthetic_jpeg
from zipmoe.image_pipeline import DecoderOptions, ImageConfig, image_pipeline
from zipmoe.kernels.benchmarks import bench_image_decode


def test_the_image_decode_bench_writes_its_rows(tmp_path):
    out = tmp_path / "image_decode"
    assert bench_image_decode.main(["--images", "2", "--size", "64x48", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert (result["images"], result["size"]) == (2, "64x48")
    parts = [r["part"] for r in result["rows"]]
    if result["device"] == "cpu":  # one CPU graph: the options are the GPU decoder's
        assert parts == ["header pass", "decode only", "pipeline"]
    else:
        assert parts.count("pipeline") == parts.count("decode only") == 2 * len(bench_image_decode.HW_DECODER_LOADS)
    assert all(r["ms"] > 0 and r["images_per_s"] > 0 for r in result["rows"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [DecoderOptions(True, 0.65), DecoderOptions(False, 1.0), DecoderOptions(True, 0.0)])
def test_every_decoder_option_decodes_to_the_cpu_shapes(options):
    cfg = ImageConfig.from_checkpoint(bench_image_decode.REAL_SHAPE_CHECKPOINT)
    images = [np.frombuffer(synthetic_jpeg(seed, (320, 240)), np.uint8) for seed in range(3)]
    results = []
    for gpu, decoder in ((False, DecoderOptions()), (True, options)):
        pipe = image_pipeline(cfg, batch_size=3, num_threads=2, device_id=0 if gpu else None, gpu=gpu, decoder=decoder)
        pipe.build()
        pipe.feed_input("images", images)
        pixels, sizes = pipe.run()
        results.append(([np.asarray(p) for p in (pixels.as_cpu() if gpu else pixels)], sizes.as_array()))
    (cpu_pixels, cpu_sizes), (gpu_pixels, gpu_sizes) = results
    assert np.array_equal(cpu_sizes, gpu_sizes)
    assert [p.shape for p in cpu_pixels] == [p.shape for p in gpu_pixels]
    # Normalised values (about unit scale): chroma upsampling choices stay well within a few levels on average.
    assert all(np.abs(c - g).mean() < 0.1 for c, g in zip(cpu_pixels, gpu_pixels))
