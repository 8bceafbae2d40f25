"""Where one captured decode step spends its time, kernel by kernel (issue 15 item 6).

    python -m zipmoe.kernels.benchmarks.profile_decode --out docs/results/decode_profile_h200

Builds the same 48-layer dummy Qwen3-30B-A3B-shaped engine as bench_kernels (CUDA graphs), puts
`batch` 256-token text sequences into decode, then profiles a few replays of the captured decode
graph with torch.profiler (CUPTI records each kernel a graph launches). Per batch it reports every
kernel's time per step, its share of the step's kernel time, its launches per step and per layer,
and the replay's wall time against the sum of its kernels (the gaps between them). The graphs are
captured without programmatic dependent launch (`kernels/dependent_launch.py`): with it, a
kernel's recorded span starts at its early launch and includes its wait for the one before, so
spans overlap and no kernel's own time shows; bench_kernels' decode rows time the step with it.
With --mixed B it also times (also without PDL) the step that prefills one new prompt (512 tokens,
or each of --mixed-prompts; KxL: K prompts of L tokens admitted together, as when several streams
start again in one step) beside B decoding sequences (what a stream sees when other requests
arrive): as the engine runs it (short prompts' tokens as rows of a decode graph, engine/runner.py;
a longer one as piecewise CUDA graphs, engine/prefill_graphs.py), as piecewise graphs, and eagerly:
wall times, the eager step's sum of kernel times and launch count, and the plain decode step's wall
time beside them.
--policies topk,sere profiles each routing policy's steps (bench_kernels' SERE: K'=2, rho 0).
--pdl profiles the graphs as the engine captures them, with PDL, and reads the critical path: a
kernel's launches each wait for the one before to end, so what a launch adds to the step is its end
past the end of the one before ("exposed"), and what it overlapped is the time it was resident
before then ("early"); per kernel, per step and per launch, beside the spans. The gaps where no
kernel ran between two launches of a replay are summed apart.
Writes OUT.json ({"device", "copy_gbps", "steps": [...]}) and OUT.png (the largest kernels' shares).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from zipmoe.engine.sequence import SamplingParams
from zipmoe.plotting import pyplot, write_plot

from zipmoe.kernels import dependent_launch

from zipmoe.engine.routing import RoutingPolicy

from .bench_kernels import CFG, build_engine, decoding, drop, random_sere
from .timing import copy_gbps, cuda_time_us, require_cuda, wall_ms

REPLAYS = 10


def short_name(kernel: str) -> str:
    """cuBLAS/CUTLASS names run to hundreds of characters of template arguments: keep the head."""
    name = kernel.split("(")[0]
    return name if len(name) <= 90 else name[:87] + "..."


def critical_path(events, replays: int) -> dict:
    """{kernel: exposed / early / gap us per step} from the kernels' (name, start, end) in us of
    `replays` back-to-back replays: each launch's end past the previous one's, the time it had
    been resident before that, and the idle time before it started (module docstring). A replay's
    first launch, after the host's pause between replays, counts only its own span."""
    paths: dict[str, dict[str, float]] = {}
    per_replay = max(1, len(events) // replays)
    ordered = sorted(events, key=lambda e: e[2])
    for i, (name, start, end) in enumerate(ordered):
        first = i % per_replay == 0
        before = start if first else ordered[i - 1][2]
        k = paths.setdefault(short_name(name), {"exposed_us": 0.0, "early_us": 0.0, "gap_us": 0.0})
        k["exposed_us"] += (end - max(before, start)) / replays
        k["early_us"] += max(0.0, before - start) / replays
        k["gap_us"] += max(0.0, start - before) / replays
    return paths


def profile_step(engine, batch: int, prompt: int = 256) -> dict:
    g = torch.Generator().manual_seed(batch)
    seqs = decoding(engine, [torch.randint(0, 150000, (prompt,), generator=g).tolist() for _ in range(batch)], 64)
    bucket = engine.runner.graphs.bucket(batch)
    graph = engine.runner.graphs.graphs[bucket]
    replay_us = cuda_time_us(graph.replay, warmup=2, reps=10)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    drop(engine, seqs)
    launched = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    paths = critical_path(launched, REPLAYS)
    kernels = {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.device_time_total <= 0:
            continue
        k = kernels.setdefault(short_name(evt.key), {"us": 0.0, "calls": 0})
        k["us"] += evt.device_time_total / REPLAYS
        k["calls"] += evt.count / REPLAYS
    total = sum(k["us"] for k in kernels.values())
    rows = [{"kernel": name, "us_per_step": round(k["us"], 1), "share": round(k["us"] / total, 4) if total else 0.0,
             "launches_per_step": round(k["calls"], 1), "launches_per_layer": round(k["calls"] / CFG.num_layers, 2),
             **{key: round(us, 1) for key, us in paths.get(name, {}).items()}}
            for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])]
    launches = sum(k["calls"] for k in kernels.values())
    return {"batch": batch, "bucket": bucket, "replay_us": round(replay_us, 1), "kernel_us": round(total, 1),
            "gap_us": round(replay_us - total, 1), "launches_per_step": round(launches, 1),
            "launches_per_layer": round(launches / CFG.num_layers, 2), "kernels": rows}


