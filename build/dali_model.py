"""Serialise the image pipeline for the native DALI backend: `model.dali` for configs/dali.pbtxt.

    python -m zipmoe.build.dali_model --out model_repository/image_decode/1/model.dali
    python -m zipmoe.build.dali_model --out DIR --checkpoint /models/Qwen3-VL-30B-A3B-Instruct

The graph is `zipmoe.image_pipeline`'s, the one the Python model runs, with the checkpoint's
factor, min/max pixels and mean/std baked in: rebuild it for another checkpoint. Serialise with
the DALI version of the serving image (an older DALI may not read a newer serialisation).
A GPU pipeline serialises without a GPU here; the backend binds it to its instance's device.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from zipmoe.image_pipeline import ImageConfig, image_pipeline

REPO = Path(__file__).resolve().parents[1]


def build_dali_model(out: str | Path, checkpoint: str | Path, *, max_images: int = 64, num_threads: int = 4,
                     gpu: bool = True) -> Path:
    """Write the serialised pipeline to `out` (a file, or a directory that gets `model.dali`)."""
    out = Path(out)
    if out.is_dir() or not out.suffix:
        out = out / "model.dali"
    out.parent.mkdir(parents=True, exist_ok=True)
    pipe = image_pipeline(ImageConfig.from_checkpoint(checkpoint), batch_size=max_images, num_threads=num_threads,
                          device_id=None, gpu=gpu, padded_rows=True)
    pipe.serialize(filename=str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="model.dali path, or the model version directory")
    parser.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "tiny"),
                        help="directory holding preprocessor_config.json")
    parser.add_argument("--max-images", type=int, default=64, help="DALI batch size = max_batch_size of the config")
    parser.add_argument("--cpu", action="store_true", help="CPU operators (for KIND_CPU instances) instead of mixed")
    args = parser.parse_args()
    path = build_dali_model(args.out, args.checkpoint, max_images=args.max_images, gpu=not args.cpu)
    print(f"{path}: written")


if __name__ == "__main__":
    main()
