"""Train a small Qwen3-VL-MoE from scratch on the synthetic multi-image note QA task.

    python -m zipmoe.build.train_tiny --out checkpoints/notes [--size notes32] [--minutes 10] [--batch 256]

The same model class as production (`Qwen3VLMoeForConditionalGeneration`: MoE text decoder with
32 experts, top-4, by default; vision tower with DeepStack), a byte-level BPE learned on the task's own text,
and exactly the inputs the server builds: the checkpoint's chat template with one placeholder per
image, each expanded to the image's merged visual tokens, images normalised and patchified as the
vision encoder does (`zipmoe.vision.patchify`). The loss is on the answer tokens and the closing
<|im_end|>, plus the router's load-balancing loss. Examples are drawn by seed from the train split
(`build/notes_data.py`), never repeating, by DataLoader workers.

The recipe shared with `build/train_v2.py` (set-up, loaders, the clock-bound step loop, saving and
calibration) is `build/training.py`; this module holds what is the notes task's own: the model
sizes, the dataset, the vision shortcuts for images of one size, the per-image digit-reading head
and the per-task validation.

Writes a Hugging Face checkpoint (bf16) with tokenizer, image processor config, `train_log.json`
(seed, steps, minutes, losses, validation exact match) and the SERE calibration file.
"""
from __future__ import annotations

import argparse
import functools
import inspect
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.vision_utils import get_vision_position_ids

from zipmoe.build import notes_data
from zipmoe.build.training import (MergedTokensHead, SplitDataset, answer_exact_match, eval_batches, finish, fit,
                                   grouped_mm_trains_on, is_training_only, loaders, set_up)
from zipmoe.build.training import collate  # noqa: F401  (re-exported: callers collate batches through this module)
from zipmoe.vision import patchify, pixels_of

TOKENIZER_VOCAB = 512
# ~10 M parameters (about 20 MB in bf16): text 256 wide, 4 MoE layers of 16 experts (top-4);
# vision tower 6 layers of 128 with DeepStack from layers 2 and 4.
_NOTES_TEXT = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512,
                   router_aux_loss_coef=0.01,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 8, 8],
                                    "mrope_interleaved": True})
_NOTES_VISION = dict(depth=6, hidden_size=128, num_heads=4, intermediate_size=256, out_hidden_size=256,
                     deepstack_visual_indexes=[2, 4])
SIZES = {
    "notes": (_NOTES_TEXT, _NOTES_VISION),
    # Twice the experts at three quarters the width (~13 M parameters, 25 MB in bf16): a batch of
    # 16 decode tokens no longer touches nearly every expert, so batch-aware routing has work to
    # do, as with the production model's 128 experts.
    "notes32": ({**_NOTES_TEXT, "num_experts": 32, "moe_intermediate_size": 96}, _NOTES_VISION),
    "smoke": ({}, {}),  # the tiny checkpoint's shape: for tests on a CPU
}


TRAIN_TASKS = (*notes_data.TASKS, "describe")
def tokenizer_corpus(n: int = 3000) -> list[str]:
    """The task's own text: every word it can use, and rendered questions and answers."""
    texts = [" ".join(notes_data.vocabulary())]
    for k in range(n):
        seed = notes_data.split_seed("train", k)
        ex = notes_data.make_describe_example(seed) if k % 4 == 0 else notes_data.make_example(seed)
        texts.append(f"{ex.question}\n{ex.answer}")
    return texts + ["user\nassistant\n"]


