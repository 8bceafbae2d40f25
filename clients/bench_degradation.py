"""Load test of the load-adaptive keep ratio: Poisson arrivals at a fixed rate, a fixed keep ratio
against the adaptive one.

    python -m zipmoe.clients.bench_degradation --rate R [--duration S] [--mode fixed,adaptive]
        [--model mm_qa_bls] [--images N] [--pool P] [--priorities W0,W1,W2] [--ttft-target-ms T]
        [--checkpoint DIR] [--set MODEL.PARAMETER=VALUE ...] [--out PREFIX]
    python -m zipmoe.clients.bench_degradation --url HOST:GRPC --metrics-url HOST:METRICS --mode adaptive ...

Each mode runs on a fresh server on free loopback ports (default checkpoint: checkpoints/notes):
`fixed` sets moe_decoder's ttft_target_ms to 0 (every request at keep_ratio), `adaptive` to
--ttft-target-ms. With --url the one running server is measured as it is configured (--mode only
labels the run). Requests arrive as a Poisson process of --rate per second for --duration s (seeded).
Each asks one question about --images images drawn from a pool of --pool synthetic JPEGs of
--image-size (mm_qa_bls serves a pool image from its feature cache after its first use, so the
vision tower drops out and the decoder's prefill is the work the keep ratio shrinks), with a priority
drawn with the weights --priorities (of 0, 1, 2), stream=true and --max-tokens tokens (ignore_eos).
Before the arrivals, the pool's images go through the server once (unmeasured: the cache warm, the
models past their first calls). After the arrivals the run waits up to --drain-s for the requests
still open; any left then is "unanswered" (cancelled).

Per request: when it was sent, TTFT (sent to first response), its end, its outcome (answered, busy,
error, unanswered), priority, keep ratio used and visual tokens kept. Every --sample-s: the client's
requests in flight and the server's waiting and running requests, level and pressure. Summary per
mode: counts by outcome, TTFT p50/p90/p99 over all answered requests and p90 over the last third of
the arrivals, the most requests in flight and how many were in flight when the arrivals stopped,
the mean keep ratio per priority, answered requests per second. Writes PREFIX.json and PREFIX.png
(per mode: TTFT against send time with the target; requests in flight and the level over time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from zipmoe import repository_config, serve
from zipmoe.clients import bench_serving_report as report
from zipmoe.clients.bench_common import parse_size, pct, rounded, synthetic_jpeg
from zipmoe.clients.bench_serving import add_server_arguments
from zipmoe.clients.checkpoint_paths import display_path, resolve_checkpoint
from zipmoe.clients.triton_client import ServerBusy, ServerError, grpc_generate_async, scrape_metrics
from zipmoe.plotting import pyplot, write_plot

MODES = ("fixed", "adaptive")
QUESTION = "What do these notes say? Answer briefly."
GAUGES = {"waiting": "zipmoe_waiting_requests", "running": "zipmoe_running_requests",
          "level": "zipmoe_degradation_level", "pressure": "zipmoe_load_pressure"}


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Send times of a Poisson process of `rate` per second over [0, duration)."""
    rng, times, t = np.random.default_rng(seed), [], 0.0
    while (t := t + rng.exponential(1 / rate)) < duration:
        times.append(t)
    return times


async def one(client, model: str, inputs: dict, record: dict, t0: float) -> None:
    record["sent"], last = time.perf_counter() - t0, {}
    try:
        async for last in grpc_generate_async(client, model=model, **inputs):
            record.setdefault("ttft", time.perf_counter() - t0 - record["sent"])
        record.update(outcome="answered", keep=last.get("visual_keep_ratio_used"),
                      kept=sum(last.get("visual_tokens_kept") or []))
    except ServerBusy:
        record["outcome"] = "busy"
    except ServerError as e:
        record.update(outcome="error", error=str(e)[:200])
    except asyncio.CancelledError:  # still open when the drain ended
        record["outcome"] = "unanswered"
    record["end"] = time.perf_counter() - t0


async def sample(metrics_url: str | None, records: list[dict], samples: list[dict], t0: float, every: float):
    while True:
        gauges = {}
        if metrics_url:
            scraped = await asyncio.to_thread(scrape_metrics, metrics_url)
            gauges = {k: scraped.get(name) for k, name in GAUGES.items()}
        open_ = sum("end" not in r for r in records)
        samples.append({"t": time.perf_counter() - t0, "in_flight": open_, **gauges})
        await asyncio.sleep(every)


