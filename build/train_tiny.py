"""Train a small Qwen3-VL-MoE from scratch on the synthetic multi-image note QA task.

    python -m zipmoe.build.train_tiny --out checkpoints/notes [--size notes32] [--minutes 10] [--batch 256]

The same model class as production (`Qwen3VLMoeForConditionalGeneration`: MoE text decoder with
32 experts, top-4, by default; vision tower with DeepStack), a byte-level BPE learned on the task's own text,
and exactly the inputs the server builds: the checkpoint's chat template with one placeholder per
image, each expanded to the image's merged visual tokens, images normalised and patchified as the
vision encoder does (`zipmoe.vision.patchify`). The loss is on the answer tokens and the closing
<|im_end|>, plus the router's load-balancing loss. Examples are drawn by seed from the train split
(`build/notes_data.py`), never repeating, by DataLoader workers.

Writes a Hugging Face checkpoint (bf16) with tokenizer, image processor config, `train_log.json`
(seed, steps, minutes, losses, validation exact match) and the SERE calibration file.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm
from transformers import AttentionInterface, Qwen3VLMoeForConditionalGeneration
from transformers.vision_utils import get_vision_position_ids

from zipmoe.build import notes_data
from zipmoe.build.sere_calibrate import calibrate
from zipmoe.build.tiny_checkpoint import build_tokenizer, model_config, save_model
from zipmoe.engine.multimodal import splice_images
from zipmoe.prompt import ChatPrompt
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
GOLDEN = 0.6180339887498949  # example k is a describe example when (k * GOLDEN) mod 1 < fraction


def is_describe(index: int, fraction: float) -> bool:
    """Low-discrepancy choice: any run of examples holds close to `fraction` describe examples."""
    return (index * GOLDEN) % 1.0 < fraction


def tokenizer_corpus(n: int = 3000) -> list[str]:
    """The task's own text: every word it can use, and rendered questions and answers."""
    texts = [" ".join(notes_data.vocabulary())]
    for k in range(n):
        seed = notes_data.split_seed("train", k)
        ex = notes_data.make_describe_example(seed) if k % 4 == 0 else notes_data.make_example(seed)
        texts.append(f"{ex.question}\n{ex.answer}")
    return texts + ["user\nassistant\n"]


