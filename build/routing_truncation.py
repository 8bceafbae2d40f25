"""Does a trained checkpoint need its top-K experts? Teacher-forced answers with the router cut to
its top K' at the answer tokens only, where serving's decode-time policies act.

    python -m zipmoe.build.routing_truncation --checkpoint DIR [--n 64] [--keep 8,4,2] [--knowledge-only]
        [--out F.json]

Task set v2's validation examples (`build/train_v2.py`'s dataset and batches) go through the
Hugging Face model of the checkpoint. In every MoE layer the router's choice for the answer tokens
(the rows serving computes in decode steps; the prompt, prefilled, keeps every expert) is cut to
its K' highest-weighted experts and renormalised, as the model renormalises its top-K: K' = the
checkpoint's top-K is the model as trained, K' = 0 the model without its experts there. Per K':
the answers' mean loss and teacher-forced token F1, the share of the answers' prices whose every
token the model gets right (a knowledge answer's price is recalled, a reading answer's read: token
F1 counts it as one word beside the store's name), and how much of the router's top-K weight its
top K' held (before renormalising): a router whose first two experts carry nearly all the weight
loses little when cut to two. This is the reading issue 18 asks of a model, that top-2 truncation
should hurt, with no server and no sampling in the way; `train_v2`'s validation reports the K'=2
loss beside its own.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
from pathlib import Path

import torch
from tqdm import tqdm

from zipmoe.build import taskset_v2 as ts
from zipmoe.build.training import autocast, collate, eval_batches
from zipmoe.clients.quality_metrics import token_f1


@contextlib.contextmanager
def truncated_routing(model, keep: int, rows: torch.Tensor, kept_mass: list[float] | None = None):
    """Within the block, every MoE router of `model` (a Qwen3-VL-MoE) keeps only its `keep`
    highest-weighted experts at the flattened token rows where `rows` ([batch, tokens] bool) is
    set, renormalised (keep 0: no expert there); rows on the model's device. kept_mass: gets, per
    layer call, the mean share of the top-K weight those experts held at those rows. With `keep` at
    least the top-K, or no rows, the model runs as trained, untouched."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    at = rows.reshape(-1)
    if not routers or keep >= routers[0].top_k or not bool(at.any()):  # decided once, not per layer
        yield
        return

    def cut(original, hidden):
        logits, weights, ids = original(hidden)
        # Qwen's router renormalises its top-K to sum to one, so their share is the weight itself.
        head = weights[at].float()
        if kept_mass is not None:
            kept_mass.append(float(head[:, :keep].sum(-1).mean()))
        # topk returns the experts sorted by weight: the first `keep` slots are the ones kept; with
        # none kept the MoE layer adds nothing there (how much the experts matter at all).
        head[:, keep:] = 0
        weights = weights.clone()
        weights[at] = (head / head.sum(-1, keepdim=True).clamp(min=1e-30)).to(weights.dtype)
        return logits, weights, ids

    try:
        for r in routers:  # an instance attribute over the class's forward, deleted after
            r.forward = functools.partial(cut, r.forward)
        yield
    finally:
        for r in routers:
            r.__dict__.pop("forward", None)


def answer_rows(labels: torch.Tensor) -> torch.Tensor:
    """The answer tokens as inputs (labels are the ids there): the rows decode steps compute."""
    return labels != -100


def answer_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over each example's answer tokens: [batch]."""
    target = labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), target.clamp(min=0),
                                            reduction="none")
    scored = target != -100
    return (nll * scored).sum(1) / scored.sum(1).clamp(min=1)


def prices_right(logits: torch.Tensor, labels: torch.Tensor, tokenizer) -> list[tuple[int, int]]:
    """Per example: (prices whose every token the teacher-forced argmax gets right, prices) in its
    answer; a price is a run of answer tokens that decode to digits and points alone."""
    def price_token(token: int) -> bool:
        text = tokenizer.decode([token]).strip()
        return bool(text) and set(text) <= set("0123456789.")

    out = []
    for pred, target in zip(logits[:, :-1].argmax(-1), labels[:, 1:]):
        scored = target != -100
        pred, target = pred[scored].tolist(), target[scored].tolist()
        is_price = [price_token(t) for t in target]
        right = total = 0
        for i, price in enumerate(is_price):
            if price and (i == 0 or not is_price[i - 1]):  # a price starts: its run of tokens
                end = next((j for j in range(i, len(target)) if not is_price[j]), len(target))
                total += 1
                right += pred[i:end] == target[i:end]
        out.append((right, total))
    return out