def profile_mixed(engine, batch: int, prompt: int = 512, prompts: int = 1, context: int = 256, reps: int = 5) -> dict:
    """Wall ms of the step that prefills `prompts` new `prompt`-token requests beside `batch` decoding
    ones (median of `reps`, the device idle at both ends): as the engine runs it, as piecewise graphs,
    and eagerly; one more eager such step profiled for its kernels; and the plain decode step's wall ms."""
    g = torch.Generator().manual_seed(batch)
    tokens = lambda n: torch.randint(0, 150000, (n,), generator=g).tolist()
    seqs = decoding(engine, [tokens(context) for _ in range(batch)], 256, steps=0)
    new_prompts = [tokens(prompt) for _ in range(prompts)]

    def admit():
        for ids in new_prompts:
            engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))

    def prefill_step():  # one token: the new requests are done after the step that prefills them
        admit()
        engine.step()

    runner = engine.runner
    graphs, prompt_rows = runner.prefill_graphs, runner.prompt_row_context
    rode = runner.prompt_steps["decode_graph"][0]  # steps run as prompt rows of a decode graph, so far
    mixed = wall_ms(prefill_step, cuda=True, reps=reps)  # its warm-up compiles the prefill shapes' kernels
    rode = runner.prompt_steps["decode_graph"][0] > rode
    runner.prompt_row_context = 0  # the same steps as pieces ...
    piecewise = wall_ms(prefill_step, cuda=True, reps=reps)
    runner.prefill_graphs = None  # ... and eagerly
    eager = wall_ms(prefill_step, cuda=True, reps=reps)
    decode = wall_ms(engine.step, cuda=True, reps=reps)
    admit()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    runner.prefill_graphs, runner.prompt_row_context = graphs, prompt_rows
    drop(engine, seqs)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    return {"batch": batch, "prompt": prompt, "prompts": prompts, "mixed_step_ms": round(mixed, 2),
            "rode_decode_graph": rode,
            "mixed_piecewise_step_ms": round(piecewise, 2), "mixed_eager_step_ms": round(eager, 2),
            "decode_step_ms": round(decode, 2),
            "mixed_kernel_ms": round(sum(e.device_time_total for e in kernels) / 1e3, 2),
            "mixed_launches": sum(e.count for e in kernels)}


def print_step(step: dict, top: int = 15) -> None:
    print(f"\n{step['policy']}, batch {step['batch']} (graph bucket {step['bucket']}): replay {step['replay_us']:.0f} us, kernels "
          f"{step['kernel_us']:.0f} us, gaps {step['gap_us']:.0f} us, {step['launches_per_step']:.0f} launches "
          f"= {step['launches_per_layer']:.1f} per layer", flush=True)
    for r in step["kernels"][:top]:
        print(f"  {r['us_per_step']:8.1f} us {100 * r['share']:5.1f} %  {r['launches_per_layer']:5.2f}/layer  "
              f"exposed {r.get('exposed_us', 0):7.1f} early {r.get('early_us', 0):7.1f} gap {r.get('gap_us', 0):5.1f}  "
              f"{r['kernel']}", flush=True)


def plot(result: dict, out: Path, top: int = 10) -> bool:
    """Each profiled step's top kernels, a panel a step; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

    steps = result["steps"]
    fig, axes = plt.subplots(1, len(steps), figsize=(7 * len(steps), 4.8), squeeze=False)
    for ax, step in zip(axes[0], steps):
        rows = step["kernels"][:top][::-1]
        ax.barh([r["kernel"][:40] for r in rows], [r["us_per_step"] for r in rows])
        ax.set(xlabel="us per decode step",
               title=f"{step['policy']}, batch {step['batch']}: replay {step['replay_us']:.0f} us, "
                     f"{step['launches_per_layer']:.1f} launches/layer")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"one captured decode step, 48 layers, Qwen3-30B-A3B shape (dummy weights), {result['device']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def prompt_spec(text: str) -> tuple[int, int]:
    """"512" -> (512, 1); "5x38" -> (38, 5): (tokens per prompt, prompts)."""
    count, _, tokens = text.rpartition("x")
    return int(tokens), int(count or 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/decode_profile_h200")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--policies", default="topk",
                    help="routing of the profiled steps, each its own rows: topk, sere (bench_kernels' K'=2 rho 0)")
    ap.add_argument("--pdl", action="store_true",
                    help="profile the graphs with PDL, as the engine captures them: read the critical path")
    ap.add_argument("--mixed", type=int, default=0, help="also time a prefill step beside this many decoding sequences")
    ap.add_argument("--mixed-prompts", default="512",
                    help="that step's new prompt lengths, one row each; KxL: K prompts of L tokens together")
    args = ap.parse_args(argv)
    require_cuda(ap)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "copy_gbps": round(copy_gbps(), 1), "pdl": args.pdl, "steps": []}
    with dependent_launch.enabled_as(args.pdl):  # without: each kernel's own time (module docstring)
        engine = build_engine()
        for policy in args.policies.split(","):
            if engine.model.policy.name != policy:  # (each change re-captures the graphs)
                engine.set_routing_policy({"topk": RoutingPolicy, "sere": lambda: random_sere(engine.device)}[policy]())
            for batch in (int(b) for b in args.batches.split(",")):
                result["steps"].append({"policy": policy, **profile_step(engine, batch)})
                print_step(result["steps"][-1])
                out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        if engine.model.policy.name != "topk":
            engine.set_routing_policy(RoutingPolicy())
        if args.mixed:
            result["mixed"] = [profile_mixed(engine, args.mixed, *prompt_spec(p)) for p in args.mixed_prompts.split(",")]
            for row in result["mixed"]:
                print(f"\nmixed step: {row}", flush=True)
            out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    write_plot(result, out.with_suffix(".png"), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
