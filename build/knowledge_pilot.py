"""A CPU-minutes proxy for issue 18's question, before a GPU run: with a given routing recipe, does
cutting the decode-time router to K' experts lose facts that the MoE layers memorised?

    python -m zipmoe.build.knowledge_pilot [--minutes 4] [--expert-width 32] [--balance-loss 0.001]
        [--router-z-loss 0.01] [--out F.json]

The facts are task set v2's price lists (`taskset_v2.PRICE_LISTS`: 8 stores x 36 items), one
per sequence, in text alone: "<item> | <store> <price> <end>", the item as the question names it, the
store as the answer transcribes it, then the price, the only tokens the loss is taken on.
The model is the text decoder of `build/train_v2.py`'s v2 size with the recipe's routing knobs
(the same meaning as train_v2's flags), trained on random facts for `--minutes` (AdamW, cosine
decay over the clock), then every fact is read back teacher-forced with the router cut to K' at
the answer's rows (store and price: the rows serving computes in decode steps), through
`routing_truncation.truncated_routing`. Per K': price tokens right, whole prices right, their
loss. What it leaves out on purpose: images (in task set v2 the store is read off a receipt) and
the other tasks sharing the experts; so it tells whether a recipe *can* make top-2 truncation cost
recall, not what a full run will score.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (Qwen3VLMoeTextConfig, Qwen3VLMoeTextModel,
                                                                      load_balancing_loss_func)

from zipmoe.build import taskset_v2 as ts
from zipmoe.build.routing_truncation import answer_nll, truncated_routing
from zipmoe.build.train_v2 import SIZES
from zipmoe.build.training import answer_exact_match, router_z_term

ANSWER_FROM = 2  # [item, |, store words..., price chars..., end]: the answer (decode rows) starts at 2


def vocabulary() -> dict[str, int]:
    words = ["<pad>", "|", "<end>", *ts.ITEMS, *sorted({w for s in ts.STORES for w in s.split()}),
             *"0123456789."]
    return {w: i for i, w in enumerate(words)}


def price_lists(stores: int) -> dict[str, dict[str, str]]:
    """8: the task set's own price lists. 64: every first word of a store's name with every second
    one ("CITY DELI"), priced the same way: eight times the facts, from the same words."""
    if stores == len(ts.STORES):
        return ts.PRICE_LISTS
    firsts, seconds = zip(*(s.split() for s in ts.STORES))
    names = [f"{a} {b}" for a in firsts for b in seconds]
    if stores != len(names):
        raise ValueError(f"stores must be {len(ts.STORES)} or {len(names)}, got {stores}")
    return ts.price_lists(names)


def facts(vocab: dict[str, int], lists: dict[str, dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (store, item) fact as ids [n, L] (padded) and its labels: the ids of its price and end
    tokens, -100 elsewhere (as train_v2's labels, so routing_truncation's and training's scorers apply)."""
    rows, labels = [], []
    for store, prices in lists.items():
        for item, price in prices.items():
            head = [vocab[item], vocab["|"], *(vocab[w] for w in store.split())]
            tail = [vocab[c] for c in price] + [vocab["<end>"]]
            rows.append(head + tail)
            labels.append([-100] * len(head) + tail)
    width = max(map(len, rows))
    ids = torch.tensor([r + [vocab["<pad>"]] * (width - len(r)) for r in rows])
    return ids, torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])


class FactModel(torch.nn.Module):
    def __init__(self, config: Qwen3VLMoeTextConfig):
        super().__init__()
        self.decoder = Qwen3VLMoeTextModel(config)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, router_logits: bool = False):
        out = self.decoder(input_ids=ids, output_router_logits=router_logits)
        return self.head(out.last_hidden_state), getattr(out, "router_logits", None)


def recall(model: FactModel, ids: torch.Tensor, labels: torch.Tensor, keep: int) -> dict:
    rows = torch.zeros_like(ids, dtype=torch.bool)
    rows[:, ANSWER_FROM:] = True
    with torch.no_grad(), truncated_routing(model, keep, rows):
        logits, _ = model(ids)
    target = labels[:, 1:]
    right = logits[:, :-1].argmax(-1)[target != -100] == target[target != -100]
    return {"keep": keep, "token_accuracy": round(float(right.float().mean()), 4),
            "prices_exact": round(float(answer_exact_match(logits, labels).float().mean()), 4),
            "loss": round(float(answer_nll(logits, labels).mean()), 4)}


def run(minutes: float = 4.0, expert_width: int | None = None, balance_loss: float | None = None,
        router_z_loss: float = 0.0, batch: int = 64, lr: float = 3e-3, seed: int = 0,
        keeps: tuple[int, ...] = (8, 4, 2, 1, 0), stores: int = 8) -> dict:
    torch.manual_seed(seed)
    vocab = vocabulary()
    shape = {k: v for k, v in SIZES["v2"][0].items() if k != "rope_parameters"}
    if expert_width:
        shape["moe_intermediate_size"] = expert_width
    if balance_loss is not None:
        shape["router_aux_loss_coef"] = balance_loss
    config = Qwen3VLMoeTextConfig(**shape, vocab_size=len(vocab), pad_token_id=0)
    config._experts_implementation = "grouped_mm"  # a third faster than the per-expert loop on a CPU
    model = FactModel(config)
    ids, labels = facts(vocab, price_lists(stores))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start, steps, losses = time.monotonic(), 0, []
    while (elapsed := time.monotonic() - start) < minutes * 60:
        for group in opt.param_groups:  # cosine decay over the clock, as train_v2's schedule follows time
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / (minutes * 60))))
        pick = torch.randint(len(ids), (batch,))
        logits, router = model(ids[pick], router_logits=True)
        loss = answer_nll(logits, labels[pick]).mean()
        real = ids[pick] != 0
        loss = loss + config.router_aux_loss_coef * load_balancing_loss_func(
            router, config.num_experts, config.num_experts_per_tok, real.long())
        if router_z_loss:
            loss = loss + router_z_loss * router_z_term(router, real.long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if steps % 100 == 0:
            losses.append([steps, round(loss.item(), 4)])
            print(f"step {steps}, {elapsed / 60:.1f} min, loss {losses[-1][1]:.4f}", flush=True)
    model.eval()
    return {"stores": stores, "seed": seed, "facts": len(ids), "steps": steps, "minutes": minutes, "batch": batch,
            "lr": lr,
            "moe_intermediate_size": config.moe_intermediate_size, "router_aux_loss_coef": config.router_aux_loss_coef,
            "router_z_loss": router_z_loss, "losses": losses, "rows": [recall(model, ids, labels, k) for k in keeps]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--expert-width", type=int, default=None, help="default: the v2 size's (64)")
    p.add_argument("--balance-loss", type=float, default=None, help="default: the v2 size's (0.01)")
    p.add_argument("--router-z-loss", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--stores", type=int, default=8, help="8: the task set's price lists; 64: eight times the facts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    result = run(a.minutes, a.expert_width, a.balance_loss, a.router_z_loss, a.batch, a.lr, a.seed, stores=a.stores)
    print(f"{result['facts']} facts, {result['steps']} steps; per experts kept at the answer's rows:")
    for r in result["rows"]:
        print(f"  keep {r['keep']}: price tokens {r['token_accuracy']:.3f}, whole prices {r['prices_exact']:.3f}, "
              f"loss {r['loss']:.4f}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