class NotesDataset(SplitDataset):
    """Example i of a split as model inputs: ids, labels (answer only), positions, pixels, grids, task.

    describe_fraction: that share of the examples asks what one image shows (training only)."""

    def __init__(self, checkpoint: Path, split: str, length: int, start: int = 0, describe_fraction: float = 0.0):
        super().__init__(checkpoint, split, length, start)
        self.describe_fraction = describe_fraction

    def __getitem__(self, i: int) -> dict:
        index = self.start + i
        seed = notes_data.split_seed(self.split, index)
        describe = is_training_only(index, self.describe_fraction)
        ex = notes_data.make_describe_example(seed) if describe else notes_data.make_example(seed)
        pixels, grids, merged = [], [], []
        for image in ex.images:
            x = pixels_of(image)
            pixels.append(patchify(x, self.patch, self.merge, self.temporal))
            gh, gw = x.shape[1] // self.patch, x.shape[2] // self.patch
            grids.append([1, gh, gw])
            merged.append((gh // self.merge, gw // self.merge))
        return {**self.text_inputs(ex.question, ex.answer, merged),
                "pixels": torch.cat(pixels), "grids": torch.tensor(grids), "task": TRAIN_TASKS.index(ex.task),
                "readings": torch.tensor(ex.readings)}


# The vision tower loops over images for any attention that is not "flash" (thousands of small
# launches per step at batch 128: most of a step's time). Every training image has one size, so one
# batched SDPA over [images, heads, tokens, dim] does the same work; the name takes the varlen path.
UNIFORM_IMAGE_ATTENTION = "flash_uniform_images_sdpa"


def uniform_image_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            cu_seq_lens_q=None, **kwargs):
    """query/key/value [1, heads, N, dim] packing images of equal length -> ([1, N, heads, dim], None)."""
    heads, n_tokens, dim = query.shape[1:]
    lengths = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
    images = lengths.numel()
    length = n_tokens // images
    if length * images != n_tokens or not bool((lengths == length).all()):
        raise ValueError(f"uniform_image_attention needs images of one size, got token counts {lengths.tolist()}")
    q, k, v = (t[0].view(heads, images, length, dim).transpose(0, 1) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).reshape(1, n_tokens, heads, dim), None


AttentionInterface.register(UNIFORM_IMAGE_ATTENTION, uniform_image_attention)


def one_grid_vision_inputs(visual) -> None:
    """Hand the vision tower its rotary position ids built once, not per image (the tower's own helper
    loops over images: ~10 small ops each). Training images all have one grid."""
    cache: dict = {}

    def hook(module, args, kwargs):
        grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        grid = grid_thw[0]
        if not bool((grid_thw == grid).all()):
            raise ValueError(f"one_grid_vision_inputs needs images of one grid, got {grid_thw.tolist()}")
        key = (tuple(grid.tolist()), len(grid_thw))
        if key not in cache:
            one = get_vision_position_ids(grid_thw[:1], module.spatial_merge_size)
            cache[key] = one.repeat(len(grid_thw), 1)
        kwargs["position_ids"] = cache[key]
        return args, kwargs

    visual.register_forward_pre_hook(hook, with_kwargs=True)


class ReadingHead(MergedTokensHead):
    """Training-only auxiliary head: each image's merged visual tokens -> the digits it shows.

    Through the decoder alone, the vision tower's gradient for an image is diluted across the whole
    prompt, and the six tasks never made it learn digits (read_price stayed at 0). A direct target
    per image teaches the tower to read within a few thousand examples, like the vision
    pre-training real VLMs start from; the decoder then learns to find and say what it reads.
    Not saved with the checkpoint."""

    def __init__(self, visual: torch.nn.Module, tokens_per_image: int, width: int):
        super().__init__(visual)
        self.tokens_per_image = tokens_per_image
        self.linear = torch.nn.Linear(tokens_per_image * width, notes_data.READING_SLOTS * 10)

    def loss(self, readings: torch.Tensor) -> torch.Tensor:
        """readings [images, READING_SLOTS] (NO_DIGIT where none) -> mean cross-entropy of the digits."""
        images = self.merged.view(-1, self.tokens_per_image * self.merged.shape[-1])
        logits = self.linear(images.float()).view(-1, 10)
        return torch.nn.functional.cross_entropy(logits, readings.view(-1), ignore_index=notes_data.NO_DIGIT)


def validate(model, loader, device) -> dict:
    """Validation loss and teacher-forced exact match, overall and per task."""
    losses, hits, counts = [], torch.zeros(len(TRAIN_TASKS)), torch.zeros(len(TRAIN_TASKS))
    for task, batch, out in eval_batches(model, loader, device):
        losses.append(float(out.loss))
        hit = answer_exact_match(out.logits, batch["labels"]).float().cpu()
        hits.index_add_(0, task, hit)
        counts.index_add_(0, task, torch.ones_like(hit))
    return {"loss": round(sum(losses) / len(losses), 4),
            "exact_match": round(float(hits.sum() / counts.sum()), 4),
            "by_task": {t: round(float(h / c), 4) for t, h, c in zip(TRAIN_TASKS, hits, counts) if c > 0}}


def train(out: str | Path, size: str = "notes32", steps: int = 1_000_000, batch: int = 256, minutes: float = 10.0,
          lr: float = 1e-3, seed: int = 0, device: str | None = None, workers: int | None = None,
          val_examples: int = 512, calibrate_sere: bool = True, val_every_minutes: float = 2.0,
          describe_fraction: float = 0.3, experts: str = "grouped_mm", reading_loss: float = 0.5,
          label_images: bool = False) -> dict:
    # label_images names the images in the prompt ("image 2: "), as Qwen's add_vision_id does. Off by
    # default: the plain template already learned "image i" (colour 0.82, find 0.88 on the H200), and
    # a CPU trial with labels was no better at equal steps.
    run = set_up(out, SIZES[size], tokenizer_corpus(), TOKENIZER_VOCAB, seed=seed, device=device,
                 label_images=label_images, vision_attention=UNIFORM_IMAGE_ATTENTION,
                 vision_inputs=one_grid_vision_inputs, experts=experts, experts_train=grouped_mm_trains_on)
    vision = run.config.vision_config
    side = notes_data.IMAGE_SIZE[0] // (vision.patch_size * vision.spatial_merge_size)
    reading = ReadingHead(run.model.model.visual, side * side, vision.out_hidden_size).to(run.device)
    print(f"{run.out}: {run.params / 1e6:.1f} M parameters, training on {run.device}")

    train_loader, val_loader = loaders(run, NotesDataset(run.out, "train", steps * batch,
                                                         describe_fraction=describe_fraction),
                                       NotesDataset(run.out, "validation", val_examples), batch, workers)
    log: dict = {"seed": seed, "size": size, "parameters": run.params, "batch": batch, "lr": lr, "experts": run.experts,
                 "describe_fraction": describe_fraction, "reading_loss": reading_loss, "label_images": label_images}
    fit(run, reading, train_loader, log, steps=steps, lr=lr, minutes=minutes, reading_loss=reading_loss,
        val_every_minutes=val_every_minutes, validate=functools.partial(validate, run.model, val_loader, run.device))
    final = validate(run.model, val_loader, run.device)
    log["val_loss"], log["val_exact_match"], log["val_by_task"] = final["loss"], final["exact_match"], final["by_task"]
    print(f"{run.out}: {log['steps']} steps in {log['minutes']} min ({log['skipped_steps']} non-finite skipped), final "
          f"loss {log['final_loss']}, validation loss {log['val_loss']:.4f}, teacher-forced exact match "
          f"{log['val_exact_match']:.3f} {log['val_by_task']}")
    questions = [ex.question for ex in notes_data.examples("validation", 64)] if calibrate_sere else None
    return finish(run, log, questions)


def main(argv: list[str] | None = None) -> int:
    default = {name: param.default for name, param in inspect.signature(train).parameters.items()}  # one source
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=sorted(SIZES), default=default["size"])
    p.add_argument("--steps", type=int, default=default["steps"],
                   help="at most this many steps (the clock stops a run first)")
    p.add_argument("--batch", type=int, default=default["batch"])
    p.add_argument("--minutes", type=float, default=default["minutes"], help="stop when this much time has passed")
    p.add_argument("--lr", type=float, default=default["lr"])
    p.add_argument("--val-every", dest="val_every_minutes", type=float, default=default["val_every_minutes"],
                   help="minutes between validation runs")
    p.add_argument("--experts", choices=("grouped_mm", "eager"), default=default["experts"],
                   help="transformers' experts implementation while training")
    p.add_argument("--reading-loss", type=float, default=default["reading_loss"],
                   help="weight of the auxiliary digit-reading head on the vision tower (0: off)")
    p.add_argument("--image-labels", dest="label_images", action="store_true",
                   help="name each image in the chat template ('image N: ')")
    p.add_argument("--describe", dest="describe_fraction", type=float, default=default["describe_fraction"],
                   help="share of training examples that ask what an image shows")
    p.add_argument("--seed", type=int, default=default["seed"])
    p.add_argument("--device", default=default["device"])
    p.add_argument("--workers", type=int, default=default["workers"])
    train(**vars(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
