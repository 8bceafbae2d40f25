"""The training recipe `build/train_tiny.py` (notes) and `build/train_v2.py` (task set v2) share.

Both train a Qwen3-VL-MoE from scratch with the production model class, a byte-level BPE learned
on the task's own text (digits one token each), inputs built exactly as the server builds them,
the loss on the answer and <|im_end|> plus the router's balancing loss and an auxiliary reading
head on the vision tower, examples drawn by seed by DataLoader workers, and a clock-bound run
whose learning rate decays over whichever runs out first, the steps or the minutes. Here:

  - `SplitDataset`: a split's examples as model inputs (`text_inputs`: the engine's splice of the
    prompt, then the answer) and `collate` for the batch; `MergedTokensHead`, the reading heads' base;
  - `set_up`: tokenizer, config, model, the training-time vision shortcuts and experts
    implementation (`grouped_mm_trains_on` decides whether grouped GEMM can train here,
    `grouped_mm_in_bf16` runs it in bf16 under CUDA autocast);
  - `loaders`, `fit` (optimiser and step loop, periodic validation), `eval_batches` (the
    validation forward) and `finish` (the checkpoint, `train_log.json`, SERE calibration).

What differs between the two (the task data, the vision shortcuts for one image size or many,
the reading head, the validation metrics, how a batch reaches the device) comes in as arguments.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from zipmoe.build.sere_calibrate import calibrate
from zipmoe.build.tiny_checkpoint import build_tokenizer, model_config, save_model
from zipmoe.engine.multimodal import splice_images
from zipmoe.prompt import ChatPrompt


class SplitDataset(Dataset):
    """Examples start .. start + length - 1 of a split as model inputs; subclasses draw the example
    and its pixels in __getitem__ and build the text with `text_inputs`."""

    def __init__(self, checkpoint: Path, split: str, length: int, start: int = 0):
        self.checkpoint, self.split, self.length, self.start = checkpoint, split, length, start
        self._prompt: ChatPrompt | None = None  # built in the worker: tokenizers are not shared across processes
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        vision = cfg["vision_config"]
        self.patch, self.merge = vision["patch_size"], vision["spatial_merge_size"]
        self.temporal = vision["temporal_patch_size"]
        self.image_token = cfg["image_token_id"]

    def __len__(self) -> int:
        return self.length

    @property
    def prompt(self) -> ChatPrompt:
        if self._prompt is None:
            self._prompt = ChatPrompt(self.checkpoint)
        return self._prompt

    def text_inputs(self, question: str, answer: str, merged: list[tuple[int, int]]) -> dict:
        """The chat prompt for images of `merged` (rows, cols) merged tokens, then the answer and
        <|im_end|>: ids, labels (-100 but on the answer), mRoPE positions [3, tokens] and the answer
        tokens' character spans in the answer (answer_offsets; collate leaves them out)."""
        # Expanded ids and mRoPE positions exactly as the engine splices them (every token kept).
        # Computing the positions here, in the workers, spares the model's per-example Python loop.
        cells = torch.cat([torch.cartesian_prod(torch.arange(r), torch.arange(c)) for r, c in merged])
        ids, positions, rope_delta = splice_images(self.prompt.encode(question, len(merged)), self.image_token,
                                                   [r * c for r, c in merged], cells, merged)
        answer = self.prompt.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        answer_positions = torch.arange(len(ids), len(ids) + len(answer.ids)).expand(3, -1) + rope_delta
        return {"ids": torch.tensor(ids + answer.ids), "labels": torch.tensor([-100] * len(ids) + answer.ids),
                "positions": torch.cat([positions, answer_positions], dim=1), "answer_offsets": answer.offsets}


class MergedTokensHead(torch.nn.Module):
    """Base of the training-only reading heads on the vision tower (not saved with the checkpoint):
    a forward hook keeps the tower's merged tokens (and its DeepStack features) of the last forward
    for the subclass's `loss`."""

    def __init__(self, visual: torch.nn.Module):
        super().__init__()
        self.merged: torch.Tensor | None = None
        self.deepstack: list[torch.Tensor] = []
        visual.register_forward_hook(self._keep_merged_tokens)

    def _keep_merged_tokens(self, module, args, output) -> None:
        self.merged, self.deepstack = output.pooler_output, list(output.deepstack_features or [])


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
            "readings": torch.cat([b["readings"] for b in batch]),
            **({"attend": torch.cat([F.pad(b["attend"], (1, 0), value=i) for i, b in enumerate(batch)])}
               if "attend" in batch[0] else {})}


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