class NotesDataset(Dataset):
    """Example i of a split as model inputs: ids, labels (answer only), positions, pixels, grids, task.

    describe_fraction: that share of the examples asks what one image shows (training only)."""

    def __init__(self, checkpoint: Path, split: str, length: int, start: int = 0, describe_fraction: float = 0.0):
        self.checkpoint, self.split, self.length, self.start = checkpoint, split, length, start
        self.describe_fraction = describe_fraction
        self.prompt: ChatPrompt | None = None  # built in the worker: tokenizers are not shared across processes
        cfg = json.loads((checkpoint / "config.json").read_text())
        vision = cfg["vision_config"]
        self.patch, self.merge, self.temporal = vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]
        self.image_token = cfg["image_token_id"]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if self.prompt is None:
            self.prompt = ChatPrompt(self.checkpoint)
        index = self.start + i
        seed = notes_data.split_seed(self.split, index)
        describe = is_describe(index, self.describe_fraction)
        ex = notes_data.make_describe_example(seed) if describe else notes_data.make_example(seed)
        pixels, grids, merged = [], [], []
        for image in ex.images:
            x = pixels_of(image)
            pixels.append(patchify(x, self.patch, self.merge, self.temporal))
            gh, gw = x.shape[1] // self.patch, x.shape[2] // self.patch
            grids.append([1, gh, gw])
            merged.append((gh // self.merge, gw // self.merge))
        # Expanded ids and mRoPE positions exactly as the engine splices them (every token kept).
        # Computing the positions here, in the workers, spares the model's per-example Python loop.
        cells = torch.cat([torch.cartesian_prod(torch.arange(r), torch.arange(c)) for r, c in merged])
        ids, positions, rope_delta = splice_images(self.prompt.encode(ex.question, len(ex.images)), self.image_token,
                                                   [r * c for r, c in merged], cells, merged)
        answer = self.prompt.tokenizer.encode(ex.answer + "<|im_end|>", add_special_tokens=False).ids
        answer_positions = torch.arange(len(ids), len(ids) + len(answer)).expand(3, -1) + rope_delta
        return {"ids": torch.tensor(ids + answer), "labels": torch.tensor([-100] * len(ids) + answer),
                "positions": torch.cat([positions, answer_positions], dim=1),
                "pixels": torch.cat(pixels), "grids": torch.tensor(grids), "task": TRAIN_TASKS.index(ex.task),
                "readings": torch.tensor(ex.readings)}


def collate(batch: list[dict], pad_id: int, image_token: int) -> dict:
    n = max(len(b["ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id)
    labels = torch.full((len(batch), n), -100)
    mask = torch.zeros(len(batch), n, dtype=torch.long)
    positions = torch.zeros(3, len(batch), n, dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, :len(b["ids"])] = b["ids"]
        labels[i, :len(b["labels"])] = b["labels"]
        mask[i, :len(b["ids"])] = 1
        positions[:, i, :len(b["ids"])] = b["positions"]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions,
            "mm_token_type_ids": (ids == image_token).long(),
            "pixel_values": torch.cat([b["pixels"] for b in batch]),
            "image_grid_thw": torch.cat([b["grids"] for b in batch]),
            # not model inputs: popped before the forward
            "task": torch.tensor([b["task"] for b in batch]),
            "readings": torch.cat([b["readings"] for b in batch])}


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


class ReadingHead(torch.nn.Module):
    """Training-only auxiliary head: each image's merged visual tokens -> the digits it shows.

    Through the decoder alone, the vision tower's gradient for an image is diluted across the whole
    prompt, and the six tasks never made it learn digits (read_price stayed at 0). A direct target
    per image teaches the tower to read within a few thousand examples, like the vision
    pre-training real VLMs start from; the decoder then learns to find and say what it reads.
    Not saved with the checkpoint."""

    def __init__(self, visual: torch.nn.Module, tokens_per_image: int, width: int):
        super().__init__()
        self.tokens_per_image = tokens_per_image
        self.linear = torch.nn.Linear(tokens_per_image * width, notes_data.READING_SLOTS * 10)
        self.merged: torch.Tensor | None = None
        visual.register_forward_hook(self._keep_merged_tokens)

    def _keep_merged_tokens(self, module, args, output) -> None:
        self.merged = output.pooler_output

    def loss(self, readings: torch.Tensor) -> torch.Tensor:
        """readings [images, READING_SLOTS] (NO_DIGIT where none) -> mean cross-entropy of the digits."""
        images = self.merged.view(-1, self.tokens_per_image * self.merged.shape[-1])
        logits = self.linear(images.float()).view(-1, 10)
        return torch.nn.functional.cross_entropy(logits, readings.view(-1), ignore_index=notes_data.NO_DIGIT)


def grouped_mm_trains_on(device: torch.device) -> bool:
    """Whether transformers' grouped_mm experts can train here: they call torch's grouped GEMM
    outside autocast, on the float32 master weights, and not every build has that with autograd."""
    from transformers.integrations.moe import _grouped_mm
    try:
        weight = torch.randn(2, 16, 16, device=device, requires_grad=True)
        offsets = torch.tensor([16, 32], device=device, dtype=torch.int32)
        out = _grouped_mm(torch.randn(32, 16, device=device), weight, offsets)
        out.square().sum().backward()  # a dense gradient, as training's (sum() would give a stride-0 one)
        return True
    except (RuntimeError, NotImplementedError) as e:
        print(f"grouped_mm experts cannot train on {device} ({e}): using the per-expert loop")
        return False


def answer_exact_match(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example: every answer token predicted (teacher forcing) -> bool [B]."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    return ((pred == target) | (target == -100)).all(dim=1)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth of the peak as `progress`
    (the fraction of the run done, 0..1) goes to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def validate(model, loader, device) -> dict:
    """Validation loss and teacher-forced exact match, overall and per task."""
    model.eval()
    losses, hits, counts = [], torch.zeros(len(TRAIN_TASKS)), torch.zeros(len(TRAIN_TASKS))
    for batch in loader:
        task = batch.pop("task")
        del batch["readings"]
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(**batch)
        losses.append(float(out.loss))
        hit = answer_exact_match(out.logits, batch["labels"]).float().cpu()
        hits.index_add_(0, task, hit)
        counts.index_add_(0, task, torch.ones_like(hit))
    model.train()
    return {"loss": round(sum(losses) / len(losses), 4),
            "exact_match": round(float(hits.sum() / counts.sum()), 4),
            "by_task": {t: round(float(h / c), 4) for t, h, c in zip(TRAIN_TASKS, hits, counts) if c > 0}}


def train(out: str | Path, size: str = "notes32", steps: int = 1_000_000, batch: int = 256, minutes: float = 10.0,
          lr: float = 1e-3, seed: int = 0, device: str | None = None, workers: int | None = None,
          val_examples: int = 512, calibrate_sere: bool = True, val_every_minutes: float = 2.0,
          describe_fraction: float = 0.3, experts: str = "grouped_mm", reading_loss: float = 0.5,
          label_images: bool = False) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    # Digits one token each (as Qwen's tokenizer): a number's later digits are decode steps, where
    # the routing policies act.
    # label_images names the images in the prompt ("image 2: "), as Qwen's add_vision_id does. Off by
    # default: the plain template already learned "image i" (colour 0.82, find 0.88 on the H200), and
    # a CPU trial with labels was no better at equal steps.
    tok = build_tokenizer(out, tokenizer_corpus(), TOKENIZER_VOCAB, split_digits=True, label_images=label_images)
    text, vision = SIZES[size]
    config = model_config(tok, text=text, vision=vision)
    config.save_pretrained(out)  # the dataset reads config.json (the tokenizer files are already there)
    model = Qwen3VLMoeForConditionalGeneration(config).to(dev)
    vision_attention = config.vision_config._attn_implementation
    config.vision_config._attn_implementation = UNIFORM_IMAGE_ATTENTION
    one_grid_vision_inputs(model.model.visual)
    # transformers' grouped_mm experts: one grouped GEMM per projection instead of a loop over the
    # experts with a host sync each (half the launches of a step; the same loss). "eager" is the loop.
    experts_implementation = config.text_config._experts_implementation
    if experts == "grouped_mm" and not grouped_mm_trains_on(dev):
        experts = "eager"
    config.text_config._experts_implementation = experts
    params = sum(p.numel() for p in model.parameters())
    side = notes_data.IMAGE_SIZE[0] // (config.vision_config.patch_size * config.vision_config.spatial_merge_size)
    reading = ReadingHead(model.model.visual, side * side, config.vision_config.out_hidden_size).to(dev)
    print(f"{out}: {params / 1e6:.1f} M parameters, training on {dev}")

    pad, image_token = config.text_config.pad_token_id, config.image_token_id
    # ~5 ms of CPU per example: at ~10 steps/s of 128 the loader needs most of the machine's cores.
    workers = workers if workers is not None else (max(1, (os.cpu_count() or 2) - 2) if dev.type == "cuda" else 0)
    loader_args = dict(batch_size=batch, num_workers=workers, collate_fn=functools.partial(collate, pad_id=pad, image_token=image_token),
                       persistent_workers=workers > 0)
    train_loader = DataLoader(NotesDataset(out, "train", steps * batch, describe_fraction=describe_fraction), shuffle=False, **loader_args)
    val_loader = DataLoader(NotesDataset(out, "validation", val_examples), **loader_args)
    trained = [*model.parameters(), *reading.parameters()]
    opt = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=dev.type == "cuda")

    log: dict = {"seed": seed, "size": size, "parameters": params, "batch": batch, "lr": lr, "experts": experts,
                 "describe_fraction": describe_fraction, "reading_loss": reading_loss, "label_images": label_images,
                 "losses": [], "validation": [], "skipped_steps": 0}
    start = time.monotonic()
    budget = minutes * 60
    next_validation = val_every_minutes * 60
    model.train()
    bar = tqdm(train_loader, total=steps, desc="train", mininterval=5)
    step = 0
    for step, data in enumerate(bar):
        elapsed = time.monotonic() - start
        # The schedule decays over whichever runs out first, the steps or the time budget: a run
        # cut by the clock still ends at the low learning rate.
        progress = max(step / steps, elapsed / budget)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, lr, warmup=min(200, steps // 10 + 1))
        del data["task"]
        data = {k: v.to(dev, non_blocking=True) for k, v in data.items()}
        readings = data.pop("readings")
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(**data, output_router_logits=True).loss
            aux = reading.loss(readings)
        loss = loss + reading_loss * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        # A non-finite step (a bf16 overflow) would poison Adam's moments for good: drop it instead.
        # One sync per step, a small price at this model size.
        if torch.isfinite(grad_norm):
            opt.step()
        else:
            log["skipped_steps"] += 1
        if step % 50 == 0:
            log["losses"].append([step, round(loss.item(), 4), round(aux.item(), 4)])  # total, reading head
            bar.set_postfix(loss=f"{loss.item():.3f}", reading=f"{aux.item():.3f}")
        if elapsed > next_validation:  # a learning curve for the notes, per task
            next_validation += val_every_minutes * 60
            log["validation"].append({"minute": round(elapsed / 60, 2), "step": step, **validate(model, val_loader, dev)})
            print(f"minute {elapsed / 60:.1f}, step {step}: validation {log['validation'][-1]}")
        if time.monotonic() - start > budget:
            print(f"time budget of {minutes} min reached at step {step}")
            break
    log["steps"] = step + 1
    log["minutes"] = round((time.monotonic() - start) / 60, 2)
    log["final_loss"] = round(loss.item(), 4)
    final = validate(model, val_loader, dev)
    log["val_loss"], log["val_exact_match"], log["val_by_task"] = final["loss"], final["exact_match"], final["by_task"]
    print(f"{out}: {log['steps']} steps in {log['minutes']} min ({log['skipped_steps']} non-finite skipped), final "
          f"loss {log['final_loss']}, validation loss {log['val_loss']:.4f}, teacher-forced exact match "
          f"{log['val_exact_match']:.3f} {log['val_by_task']}")
    # Training-time choices, not settings of the saved checkpoint.
    config.vision_config._attn_implementation = vision_attention
    config.text_config._experts_implementation = experts_implementation
    save_model(model.cpu(), out)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if calibrate_sere:
        prompts = out / "calibration_prompts.jsonl"
        prompts.write_text("".join(json.dumps({"text": ex.question}) + "\n"
                                   for ex in notes_data.examples("validation", 64)))
        calibrate(out, prompts_file=prompts, device=str(dev))
    print(f"{out}: done")
    return log


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