def probe(checkpoint: Path, n: int = 64, keeps: tuple[int, ...] = (8, 4, 2), split: str = "validation",
          batch: int = 8, device: str | None = None, knowledge_only: bool = False) -> dict:
    """knowledge_only: every example a knowledge question (the recall alone), not the split's own mix."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from zipmoe.build.train_v2 import TaskSetV2Dataset, answer_texts, to_device
    from zipmoe.build.train_v2_vision import PACKED_IMAGE_ATTENTION, grid_cached_vision_inputs
    from zipmoe.prompt import ChatPrompt

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).to(dev)
    model.config.vision_config._attn_implementation = PACKED_IMAGE_ATTENTION
    grid_cached_vision_inputs(model.model.visual)
    top_k = model.config.text_config.num_experts_per_tok
    data = TaskSetV2Dataset(checkpoint, split, n, knowledge_fraction=1.0 if knowledge_only else 0.0)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, collate_fn=functools.partial(
        collate, pad_id=model.config.text_config.pad_token_id, image_token=model.config.image_token_id))
    tokenizer = ChatPrompt(checkpoint).tokenizer
    temporal = model.config.vision_config.temporal_patch_size
    on_device = functools.partial(to_device, dev=dev, temporal=temporal)
    per = {k: {"loss": [], "f1": [], "prices": [], "mass": []} for k in keeps}  # per example, in loader order
    tasks: list[str] = []
    batches = tqdm(loader, desc=f"{split} batches, keep {'/'.join(map(str, keeps))}")
    for task, data_batch, out in eval_batches(model, batches, dev, on_device):
        tasks += [ts.TASKS[t] for t in task.tolist()]
        data_batch.pop("attend", None)
        labels = data_batch["labels"]
        for k in keeps:
            mass = [1.0]  # every expert kept: eval_batches' own forward is the model as trained
            logits = out.logits
            if k < top_k:
                mass = []
                with truncated_routing(model, k, answer_rows(labels), mass), torch.no_grad(), autocast(dev):
                    logits = model(**data_batch).logits
            per[k]["loss"] += answer_nll(logits, labels).tolist()
            per[k]["f1"] += [token_f1(p, r) for p, r in zip(*answer_texts(logits, labels, tokenizer))]
            per[k]["prices"] += prices_right(logits, labels, tokenizer)
            per[k]["mass"] += mass

    def means(s: dict, which: list[bool]) -> dict:
        n = max(sum(which), 1)
        right, total = (sum(c[i] for c, w in zip(s["prices"], which) if w) for i in (0, 1))
        return {**{key: round(sum(v for v, w in zip(s[src], which) if w) / n, 4)
                   for key, src in (("answer_loss", "loss"), ("f1", "f1"))},
                "prices_right": round(right / max(total, 1), 4), "prices": total}

    # The knowledge questions (answers recalled, not read: taskset_v2.KNOWLEDGE_TASKS) apart from the rest.
    knowledge = [t in ts.KNOWLEDGE_TASKS for t in tasks]
    groups = {"knowledge": knowledge, "reading": [not w for w in knowledge]}
    rows = [{"keep": k, **means(s, [True] * len(tasks)), "top_weight_kept": round(sum(s["mass"]) / len(s["mass"]), 4),
             **{name: {"n": sum(which), **means(s, which)} for name, which in groups.items()}}
            for k, s in per.items()]
    return {"checkpoint": str(checkpoint), "split": split, "n": len(tasks), "top_k": top_k, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a task set v2 checkpoint (build/train_v2.py)")
    p.add_argument("--n", type=int, default=64, help="validation examples")
    p.add_argument("--keep", default="8,4,2", help="experts kept per answer token, comma-separated")
    p.add_argument("--split", default="validation", choices=("validation", "test"))
    p.add_argument("--device", default=None)
    p.add_argument("--knowledge-only", action="store_true", help="knowledge questions only (the recalled prices)")
    p.add_argument("--out", type=Path, help="writes the result as JSON")
    a = p.parse_args(argv)
    result = probe(a.checkpoint, a.n, tuple(int(k) for k in a.keep.split(",")), a.split, device=a.device,
                   knowledge_only=a.knowledge_only)
    print(f"{result['checkpoint']}: {result['n']} {result['split']} examples, router top-{result['top_k']}")
    print(" keep  answer loss  token F1  top-K weight kept  knowledge: loss, F1, prices right"
          "  reading: loss, F1, prices right")
    for r in result["rows"]:
        kn, rd = r["knowledge"], r["reading"]
        print(f"{r['keep']:5d}  {r['answer_loss']:11.4f}  {r['f1']:8.4f}  {r['top_weight_kept']:17.4f}"
              f"  {kn['answer_loss']:9.4f}, {kn['f1']:.4f}, {kn['prices_right']:.3f} of {kn['prices']}"
              f"  {rd['answer_loss']:7.4f}, {rd['f1']:.4f}, {rd['prices_right']:.3f} of {rd['prices']}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