def grouped_mm_in_bf16() -> None:
    """Under CUDA autocast, run transformers' grouped expert GEMMs in bf16 (process-wide, idempotent).

    Autocast does not cover torch's grouped GEMM (pytorch#174763), so on the float32 master weights
    it ran torch's per-expert fallback: one GEMM per expert and projection, forward and backward,
    ~2.5 k of a v2 training step's launches on the H200. Its bf16 kernel does the same math at the
    precision autocast gives every other GEMM of the step."""
    from transformers.integrations import moe

    if getattr(moe._grouped_mm, "in_bf16", False):
        return
    grouped_mm = moe._grouped_mm

    def grouped_mm_bf16(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if weight.is_cuda and torch.is_autocast_enabled("cuda"):
            return grouped_mm(input.to(torch.bfloat16), weight.to(torch.bfloat16), offs)
        return grouped_mm(input, weight, offs)

    grouped_mm_bf16.in_bf16 = True
    moe._grouped_mm = grouped_mm_bf16


GOLDEN = 0.6180339887498949  # example k is a training-only one when (k * GOLDEN) mod 1 < fraction


def is_training_only(index: int, fraction: float) -> bool:
    """Low-discrepancy choice of a split's training-only examples (train_tiny's describe questions,
    train_v2's read-entry questions): any run of examples holds close to `fraction` of them."""
    return (index * GOLDEN) % 1.0 < fraction


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


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain float32 elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def move_batch(data: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in data.items()}


@dataclass
class Run:
    """A model set up for training and the checkpoint folder it is saved to."""
    out: Path
    device: torch.device
    tokenizer: PreTrainedTokenizerFast
    config: Qwen3VLMoeConfig
    model: Qwen3VLMoeForConditionalGeneration
    params: int
    experts: str  # the experts implementation training uses
    saved_settings: tuple[str, str]  # the config's own vision attention and experts implementation


def set_up(out: str | Path, size: tuple[dict, dict], corpus: list[str], vocab_size: int, *, seed: int,
           device: str | None, vision_attention: str, vision_inputs: Callable[[torch.nn.Module], None],
           experts: str, experts_train: Callable[[torch.device], bool] = grouped_mm_trains_on,
           label_images: bool = False) -> Run:
    """Tokenizer (learned on `corpus`) and config written to `out`, the model built on the device.

    size: (text, vision) config overrides. vision_attention: the attention name the tower trains
    with; vision_inputs: installs its position-id shortcut on the tower. experts: "grouped_mm"
    (one grouped GEMM per projection instead of a loop over the experts with a host sync each:
    half the launches of a step, the same loss), or "eager" (the loop), which it falls back to
    where `experts_train(device)` says grouped GEMM cannot train (train_tiny passes its own
    name for it, which its tests replace)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    # Digits one token each (as Qwen's tokenizer): a number's later digits are decode steps, where
    # the routing policies act.
    tok = build_tokenizer(out, corpus, vocab_size, split_digits=True, label_images=label_images)
    text, vision = size
    config = model_config(tok, text=text, vision=vision)
    config.save_pretrained(out)  # the dataset reads config.json (the tokenizer files are already there)
    model = Qwen3VLMoeForConditionalGeneration(config).to(dev)
    saved = (config.vision_config._attn_implementation, config.text_config._experts_implementation)
    config.vision_config._attn_implementation = vision_attention
    vision_inputs(model.model.visual)
    if experts == "grouped_mm" and not experts_train(dev):
        experts = "eager"
    if experts == "grouped_mm" and dev.type == "cuda":
        grouped_mm_in_bf16()
    config.text_config._experts_implementation = experts
    params = sum(p.numel() for p in model.parameters())
    return Run(out, dev, tok, config, model, params, experts, saved)


def loaders(run: Run, train_set: Dataset, val_set: Dataset, batch: int, workers: int | None,
            **options) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders, collated for the model. workers: by default all cores but
    two on CUDA (an example costs 5-20 ms of CPU to draw, patchify and splice: at several steps a
    second the loader needs most of the machine), none on a CPU."""
    if workers is None:
        workers = max(1, (os.cpu_count() or 2) - 2) if run.device.type == "cuda" else 0
    args = dict(batch_size=batch, num_workers=workers, persistent_workers=workers > 0, **options,
                collate_fn=functools.partial(collate, pad_id=run.config.text_config.pad_token_id,
                                             image_token=run.config.image_token_id))
    return DataLoader(train_set, **args), DataLoader(val_set, **args)


def router_z_term(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean squared log-sum-exp of each real token's router logits,
    averaged over the MoE layers. Small logits keep the router's top-K weights closer together, so
    that more of the chosen experts carry a share of the output (issue 18 wants experts a top-2
    truncation misses; what it did for task set v2 in session 24: docs/QUALITY.md)."""
    # A weighted mean, not boolean indexing: indexing by a mask syncs with the host once per layer.
    real = attention_mask.reshape(-1).float()
    z = torch.stack([torch.logsumexp(logits.float(), dim=-1).square() for logits in router_logits])
    return (z * real).sum() / (real.sum() * len(router_logits))


def fit(run: Run, reading: torch.nn.Module, loader: DataLoader, log: dict, *, steps: int, lr: float,
        minutes: float, reading_loss: float, val_every_minutes: float, validate: Callable[[], dict],
        to_device: Callable[[dict], dict] | None = None,
        attend_loss: Callable[[torch.Tensor], torch.Tensor] | None = None, router_z_loss: float = 0.0) -> float:
    """Train the model and the reading head (its `loss(readings)` weighted by reading_loss) over
    `loader` until `steps` or `minutes` run out, calling `validate()` every val_every_minutes.
    to_device: a collated batch (task ids dropped) -> on the device (default: moved as it is).
    attend_loss: the batch's "attend" targets -> a weighted loss on the last forward, added (and
    logged as a fourth column of `losses`). router_z_loss: weight of ST-MoE's z-loss on the MoE
    routers' logits (`router_z_term`). Adds losses, validation, skipped_steps, steps, minutes
    and final_loss to `log`; returns the seconds the loop ran."""
    dev = run.device
    to_device = to_device or functools.partial(move_batch, device=dev)
    trained = [*run.model.parameters(), *reading.parameters()]
    opt = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.01, fused=dev.type == "cuda")
    log.update(losses=[], validation=[], skipped_steps=0)
    start = time.monotonic()
    budget, next_validation = minutes * 60, val_every_minutes * 60
    run.model.train()
    bar = tqdm(loader, total=steps, desc="train", mininterval=5)
    step = 0
    for step, data in enumerate(bar):
        elapsed = time.monotonic() - start
        # The schedule decays over whichever runs out first, the steps or the time budget: a run
        # cut by the clock still ends at the low learning rate.
        progress = max(step / steps, elapsed / budget)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, lr, warmup=min(200, steps // 10 + 1))
        del data["task"]
        data = to_device(data)
        readings, attend = data.pop("readings"), data.pop("attend", None)
        with autocast(dev):
            out = run.model(**data, output_router_logits=True)
            loss = out.loss
            if router_z_loss:
                loss = loss + router_z_loss * router_z_term(out.router_logits, data["attention_mask"])
            aux = reading.loss(readings)
            attend_term = attend_loss(attend) if attend_loss is not None else None
        loss = loss + reading_loss * aux + (attend_term if attend_term is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        # A non-finite step (a bf16 overflow) would poison Adam's moments for good: drop it instead.
        # One sync per step, a small price at these model sizes.
        if torch.isfinite(grad_norm):
            opt.step()
        else:
            log["skipped_steps"] += 1
        if step % 50 == 0:
            # total, reading head[, attention targets]
            log["losses"].append([step, round(loss.item(), 4), round(aux.item(), 4),
                                  *([round(attend_term.item(), 4)] if attend_term is not None else [])])
            bar.set_postfix(loss=f"{loss.item():.3f}", reading=f"{aux.item():.3f}")
        if elapsed > next_validation:  # a learning curve, per task
            next_validation += val_every_minutes * 60
            log["validation"].append({"minute": round(elapsed / 60, 2), "step": step, **validate()})
            print(f"minute {elapsed / 60:.1f}, step {step}: validation {log['validation'][-1]}")
        if time.monotonic() - start > budget:
            print(f"time budget of {minutes} min reached at step {step}")
            break
    seconds = time.monotonic() - start
    log["steps"], log["minutes"] = step + 1, round(seconds / 60, 2)
    log["final_loss"] = round(loss.item(), 4)
    return seconds


def eval_batches(model, loader: DataLoader, device: torch.device,
                 to_device: Callable[[dict], dict] | None = None) -> Iterator[tuple[torch.Tensor, dict, object]]:
    """(task ids, batch on the device, model output without gradients) for each validation batch;
    the model is in eval mode until the last one is consumed. The batch keeps its "attend" targets
    (if any), on the device: pop them before another forward."""
    to_device = to_device or functools.partial(move_batch, device=device)
    model.eval()
    for batch in loader:
        task = batch.pop("task")
        del batch["readings"]
        batch = to_device(batch)
        inputs = {k: v for k, v in batch.items() if k != "attend"}
        with torch.no_grad(), autocast(device):
            out = model(**inputs)
        yield task, batch, out
    model.train()


def finish(run: Run, log: dict, calibration_questions: Iterable[str] | None,
           extra_files: Callable[[Path], None] | None = None) -> dict:
    """Save the checkpoint (bf16) and `train_log.json`; `extra_files(out)` writes what the task
    needs beyond save_model's files; then SERE calibration on the questions (None: none)."""
    # Training-time choices, not settings of the saved checkpoint.
    run.config.vision_config._attn_implementation, run.config.text_config._experts_implementation = run.saved_settings
    save_model(run.model.cpu(), run.out)
    if extra_files is not None:
        extra_files(run.out)
    (run.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if calibration_questions is not None:
        prompts = run.out / "calibration_prompts.jsonl"
        prompts.write_text("".join(json.dumps({"text": q}) + "\n" for q in calibration_questions))
        calibrate(run.out, prompts_file=prompts, device=str(run.device))
    print(f"{run.out}: done")
    return log
