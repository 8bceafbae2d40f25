"""Train the larger Qwen3-VL-MoE of issue 18 from scratch on task set v2 (`build/taskset_v2.py`).

    python -m zipmoe.build.train_v2 --out checkpoints/v2                 # H200: <= 20 min end to end
    python -m zipmoe.build.train_v2 --out /tmp/v2-smoke --smoke          # CPU, tiny shapes, well under 2 min

The recipe `build/train_tiny.py` uses, shared in `build/training.py` (the production model class, a
byte-level BPE learned on the task's own text with digits one token each, inputs built exactly as
the server builds them, loss on the answer and <|im_end|> plus the router's balancing loss,
examples drawn by seed from the train split by DataLoader workers, a clock-bound run whose
learning rate follows elapsed time), with what task set v2 needs (`build/train_v2_vision.py`):
images of many sizes, uint8 pixels from the workers, normalised on the device, and a per-token
reading head in place of the per-image digit head; validation adds token F1. A share of the
training examples (`--read`, 0.3) are training-only read-entry questions ("read entry 3 of image
2."), in the place train_tiny's describe questions have: the first run without them learned to
read in the tower (its reading head) but not through the decoder. Neither that nor a tower
whose tokens shared less of one mean vector (session 16) made the decoder use its images, so one
head of the decoder's second-to-last layer is told where each answer token is printed
(`build/train_v2_attention.py`, `--attend-loss`, 0.3): validation reports how often it looks there
(`looks_right`). With both, the centering penalty (`--centering`, 1) and the attention targets, the
decoder reads: in session 17's 10-minute run the validation loss was 1.14 against 1.84 with blank
images (sessions 15 and 16: about 0.01 apart), and the head looked at the right token 71 % of the
time (docs/results/train_v2_attention_log.json).
`--expert-width`, `--balance-loss` and `--router-z-loss` change the routing recipe (issue 18 wants
experts that a top-2 truncation misses; session 24's run with all three: docs/QUALITY.md), and
`--knowledge` asks more of the knowledge questions (recalled price lists) in training; which recipe
makes a top-2 truncation cost recall, on a CPU in minutes: `build/knowledge_pilot.py`.

Size `v2` (25.8 M parameters, 51.6 MB in bf16 <= 60 MB):
  text: 256 wide, 6 MoE layers of 64 experts 64 wide, top-8 (Qwen3-30B-A3B's 128 / top-8 ratio
  halved: a decode batch of 16 reaches up to ~56 of 64 experts under uniform routing, so re-routing
  has room, and a top-2 truncation drops three quarters of each token's expert compute);
  vocabulary 832 (822 used);
  vision: 8 layers of 192 (3 heads of 64), DeepStack from layers 2 and 5, a 32 x 32 position table.

Measured on the H200: the first run (docs/results/train_v2_log.json) trained at 46.5 examples/s at
batch 32, a step taking 0.48 s (torch profiler, one step after warm-up) with ~12.5 k kernel
launches, most of them the vision attention's per-length groups and torch's per-expert fallback for
float32 grouped GEMMs. With one varlen flash call per vision layer (`train_v2_vision`) and the
expert GEMMs in bf16 (`training.grouped_mm_in_bf16`) the same step takes 0.24 s, 229 ms of host
and 233 ms of GPU time: about twice the examples in the same minutes. The estimate this recipe was
sized by, for comparison:
Task set v2 averages 3.09 images of 444 merged tokens an example: ~1,420 decoder tokens and ~5,490
vision patches, in images of ~1,890 patches (patch-weighted mean, which sets the attention cost).
Training FLOPs (3 x forward): vision ~54 MFLOP/patch (forward: 6.5 linear + 11.6 attention)
-> ~297 GFLOP; decoder ~49 MFLOP/token (forward: 7.7 active parameters + 8.7 attention)
-> ~70 GFLOP; ~367 GFLOP an example, 23.5 TFLOP a step of 64. At 150-250 TFLOP/s sustained
(15-25 % of the bf16 peak at these narrow widths) plus a guessed ~0.2 s of per-step overhead, a
step takes ~0.3-0.45 s: ~140-210 examples/s, i.e. ~200-300 k decoder tokens/s and ~0.8-1.15 M
vision patches/s. The workers need ~21 ms of CPU an example (measured on this repository's CPU
box: rendering 16 ms, then patchify and splice), so 14 workers supply ~650 examples/s and the GPU
sets the pace. Defaults: batch 32 (the first run's: twice the updates of 64 in the same minutes,
at the same examples/s), 17 minutes of training, at most 4,300 steps (17 minutes of 0.24 s steps,
~137 k examples); whichever limit comes first ends the run and its learning-rate decay. Tokenizer,
validation (256 examples every 4 minutes), saving and SERE calibration take about two more
minutes (the first run's: 12 minutes of training, 14 in all), within the issue's 20.

Writes a Hugging Face checkpoint (bf16) like checkpoints/notes: tokenizer, config, generation and
image processor configs (longest_edge 1024 x 1024 pixels, so 896 x 896 images are not resized),
`train_log.json` (settings, losses, throughput, validation teacher-forced exact match and token F1
per task) and `sere.safetensors` (SERE calibration).
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import re
from pathlib import Path

import torch

from zipmoe.build import taskset_v2 as ts
from zipmoe.build.tiny_checkpoint import PREPROCESSOR_CONFIG
from zipmoe.build.training import (SplitDataset, answer_exact_match, autocast, eval_batches, finish, fit,
                                   is_training_only, loaders, move_batch, set_up)
from zipmoe.build.training import collate  # noqa: F401  (re-exported: callers collate batches through this module)
from zipmoe.build.routing_truncation import answer_rows, truncated_routing
from zipmoe.build.train_v2_attention import ATTENTION, AnswerAttention, attention_targets, char_marks
from zipmoe.build.train_v2_vision import (PACKED_IMAGE_ATTENTION, TokenReadingHead, device_pixels,
                                          grid_cached_vision_inputs, token_readings, uint8_patches)
from zipmoe.clients.quality_metrics import exact_match, token_f1

TOKENIZER_VOCAB = 1024  # the BPE stops at 822 on this corpus: every word of the task whole
MAX_PIXELS = 1024 * 1024  # the image processor's longest_edge: task set v2's 896 x 896 stays as drawn
_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_interleaved": True}
SIZES = {
    "v2": (dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                num_experts=64, num_experts_per_tok=8, moe_intermediate_size=64, intermediate_size=512,
                router_aux_loss_coef=0.01, rope_parameters={**_ROPE, "mrope_section": [16, 8, 8]}),
           dict(depth=8, hidden_size=192, num_heads=3, intermediate_size=384, out_hidden_size=256,
                deepstack_visual_indexes=[2, 5], num_position_embeddings=1024)),
    # The tiny checkpoint's widths with v2's structure (more experts than top-k x 4, top-4, the same
    # position table): for tests on a CPU.
    "smoke": (dict(num_experts=32, num_experts_per_tok=4, router_aux_loss_coef=0.01),
              dict(num_position_embeddings=1024)),
}
SMOKE = dict(size="smoke", steps=2, batch=2, minutes=2.0, device="cpu", workers=0, val_examples=2,
             calibration_prompts=4)


TRAIN_TASKS = (*ts.TASKS, ts.READ_TASK)


class TaskSetV2Dataset(SplitDataset):
    """Example i of a split as model inputs, the keys `training.collate` takes: ids, labels
    (answer and <|im_end|> only), mRoPE positions, uint8 pixels, grids, task (index in TRAIN_TASKS),
    per-token readings. read_fraction: that share of the examples are training-only read-entry
    questions (`taskset_v2.read_plan`), chosen by `training.is_training_only`; knowledge_fraction:
    that share more are knowledge questions, on top of those the split's own mix draws."""

    def __init__(self, checkpoint: Path, split: str, length: int, start: int = 0, read_fraction: float = 0.0,
                 knowledge_fraction: float = 0.0):
        super().__init__(checkpoint, split, length, start)
        self.read_fraction, self.knowledge_fraction = read_fraction, knowledge_fraction

    def __getitem__(self, i: int) -> dict:
        index = self.start + i
        read = is_training_only(index, self.read_fraction)
        knowledge = not read and is_training_only(index, self.read_fraction + self.knowledge_fraction)
        ex = ts.make_example(ts.split_seed(self.split, index), read=read, knowledge=knowledge)
        pixels, grids, merged, readings = [], [], [], []
        for image, marks in zip(ex.images, ex.marks):
            pixels.append(uint8_patches(image, self.patch, self.merge))
            gh, gw = image.height // self.patch, image.width // self.patch
            grids.append([1, gh, gw])
            merged.append((gh // self.merge, gw // self.merge))
            readings.append(token_readings(marks, image.size, self.patch * self.merge))
        inputs = self.text_inputs(ex.question, ex.answer, merged)
        return {**inputs, "pixels": torch.cat(pixels), "grids": torch.tensor(grids), "task": TRAIN_TASKS.index(ex.task),
                "readings": torch.cat(readings), "attend": self.answer_targets(ex, inputs, merged)}

    def answer_targets(self, ex: ts.Example, inputs: dict, merged: list[tuple[int, int]]) -> torch.Tensor:
        """`train_v2_attention.attention_targets` of the example (`text_inputs`' ids and answer
        offsets): [targets, 2] (query, key position)."""
        ids, offsets = inputs["ids"], inputs["answer_offsets"]
        image_positions = (ids == self.image_token).nonzero().squeeze(1).tolist()
        starts, seen = [], 0
        for rows, cols in merged:
            starts.append(image_positions[seen])
            seen += rows * cols
        chars = char_marks(ex.answer, list(ex.marks), ex.question)
        if ex.task in ts.KNOWLEDGE_TASKS:  # a recalled price comes from nothing printed: no target
            for price in re.finditer(r"\S*\d\S*", ex.answer):
                chars[price.start():price.end()] = [None] * (price.end() - price.start())
        return attention_targets(ex.answer, offsets, len(ids) - len(offsets), starts,
                                 [cols for _, cols in merged], chars, self.patch * self.merge)


def to_device(data: dict, dev: torch.device, temporal: int) -> dict:
    """A collated batch on the device, pixels normalised there (see device_pixels)."""
    data = move_batch(data, dev)
    data["pixel_values"] = device_pixels(data["pixel_values"], temporal)
    return data


def answer_texts(logits: torch.Tensor, labels: torch.Tensor, tokenizer) -> tuple[list[str], list[str]]:
    """Teacher-forced predicted and reference answers, decoded (special tokens dropped)."""
    pred, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    out = ([], [])
    for p, t in zip(pred, target):
        keep = t != -100
        out[0].append(tokenizer.decode(p[keep].tolist(), skip_special_tokens=True))
        out[1].append(tokenizer.decode(t[keep].tolist(), skip_special_tokens=True))
    return out


def validate(model, loader, device, tokenizer, temporal: int, reading: TokenReadingHead | None = None,
             looking: AnswerAttention | None = None) -> dict:
    """Validation loss; teacher-forced exact match (every answer token) and token F1 of the
    decoded answers (clients/quality_metrics), overall and per task; and blind_loss, the loss of
    the same batches with every image blank (mid-grey): a decoder that reads the images has a
    lower loss with them. (Session 15's 6-minute run did not: 1.330 with its images, 1.328 blank.)
    reading: also report its `visual_stats` of the images' forwards (mean over batches), "visual".
    looking: also report "looks_right", the share of answer tokens with an attention target at
    which its head attends most to that target (`AnswerAttention.hits`). top2_loss: the loss with
    the answer tokens' routing cut to two experts (`routing_truncation`): issue 18 wants a model
    that needs its top-K, which this shows during training."""
    losses, blind, top2, rows, visual, looked = [], [], [], [], [], [0, 0]  # looked: (right, targets)
    on_device = functools.partial(to_device, dev=device, temporal=temporal)
    for task, batch, out in eval_batches(model, loader, device, on_device):
        losses.append(float(out.loss))
        if reading is not None:
            visual.append(reading.visual_stats())
        attend = batch.pop("attend", None)
        if looking is not None and attend is not None:
            looked = [a + b for a, b in zip(looked, looking.hits(attend))]
        with torch.no_grad(), autocast(device):
            blind.append(float(model(**{**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}).loss))
            with truncated_routing(model, 2, answer_rows(batch["labels"])):
                top2.append(float(model(**batch).loss))
        hits = answer_exact_match(out.logits, batch["labels"]).tolist()
        for t, hit, (p, ref) in zip(task.tolist(), hits, zip(*answer_texts(out.logits, batch["labels"], tokenizer))):
            rows.append((ts.TASKS[t], float(hit), token_f1(p, ref), exact_match(p, ref)))
    by_task = {}
    for name in ts.TASKS:
        mine = [r for r in rows if r[0] == name]
        if mine:
            by_task[name] = {"exact": round(sum(r[1] for r in mine) / len(mine), 4),
                             "f1": round(sum(r[2] for r in mine) / len(mine), 4)}
    return {"loss": round(sum(losses) / len(losses), 4), "blind_loss": round(sum(blind) / len(blind), 4),
            "top2_loss": round(sum(top2) / len(top2), 4),
            "exact_match": round(sum(r[1] for r in rows) / len(rows), 4),
            "f1": round(sum(r[2] for r in rows) / len(rows), 4),
            "squad_exact": round(sum(r[3] for r in rows) / len(rows), 4), "by_task": by_task,
            **({"visual": {k: [round(sum(v) / len(v), 4) for v in zip(*(b[k] for b in visual))] for k in visual[0]}}
               if visual else {}),
            **({"looks_right": round(looked[0] / looked[1], 4)} if looked[1] else {})}


def write_preprocessor_config(out: Path) -> None:
    """save_model writes the tiny checkpoint's image processor (at most 512 x 512 pixels); v2's
    images go up to 896 x 896 and must reach the tower as drawn."""
    cfg = {**PREPROCESSOR_CONFIG, "size": {**PREPROCESSOR_CONFIG["size"], "longest_edge": MAX_PIXELS}}
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def train(out: str | Path, size: str = "v2", steps: int = 4300, batch: int = 32, minutes: float = 17.0,
          lr: float = 1e-3, seed: int = 0, device: str | None = None, workers: int | None = None,
          val_examples: int = 256, calibrate_sere: bool = True, val_every_minutes: float = 4.0,
          experts: str = "grouped_mm", reading_loss: float = 0.5, calibration_prompts: int = 64,
          read_fraction: float = 0.3, knowledge_fraction: float = 0.0, attend_loss: float = 0.3,
          centering: float = 1.0,
          expert_width: int | None = None, balance_loss: float | None = None, router_z_loss: float = 0.0) -> dict:
    text_shape, vision_shape = dict(SIZES[size][0]), SIZES[size][1]
    # Routing knobs (issue 18 wants experts that a top-2 truncation misses): None keeps the size's own.
    if expert_width:
        text_shape["moe_intermediate_size"] = expert_width
    if balance_loss is not None:
        text_shape["router_aux_loss_coef"] = balance_loss
    run = set_up(out, (text_shape, vision_shape), ts.tokenizer_corpus(), TOKENIZER_VOCAB, seed=seed, device=device,
                 vision_attention=PACKED_IMAGE_ATTENTION, vision_inputs=grid_cached_vision_inputs, experts=experts)
    dev, temporal = run.device, run.config.vision_config.temporal_patch_size
    reading = TokenReadingHead(run.model.model.visual, run.config.vision_config.out_hidden_size, centering).to(dev)
    print(f"{run.out}: {run.params / 1e6:.1f} M parameters ({2 * run.params / 1e6:.1f} MB in bf16), training on {dev}")
    # One head of the second-to-last decoder layer learns where each answer token is printed
    # (train_v2_attention): the decoder's own loss never said where to look.
    text = run.config.text_config
    saved_attention, looking = text._attn_implementation, None
    if attend_loss > 0:
        text._attn_implementation = ATTENTION
        looking = AnswerAttention(run.model, max(0, text.num_hidden_layers - 2))

    # ~21 ms of CPU per example (rendering three large images): the loader needs the machine's cores.
    train_set = TaskSetV2Dataset(run.out, "train", steps * batch, read_fraction=read_fraction,
                                 knowledge_fraction=knowledge_fraction)
    train_loader, val_loader = loaders(run, train_set, TaskSetV2Dataset(run.out, "validation", val_examples), batch, workers,
                                       pin_memory=dev.type == "cuda")
    log: dict = {"seed": seed, "size": size, "parameters": run.params, "batch": batch, "lr": lr, "experts": run.experts,
                 "reading_loss": reading_loss, "read_fraction": read_fraction,
                 "knowledge_fraction": knowledge_fraction, "split_knowledge_share": ts.KNOWLEDGE_SHARE,
                 "attend_loss": attend_loss,
                 "centering": centering, "task_set": "v2", "router_z_loss": router_z_loss,
                 "moe_intermediate_size": text_shape.get("moe_intermediate_size"),
                 "router_aux_loss_coef": text_shape.get("router_aux_loss_coef")}
    counted = {"examples": 0, "tokens": 0, "patches": 0}

    def count_and_move(data: dict) -> dict:
        counted["examples"] += data["input_ids"].shape[0]
        counted["tokens"] += int(data["attention_mask"].sum())
        counted["patches"] += data["pixel_values"].shape[0]
        return to_device(data, dev, temporal)

    validation = functools.partial(validate, run.model, val_loader, dev, run.tokenizer, temporal, reading, looking)
    seconds = fit(run, reading, train_loader, log, steps=steps, lr=lr, minutes=minutes, reading_loss=reading_loss,
                  val_every_minutes=val_every_minutes, validate=validation, to_device=count_and_move,
                  router_z_loss=router_z_loss,
                  attend_loss=(lambda targets: attend_loss * looking.loss(targets)) if looking is not None else None)
    # Includes validation time and the workers' start: a lower bound of the training rate.
    log["throughput"] = {f"{k}_per_second": round(v / seconds, 1) for k, v in counted.items()}
    final = validation()
    log.update(val_loss=final["loss"], val_blind_loss=final["blind_loss"], val_exact_match=final["exact_match"],
               val_f1=final["f1"], val_by_task=final["by_task"], val_visual=final["visual"],
               val_looks_right=final.get("looks_right"), val_top2_loss=final["top2_loss"])
    print(f"{run.out}: {log['steps']} steps in {log['minutes']} min ({log['skipped_steps']} non-finite skipped), "
          f"{log['throughput']}, final loss {log['final_loss']}, validation loss {log['val_loss']:.4f} "
          f"({log['val_blind_loss']:.4f} with blank images, {log['val_top2_loss']:.4f} with answers routed to 2 experts), "
          f"teacher-forced exact match {log['val_exact_match']:.3f}, F1 {log['val_f1']:.3f}")
    text._attn_implementation = saved_attention  # the checkpoint's own setting, not the training capture
    questions = [p.question for p in ts.plans("validation", calibration_prompts)] if calibrate_sere else None
    return finish(run, log, questions, extra_files=write_preprocessor_config)


def main(argv: list[str] | None = None) -> int:
    default = {name: param.default for name, param in inspect.signature(train).parameters.items()}  # one source
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true",
                   help=f"CPU end-to-end check at tiny shapes ({', '.join(f'{k}={v}' for k, v in SMOKE.items())}); "
                        "other flags given explicitly still apply")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help=f"default {default['size']}")
    p.add_argument("--steps", type=int, default=None, help=f"at most this many steps (default {default['steps']})")
    p.add_argument("--batch", type=int, default=None, help=f"default {default['batch']}")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"stop training after this long (default {default['minutes']})")
    p.add_argument("--lr", type=float, default=None, help=f"default {default['lr']}")
    p.add_argument("--val-every", dest="val_every_minutes", type=float, default=None,
                   help=f"minutes between validation runs (default {default['val_every_minutes']})")
    p.add_argument("--val-examples", type=int, default=None, help=f"default {default['val_examples']}")
    p.add_argument("--experts", choices=("grouped_mm", "eager"), default=None,
                   help="transformers' experts implementation while training (default grouped_mm)")
    p.add_argument("--reading-loss", type=float, default=None,
                   help=f"weight of the per-token reading head (0: off; default {default['reading_loss']})")
    p.add_argument("--read", dest="read_fraction", type=float, default=None,
                   help="share of training examples that are read-entry questions (training only; "
                        f"default {default['read_fraction']})")
    p.add_argument("--knowledge", dest="knowledge_fraction", type=float, default=None,
                   help="share of training examples made knowledge questions, beyond the half the task set's own "
                        f"draw asks (taskset_v2.KNOWLEDGE_SHARE; default {default['knowledge_fraction']})")
    p.add_argument("--attend-loss", type=float, default=None,
                   help="weight of the answer-attention targets (train_v2_attention; 0: off; "
                        f"default {default['attend_loss']})")
    p.add_argument("--centering", type=float, default=None,
                   help="weight of the penalty on the visual tokens' shared mean vector, inside the reading "
                        "head's loss, so scaled by --reading-loss too (TokenReadingHead; "
                        f"default {default['centering']}; 0: off)")
    p.add_argument("--expert-width", type=int, default=None,
                   help="each expert's intermediate size (default: the size's own; v2: 64)")
    p.add_argument("--balance-loss", type=float, default=None,
                   help="the router's load-balancing loss weight (default: the size's own; v2: 0.01)")
    p.add_argument("--router-z-loss", type=float, default=None,
                   help=f"weight of the routers' z-loss (training.router_z_term; default {default['router_z_loss']})")
    p.add_argument("--no-sere", dest="calibrate_sere", action="store_false", default=None, help="skip SERE calibration")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--workers", type=int, default=None)
    args = vars(p.parse_args(argv))
    settings = SMOKE.copy() if args.pop("smoke") else {}
    settings.update({k: v for k, v in args.items() if v is not None})
    train(**settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