async def load(args, url: str, metrics_url: str | None) -> tuple[list[dict], list[dict]]:
    from tritonclient.grpc.aio import InferenceServerClient

    rng = np.random.default_rng(args.seed)
    pool = [synthetic_jpeg(3000 + i, parse_size(args.image_size)) for i in range(args.pool)]
    weights = np.asarray(args.priorities, float) / sum(args.priorities)
    client, records, samples, tasks = InferenceServerClient(url), [], [], []
    for start in range(0, len(pool), args.images):  # warm-up: every pool image through the tower once
        async for _ in grpc_generate_async(client, model=args.model, text_input=QUESTION, max_tokens=1, priority=0,
                                           images=pool[start:start + args.images]):
            pass
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample(metrics_url, records, samples, t0, args.sample_s))
    try:
        for at in arrivals(args.rate, args.duration, args.seed):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            priority = int(rng.choice(len(weights), p=weights))
            images = [pool[i] for i in rng.choice(len(pool), args.images, replace=False)]
            records.append(record := {"priority": priority})
            inputs = dict(text_input=QUESTION, images=images, max_tokens=args.max_tokens, ignore_eos=True,
                          stream=True, priority=priority)
            tasks.append(asyncio.create_task(one(client, args.model, inputs, record, t0)))
        await asyncio.wait(tasks, timeout=max(0.0, t0 + args.duration + args.drain_s - time.perf_counter()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks)
    finally:
        sampler.cancel()
        await client.close()
    return records, samples


def summary(records: list[dict], samples: list[dict], duration: float) -> dict:
    answered = [r for r in records if r["outcome"] == "answered"]
    ttft = [r["ttft"] * 1e3 for r in answered]
    late = [r["ttft"] * 1e3 for r in answered if r["sent"] >= duration * 2 / 3]
    during = [s for s in samples if s["t"] <= duration]
    keep = {p: [r["keep"] for r in answered if r["priority"] == p and r.get("keep") is not None] for p in (0, 1, 2)}
    return rounded({
        "sent": len(records), **{o: sum(r["outcome"] == o for r in records)
                                 for o in ("answered", "busy", "error", "unanswered")},
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90), "ttft_ms_p99": pct(ttft, 99),
        "ttft_ms_p90_last_third": pct(late, 90),
        "max_in_flight": max((s["in_flight"] for s in samples), default=0),
        "in_flight_at_end_of_arrivals": during[-1]["in_flight"] if during else 0,
        "mean_keep_by_priority": {p: float(np.mean(v)) if v else None for p, v in keep.items()},
        "answered_per_s": sum(r["end"] <= duration for r in answered) / duration,
        "first_error": next((r["error"] for r in records if r["outcome"] == "error"), None),
    })


def run_mode(args, mode: str, checkpoint: Path | None) -> dict:
    if args.url:
        records, samples = asyncio.run(load(args, args.url, args.metrics_url))
    else:
        overrides = repository_config.parse_overrides(args.set)
        target = "0" if mode == "fixed" else str(args.ttft_target_ms)
        overrides["moe_decoder"] = {**overrides.get("moe_decoder", {}), "ttft_target_ms": target}
        ports = serve.free_server_ports()
        print(f"{mode}: starting tritonserver on {checkpoint} (log: {args.log_file}) ...", flush=True)
        with serve.TritonServer(serve.DEFAULT_REPOSITORY, checkpoint=str(checkpoint), log_path=args.log_file,
                                extra_args=args.extra_arg, overrides=overrides, **ports) as server:
            server.wait_ready(timeout=args.ready_timeout)
            records, samples = asyncio.run(load(args, server.url_grpc, server.url_metrics))
    out = {"summary": summary(records, samples, args.duration), "requests": rounded(records),
           "samples": rounded(samples)}
    print(f"{mode}: {json.dumps(out['summary'])}", flush=True)
    return out


