"""Mean activated-expert union per MoE layer vs decode batch size, per routing policy.

    python -m zipmoe.kernels.benchmarks.bench_routing [--checkpoint checkpoints/tiny] [--out docs/results/routing_tiny]

Runs the real engine: B requests decode together for --steps steps under each policy; the engine's
RoutingStats give the union the router chose (= top-K) and the union computed after re-routing,
averaged over decode layer-steps, and the share of token slots re-routed. Writes OUT.json + OUT.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.routing import OeaPolicy, RoutingPolicy, RoutingStats, SerePolicy
from zipmoe.engine.sequence import SamplingParams
from zipmoe.prompt import ChatPrompt
from zipmoe.sere_file import load_sere

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def variants(checkpoint: Path, device: torch.device, top_k: int) -> dict[str, tuple[dict, RoutingPolicy]]:
    tables = load_sere(checkpoint)
    rows = {layer: i for i, layer in enumerate(tables.moe_layers)}
    sim, protect = tables.similarity.to(device), tables.protect.to(device)
    out = {"topk": ({"routing": "topk"}, RoutingPolicy())}
    for k1 in (1, 2):
        for rho in (0.0, 0.3, 0.5):
            for prot in (True, False):
                name = f"sere K'={k1} rho={rho} protect={'on' if prot else 'off'}"
                out[name] = ({"routing": "sere", "primary_k": k1, "rho": rho, "protect": prot},
                             SerePolicy(sim, protect, rows, k1, rho, prot))
    out["oea k0=2"] = ({"routing": "oea", "k0": 2}, OeaPolicy(2))
    return out


def measure(engine: LLMEngine, prompts: list[list[int]], policy: RoutingPolicy, batch: int, steps: int) -> dict:
    engine.model.policy = policy
    engine.model.routing_stats = stats = RoutingStats()
    for i in range(batch):
        engine.add_request(prompts[i % len(prompts)], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    while engine.has_work:
        engine.step()
    return {"union_topk": stats.union_before / stats.layer_steps, "union": stats.union_after / stats.layer_steps,
            "rerouted_slots_per_layer_step": stats.rerouted_slots / stats.layer_steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/tiny"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    engine = LLMEngine(args.checkpoint, EngineConfig(device=args.device, num_kv_blocks=2048, max_model_len=512,
                                                     max_num_seqs=max(BATCHES), max_num_batched_tokens=16384))
    chat = ChatPrompt(args.checkpoint)
    prompts = [chat.encode(f"Note {i}: what does item {i * 13 % 97} cost, and where was it bought?") for i in range(64)]
    rows = []
    for name, (fields, policy) in variants(args.checkpoint, device, engine.text.top_k).items():
        for batch in BATCHES:
            r = measure(engine, prompts, policy, batch, args.steps)
            rows.append({"policy": name, "batch": batch, **fields, **r})
            print(f"{name:32s} batch {batch:4d}  union top-K {r['union_topk']:6.2f} -> {r['union']:6.2f}  "
                  f"re-routed slots/layer-step {r['rerouted_slots_per_layer_step']:7.2f}")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "checkpoint": str(args.checkpoint), "experts": engine.text.num_experts, "top_k": engine.text.top_k,
              "steps": args.steps, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.out.with_suffix(".png"))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    names = dict.fromkeys(r["policy"] for r in result["rows"])
    for name in names:
        if "protect=off" in name:
            continue  # protect on/off overlap on the tiny model's 2 protected experts; the JSON has both
        pts = [(r["batch"], r["union"]) for r in result["rows"] if r["policy"] == name]
        ax.plot(*zip(*pts), marker="o", label=name, linewidth=2 if name == "topk" else 1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("mean experts read per MoE layer")
    ax.set_title(f"{result['checkpoint']} ({result['experts']} experts, top-{result['top_k']}) on {result['device']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
