"""Mean activated-expert union per MoE layer vs decode batch size, per routing policy.

    python -m zipmoe.kernels.benchmarks.bench_routing [--checkpoint checkpoints/tiny] [--out docs/results/routing_tiny]
    python -m zipmoe.kernels.benchmarks.bench_routing --synthetic-30b --out docs/results/routing_30b_h200

Checkpoint mode runs the real engine: B requests decode together for --steps steps under each
policy; the engine's RoutingStats give the union the router chose (= top-K) and the union computed
after re-routing, averaged over decode layer-steps, and the token slots re-routed.
--synthetic-30b: random weights of Qwen3-30B-A3B's MoE shape (48 layers, 128 experts, top-8, hidden
2048, expert width 768), calibrated with the real calibration code; router inputs are a per-layer
shared direction plus noise, which skews expert popularity the way trained routers are skewed.
Writes OUT.json + OUT.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.routing import OeaPolicy, RoutingPolicy, RoutingStats, SerePolicy
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels.layer_ops import router_reference
from zipmoe.plotting import pyplot, write_plot
from zipmoe.prompt import ChatPrompt
from zipmoe.sere_file import load_sere

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def variants(sim: torch.Tensor, protect: torch.Tensor, rows: dict[int, int]) -> dict[str, tuple[dict, RoutingPolicy]]:
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
    engine.set_routing_policy(policy)
    before = engine.routing_stats.snapshot()
    for i in range(batch):
        engine.add_request(prompts[i % len(prompts)], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    while engine.has_work:
        engine.step()
    after = engine.routing_stats.snapshot()
    return summary({k: after[k] - before[k] for k in after})


def synthetic_30b(device: torch.device, steps: int, seed: int = 0, layers: int = 48, experts: int = 128,
                  top_k: int = 8, hidden: int = 2048, width: int = 768, calib_tokens: int = 1024) -> list[dict]:
    from zipmoe.build.sere_calibrate import gram_matrix, protection_scores, similarity, top_n

    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16)

    gates, directions, sims, protects = [], [], [], []
    for _ in tqdm(range(layers), desc="random 30B-shaped layers, calibrating"):
        gate = randn(experts, hidden, std=hidden ** -0.5)
        gate_up, down = randn(experts, 2 * width, hidden, std=0.02), randn(experts, width, hidden, std=0.02)
        direction = torch.randn(hidden, generator=g, device=device)
        x = (direction + torch.randn(calib_tokens, hidden, generator=g, device=device)).to(torch.bfloat16)
        sim = similarity(gram_matrix(x, gate_up, down, 256, 16), "frobenius")
        score = protection_scores(x, gate, gate_up, down, sim, top_k, True, 256, 16)
        gates.append(gate)
        directions.append(direction)
        sims.append(sim.float())
        protects.append(top_n(score, experts // 8).to(device))
    sim, protect = torch.stack(sims), torch.stack(protects)
    rows = []
    for name, (fields, policy) in variants(sim, protect, {i: i for i in range(layers)}).items():
        for batch in BATCHES:
            stats = RoutingStats()
            inputs = torch.Generator(device=device).manual_seed(batch)  # every policy sees the same tokens
            for _ in range(steps):
                routed = []
                for layer in range(layers):
                    noise = torch.randn(batch, hidden, generator=inputs, device=device)
                    x = (directions[layer] + noise).to(torch.bfloat16)
                    probs, ids, w = router_reference(x, gates[layer], top_k, True)
                    routed.append((ids, policy.route(layer, probs, ids, w, None)[0]))
                stats.add_step(routed, batch, experts)
            rows.append({"policy": name, "batch": batch, **fields, **summary(stats.snapshot())})
            report(name, batch, rows[-1])
    return rows


def summary(s: dict[str, int]) -> dict:
    """RoutingStats sums (a snapshot, or the difference of two) -> means per decode layer-step."""
    return {"union_topk": s["union_before"] / s["layer_steps"], "union": s["union_after"] / s["layer_steps"],
            "rerouted_slots_per_layer_step": s["rerouted_slots"] / s["layer_steps"]}


def report(name: str, batch: int, r: dict) -> None:
    print(f"{name:32s} batch {batch:4d}  union top-K {r['union_topk']:6.2f} -> {r['union']:6.2f}  "
          f"re-routed slots/layer-step {r['rerouted_slots_per_layer_step']:7.2f}", flush=True)


def checkpoint_rows(checkpoint: Path, device: torch.device, steps: int) -> tuple[list[dict], int, int]:
    engine = LLMEngine(checkpoint, EngineConfig(device=device.type, num_kv_blocks=2048, max_model_len=512,
                                                max_num_seqs=max(BATCHES), max_num_batched_tokens=16384))
    chat = ChatPrompt(checkpoint)
    prompts = [chat.encode(f"Note {i}: what does item {i * 13 % 97} cost, and where was it bought?") for i in range(64)]
    tables = load_sere(checkpoint)
    rows = []
    policies = variants(tables.similarity.to(device), tables.protect.to(device),
                        {layer: i for i, layer in enumerate(tables.moe_layers)})
    for name, (fields, policy) in policies.items():
        for batch in BATCHES:
            rows.append({"policy": name, "batch": batch, **fields, **measure(engine, prompts, policy, batch, steps)})
            report(name, batch, rows[-1])
    return rows, engine.text.num_experts, engine.text.top_k


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/tiny"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--synthetic-30b", action="store_true", help="random Qwen3-30B-A3B-shaped MoE layers (GPU)")
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.synthetic_30b:
        rows, experts, top_k, model = synthetic_30b(device, args.steps), 128, 8, "random Qwen3-30B-A3B shape"
    else:
        (rows, experts, top_k), model = checkpoint_rows(args.checkpoint, device, args.steps), str(args.checkpoint)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "checkpoint": model, "experts": experts, "top_k": top_k, "steps": args.steps, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        write_plot(result, args.out.with_suffix(".png"), plot)
    return 0


def plot(result: dict, path: Path) -> bool:
    """Experts read per layer against batch, a line a policy; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

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
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