def plot(result: dict, path: Path) -> bool:
    """Per mode, left: TTFT of each answered request against its send time (colour: priority), the
    target dashed; right: requests in flight (client) and waiting (server), the level on its own axis."""
    plt = pyplot()
    if plt is None:
        return False

    modes = result["modes"]
    fig, axes = plt.subplots(len(modes), 2, figsize=(13, 4 * len(modes)), squeeze=False)
    for (mode, run), (left, right) in zip(modes.items(), axes):
        answered = [r for r in run["requests"] if r["outcome"] == "answered"]
        for p, colour in zip((0, 1, 2), ("tab:green", "tab:blue", "tab:red")):
            mine = [r for r in answered if r["priority"] == p]
            left.scatter([r["sent"] for r in mine], [r["ttft"] for r in mine], s=6, color=colour,
                         label=f"priority {p}")
        left.axhline(result["ttft_target_ms"] / 1e3, color="grey", ls="--", label="ttft_target_ms")
        left.set(xlabel="sent at, s", ylabel="TTFT, s", yscale="log")
        s = run["summary"]
        left.set_title(f"{mode}: {s['answered']}/{s['sent']} answered, TTFT p90 {s['ttft_ms_p90']} ms", fontsize=10)
        left.legend(fontsize=7)
        t = [x["t"] for x in run["samples"]]
        right.plot(t, [x["in_flight"] for x in run["samples"]], label="in flight (client)")
        right.plot(t, [x.get("waiting") or 0 for x in run["samples"]], label="waiting (moe_decoder)")
        right.set(xlabel="s", ylabel="requests")
        level = right.twinx()
        level.step(t, [x.get("level") or 0 for x in run["samples"]], color="tab:red", where="post", label="level")
        level.set(ylabel="degradation level", ylim=(-0.2, 5.5))
        right.legend(loc="upper left", fontsize=7)
        level.legend(loc="upper right", fontsize=7)
    fig.suptitle(f"{result['checkpoint']} via {result['model']}: {result['rate']} requests/s of {result['images']} "
                 f"images, {result['duration']} s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zipmoe.clients.bench_degradation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p)
    p.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    p.add_argument("--mode", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--model", default="mm_qa_bls", choices=("mm_qa", "mm_qa_bls"))
    p.add_argument("--image-size", default="512x512")
    p.add_argument("--priorities", default="1,2,1", help="weights of priorities 0, 1, 2 (default 1,2,1)")
    for flag, default in (("--images", 8), ("--pool", 16), ("--max-tokens", 8), ("--ttft-target-ms", 2000),
                          ("--seed", 0)):
        p.add_argument(flag, type=int, default=default, help=f"(default {default})")
    for flag, default in (("--duration", 60.0), ("--drain-s", 120.0), ("--sample-s", 0.5), ("--ready-timeout", 1800)):
        p.add_argument(flag, type=float, default=default, help=f"(default {default})")
    p.add_argument("--log-file", type=Path, default=Path(tempfile.gettempdir()) / "zipmoe-bench-degradation.log")
    p.add_argument("--out", type=Path, help="writes PREFIX.json and PREFIX.png")
    args = p.parse_args(argv)
    args.mode = [m.strip() for m in args.mode.split(",") if m.strip()]
    args.priorities = [float(w) for w in args.priorities.split(",")]
    if set(args.mode) - set(MODES) or len(args.priorities) != 3 or min(args.priorities) < 0 or not sum(args.priorities):
        p.error(f"--mode: a comma list of {', '.join(MODES)}; --priorities: three weights, not all 0")
    if args.images > args.pool or min(args.rate, args.duration, args.images) <= 0:
        p.error("--images must be positive and at most --pool; --rate and --duration positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    checkpoint = None if args.url else resolve_checkpoint(args.checkpoint)
    result = {"checkpoint": display_path(checkpoint) if checkpoint else args.checkpoint or args.url,
              "model": args.model, "rate": args.rate, "duration": args.duration, "images": args.images,
              "pool": args.pool, "image_size": args.image_size, "priorities": args.priorities,
              "max_tokens": args.max_tokens, "ttft_target_ms": args.ttft_target_ms,
              "overrides": repository_config.parse_overrides(args.set), "modes": {}}
    out = report.prefix(args.out) if args.out else None
    for mode in args.mode:
        result["modes"][mode] = run_mode(args, mode, checkpoint)
        if out is not None:  # after every mode: a run cut short keeps what it measured
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_name(out.name + ".json").write_text(json.dumps(result, indent=1) + "\n")
    if out is not None:
        print(f"wrote {out.with_name(out.name + '.json')}")
        write_plot(result, out.with_name(out.name + ".png"), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
