"""Soak: many streamed requests at high concurrency, then checks that nothing was lost, changed or leaked.

    python -m zipmoe.clients.soak [--checkpoint DIR] [--set MODEL.PARAMETER=VALUE ...] [--extra-arg=--FLAG]
        [--requests 1000] [--concurrency 32] [--max-images 30] [--cancel-fraction 0.2] [--seed 0] [--out PREFIX]
    python -m zipmoe.clients.soak --url HOST:GRPC --http-url HOST:HTTP --metrics-url HOST:METRICS
        [--server-pid PID] ...

Starts one tritonserver on free loopback ports (default checkpoint: the tiny one, built when needed)
unless --url names a running one (then --server-pid, on this machine, lets it measure memory).

1. Requests. A seeded, deterministic set: 0..--max-images images each, drawn (repeats allowed) from a
   pool of --image-pool distinct small images; varied questions (some non-ASCII); max_tokens in
   [--min-tokens, --max-tokens]; ignore_eos or not; visual_keep_ratio unset, 1.0, 0.6 or 0.4; mm_qa or
   mm_qa_bls; every one stream=true, greedy. A seeded --cancel-fraction of them is cancelled by the
   client after k responses (k < max_tokens): it stops reading and closes the stream, which cancels the
   gRPC stream. --warmup requests of another seed go first, unchecked.
2. Loaded run: the requests with --concurrency in flight (threads, one gRPC stream each).
3. Drain: until moe_decoder runs and queues nothing (server 2.51 does not pass a cancel of mm_qa on to
   the decoder, so those requests decode to max_tokens after their client left).
4. Reference run: every request again, alone, not streamed, on the idle server: its unloaded greedy answer.
5. Checks (each named in the summary, with its failures):
   streams_well_formed   every completed stream's responses count 1, 2, ..., n tokens (output_token_count),
                         with finish_reason only on the last, and the same input_token_count throughout;
                         a cancelled one counts 1..k and never finishes (no response lost or duplicated)
   no_errors             no request failed (nor was refused busy)
   answers_equal_reference
                         the joined deltas of every completed stream equal its reference text exactly,
                         with the same token count, finish_reason, prompt length and visual tokens kept
   cancelled_prefix      a cancelled stream's text is a prefix of its reference answer
   kv_blocks_returned    zipmoe_kv_blocks_free == zipmoe_kv_blocks_total once idle
   server_ready          /v2/health/ready answers 200 at the end
   host_rss_flat         the server's process group (tritonserver and its Python stubs): RSS after the
                         loaded run and at the end within max(--rss-bound-mb, --rss-bound-frac) of after warm-up
   gpu_memory_flat       the same for nvidia-smi's used GPU memory of those processes (when it is there)
   Where an answer differs from its reference, the request is run again alone, streamed, to find the
   first token where the two streams part and whether the loaded one is the reference with a response
   dropped or repeated (`loss_pattern`); and an answer whose visual_tokens_kept differ (another keep
   ratio was applied) is told apart. `--allow-divergent N` lets N answers differ (numerics that are not
   batch-invariant: see `answers_equal_reference` in the summary) without failing the run.

Writes PREFIX.json (the summary) and prints it; exit code 0 when every check holds. The requests and
how they are sent: `soak_requests.py`; the checks of each request: `soak_checks.py`; what is asked of the server between runs: `server_probe.py`.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from zipmoe import repository_config, serve
from zipmoe.clients.server_probe import (MemorySampler, memory_snapshot, models_not_ready, ready, wait_blocks_back,
                                         wait_idle)
from zipmoe.clients.bench_common import device_info
from zipmoe.clients.soak_checks import compare, diagnose, first_difference, growth_ok, stream_problems
from zipmoe.clients.soak_requests import (KEEP_USED, MODELS, Outcome, SoakRequest, make_requests, pool_image,
                                          reference_inputs, run_loaded, run_whole)
from zipmoe.clients.triton_client import counter_deltas, scrape_metrics

# ---------------------------------------------------------------------------------------------- soak

@dataclass
class SoakConfig:
    requests: int = 1000
    concurrency: int = 32
    max_images: int = 30
    image_pool: int = 48
    image_size: tuple[int, int] | None = None  # None: small notes
    min_tokens: int = 8
    max_tokens: int = 64
    cancel_fraction: float = 0.2
    seed: int = 0
    warmup: int = 32
    models: tuple[str, ...] = MODELS
    timeout: float = 600.0  # per response
    rss_bound_mb: float = 200.0
    rss_bound_frac: float = 0.2
    gpu_bound_mb: float = 512.0
    allow_divergent: int = 0
    diagnose_max: int = 50  # differing answers run again alone, streamed
    memory_period: float = 2.0  # seconds between memory samples during the loaded run


def soak(grpc_url: str, http_url: str, metrics_url: str, config: SoakConfig, server_pid: int | None = None,
         log=print) -> dict:
    """The whole soak against a running server; returns the summary (its "ok" is every check)."""
    c = config
    pool = [pool_image(i, c.image_size) for i in range(c.image_pool)]
    requests = make_requests(c.requests, c.seed, c.max_images, c.image_pool, c.min_tokens, c.max_tokens,
                             c.cancel_fraction, c.models)
    warmup = make_requests(c.warmup, c.seed + 1_000_003, c.max_images, c.image_pool, c.min_tokens, c.max_tokens,
                           0.0, c.models)
    timings, memory = {}, {}
    summary: dict = {"config": {**asdict(c), "models": list(c.models)}, "timings_s": timings, "memory": memory}

    log(f"warm-up: {len(warmup)} requests at concurrency {c.concurrency}")
    t = time.perf_counter()
    run_loaded(grpc_url, warmup, pool, c.concurrency, c.timeout)
    wait_idle(metrics_url)
    timings["warmup"] = time.perf_counter() - t
    memory["after_warmup"] = memory_snapshot(server_pid)
    before = scrape_metrics(metrics_url)

    log(f"loaded run: {len(requests)} streamed requests at concurrency {c.concurrency}, "
        f"{sum(r.cancel_after is not None for r in requests)} to be cancelled")
    t = time.perf_counter()
    with MemorySampler(server_pid, c.memory_period) as sampler:
        outcomes = run_loaded(grpc_url, requests, pool, c.concurrency, c.timeout, progress=log)
    timings["loaded"] = time.perf_counter() - t
    memory["timeline_during_loaded_run"] = {"columns": ["s", "rss_mb", "gpu_mb"], "samples": sampler.samples}
    t = time.perf_counter()
    idle = wait_idle(metrics_url)
    timings["drain"] = time.perf_counter() - t
    end_loaded = wait_blocks_back(metrics_url)
    memory["after_loaded"] = memory_snapshot(server_pid)
    after = scrape_metrics(metrics_url)

    log(f"reference run: {len(requests)} requests alone, not streamed")
    t = time.perf_counter()
    references = [run_whole(grpc_url, r, pool, c.timeout, **reference_inputs(r, o)) for r, o in zip(requests, outcomes)]
    timings["reference"] = time.perf_counter() - t

    checks: dict[str, dict] = {}
    completed = [(r, o) for r, o in zip(requests, outcomes) if o.finished]
    cancelled = [(r, o) for r, o in zip(requests, outcomes) if o.cancelled and not o.error]
    errors = [{"index": r.index, "model": r.model, "error": o.error}
              for r, o in zip(requests, outcomes) if o.error]
    ref_errors = [{"index": r.index, "model": r.model, "error": ref.error}
                  for r, ref in zip(requests, references) if ref.error]
    summary["requests"] = {
        "total": len(requests), "completed": len(completed), "cancelled": len(cancelled),
        "cancel_planned_but_finished_first": sum(r.cancel_after is not None and o.finished for r, o in completed),
        "errors": len(errors), "busy": sum(o.busy for o in outcomes),
        "by_model": {m: sum(r.model == m for r in requests) for m in c.models},
        "images": {"total": sum(len(r.images) for r in requests), "max": max((len(r.images) for r in requests), default=0)},
        "tokens_streamed": sum(len(o.responses) for o in outcomes),
        "keep_ratio_used": _keep_used(requests, outcomes),
        "seconds_p50_p99": [round(float(np.percentile([o.seconds for o in outcomes], q)), 3) for q in (50, 99)]
        if outcomes else None,
    }

    shape = [{"index": r.index, "model": r.model, "problems": p}
             for r, o in zip(requests, outcomes) if not o.error and (p := stream_problems(r, o))]
    checks["streams_well_formed"] = {"ok": not shape, "failures": shape[:20], "failed": len(shape)}
    checks["no_errors"] = {"ok": not errors and not ref_errors, "loaded": errors[:20], "reference": ref_errors[:20]}

    differing = []
    for r, o in completed:
        ref = references[r.index]
        if ref.error or not ref.responses:
            continue
        if (d := compare(r, o, ref)) is not None:
            differing.append(d)
    for d in differing[:c.diagnose_max]:
        r = requests[d["index"]]
        info = diagnose(grpc_url, r, pool, outcomes[r.index], c.timeout)
        if "alone_text" in info:
            info["alone_streamed_joins_to_reference"] = info.pop("alone_text") == references[r.index].responses[-1].get("text_output")
        d.update(info)
    adapted = [d for d in differing if d["keep_applied_differs"]]
    numeric = [d for d in differing if not d["keep_applied_differs"]]
    losses = [d for d in differing if d.get("loss_pattern")]
    checks["answers_equal_reference"] = {
        "ok": len(numeric) <= c.allow_divergent and not losses and not adapted,
        "compared": len(completed), "equal": len(completed) - len(differing),
        "differ_same_prompt": len(numeric), "differ_other_keep_applied": len(adapted),
        "allowed_to_differ": c.allow_divergent, "loss_patterns": len(losses), "differing": differing[:50]}

    bad_prefix = []
    for r, o in cancelled:
        ref = references[r.index]
        if ref.error or not ref.responses:
            continue
        ref_text = ref.responses[-1].get("text_output") or ""
        if not ref_text.startswith(o.text) or len(o.responses) > (ref.responses[-1].get("output_token_count") or 0):
            bad_prefix.append({"index": r.index, "model": r.model, "tokens": len(o.responses),
                               "first_char_differing": first_difference(o.text, ref_text),
                               "partial": o.text[:60], "reference": ref_text[:60]})
    checks["cancelled_prefix"] = {"ok": len(bad_prefix) <= c.allow_divergent,
                                  "compared": len(cancelled), "not_prefix": len(bad_prefix), "failures": bad_prefix[:20]}

    final = wait_blocks_back(metrics_url)
    checks["kv_blocks_returned"] = {
        "ok": final.get("zipmoe_kv_blocks_free") == final.get("zipmoe_kv_blocks_total")
        and end_loaded.get("zipmoe_kv_blocks_free") == end_loaded.get("zipmoe_kv_blocks_total"),
        "after_loaded_run": [end_loaded.get("zipmoe_kv_blocks_free"), end_loaded.get("zipmoe_kv_blocks_total")],
        "at_end": [final.get("zipmoe_kv_blocks_free"), final.get("zipmoe_kv_blocks_total")],
        "running_waiting_when_idle": [idle.get("zipmoe_running_requests"), idle.get("zipmoe_waiting_requests")]}
    not_ready = models_not_ready(http_url)
    checks["server_ready"] = {"ok": ready(http_url) and not not_ready, "models_not_ready": not_ready}

    memory["at_end"] = memory_snapshot(server_pid)
    if memory["after_warmup"] is not None:
        start = memory["after_warmup"]["rss_mb"]
        ends = [memory["after_loaded"]["rss_mb"], memory["at_end"]["rss_mb"]]
        checks["host_rss_flat"] = {
            "ok": all(growth_ok(start, e, c.rss_bound_mb, c.rss_bound_frac) for e in ends),
            "after_warmup_mb": start, "after_loaded_mb": ends[0], "at_end_mb": ends[1],
            "growth_mb": round(ends[1] - start, 1), "bound_mb": max(c.rss_bound_mb, c.rss_bound_frac * start),
            "max_during_loaded_mb": max((x[1] for x in sampler.samples), default=None),
            "per_process_growth_mb": _per_process_growth(memory["after_warmup"], memory["at_end"], "rss_mb")}
        if memory["after_warmup"].get("gpu_mb") is not None:
            g0, g1 = memory["after_warmup"]["gpu_mb"], memory["at_end"].get("gpu_mb") or 0.0
            checks["gpu_memory_flat"] = {"ok": g1 - g0 <= c.gpu_bound_mb, "after_warmup_mb": g0,
                                         "of": memory["at_end"].get("gpu_mb_of"),
                                         "max_during_loaded_mb": max((x[2] or 0 for x in sampler.samples), default=None),
                                         "after_loaded_mb": memory["after_loaded"].get("gpu_mb"), "at_end_mb": g1,
                                         "bound_mb": c.gpu_bound_mb,
                                         "per_process_growth_mb": _per_process_growth(memory["after_warmup"],
                                                                                      memory["at_end"], "gpu_mb")}
    else:
        checks["host_rss_flat"] = {"ok": True, "skipped": "no server pid (--server-pid) on this machine"}

    summary["metrics_delta"] = {k.removeprefix("zipmoe_"): v for k, v in counter_deltas(before, after, (
        "zipmoe_requests_completed_total", "zipmoe_requests_cancelled_total", "zipmoe_requests_rejected_busy_total",
        "zipmoe_preemptions_total", "zipmoe_prompt_tokens_total", "zipmoe_decode_tokens_total",
        "zipmoe_bls_cache_hits_total", "zipmoe_bls_cache_misses_total")).items()}
    summary["metrics_delta"]["cancelled_mm_qa_bls"] = sum(r.model == "mm_qa_bls" for r, _ in cancelled)
    summary["metrics_delta"]["cancelled_mm_qa"] = sum(r.model == "mm_qa" for r, _ in cancelled)
    summary["checks"] = checks
    summary["ok"] = all(v["ok"] for v in checks.values())
    summary["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    return summary


def _keep_used(requests: list[SoakRequest], outcomes: list[Outcome]) -> dict | None:
    """Of the requests with images: how many the load lowered below the keep ratio they asked for, and
    the keep ratios used (a server with the load-adaptive keep ratio answers it)."""
    used = [(r, o.responses[-1].get(KEEP_USED)) for r, o in zip(requests, outcomes) if r.images and o.responses]
    if not any(u is not None for _, u in used):
        return None
    values: dict[str, int] = {}
    for _, u in used:
        values[f"{u:.3f}"] = values.get(f"{u:.3f}", 0) + 1
    return {"lowered": sum(r.keep is not None and u is not None and u < r.keep - 1e-6 for r, u in used),
            "values": dict(sorted(values.items()))}


def _per_process_growth(a: dict, b: dict, key: str) -> dict[str, float]:
    return {name: round(b["per_process"][name].get(key, 0.0) - v.get(key, 0.0), 1)
            for name, v in a["per_process"].items() if name in b["per_process"]}


def brief(summary: dict) -> str:
    """A few lines: each check and its main figures."""
    lines = [f"requests: {json.dumps(summary['requests'])}", f"timings (s): {json.dumps(summary['timings_s'])}"]
    for name, check in summary["checks"].items():
        figures = {k: v for k, v in check.items() if k != "ok" and not isinstance(v, (list, dict))}
        lines.append(f"{'ok  ' if check['ok'] else 'FAIL'} {name}: {json.dumps(figures)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zipmoe.clients.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="checkpoint directory (default: checkpoints/tiny, built)")
    p.add_argument("--set", action="append", default=[], metavar="MODEL.PARAMETER=VALUE",
                   help="a config.pbtxt parameter of the server started (repeatable)")
    p.add_argument("--load-format", choices=("auto", "dummy"), help="vision_encoder's and moe_decoder's load_format")
    p.add_argument("--extra-arg", action="append", default=[], help="a tritonserver flag (write it with =)")
    p.add_argument("--url", help="gRPC HOST:PORT of a running server (default: start one); needs --http-url "
                                 "and --metrics-url")
    p.add_argument("--http-url")
    p.add_argument("--metrics-url")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid on this machine (memory checks)")
    p.add_argument("--ready-timeout", type=float, default=1800)
    p.add_argument("--log-file", type=Path, default=Path(tempfile.gettempdir()) / "zipmoe-soak-server.log")
    d = SoakConfig()
    for flag, default, kind in (("--requests", d.requests, int), ("--concurrency", d.concurrency, int),
                                ("--max-images", d.max_images, int), ("--image-pool", d.image_pool, int),
                                ("--min-tokens", d.min_tokens, int), ("--max-tokens", d.max_tokens, int),
                                ("--cancel-fraction", d.cancel_fraction, float), ("--seed", d.seed, int),
                                ("--warmup", d.warmup, int), ("--timeout", d.timeout, float),
                                ("--rss-bound-mb", d.rss_bound_mb, float), ("--rss-bound-frac", d.rss_bound_frac, float),
                                ("--gpu-bound-mb", d.gpu_bound_mb, float),
                                ("--allow-divergent", d.allow_divergent, int), ("--diagnose-max", d.diagnose_max, int),
                                ("--memory-period", d.memory_period, float)):
        p.add_argument(flag, type=kind, default=default, help=f"(default {default})")
    p.add_argument("--image-size", help="WxH detailed JPEGs instead of the small notes")
    p.add_argument("--models", default=",".join(MODELS), help="comma list (default: both)")
    p.add_argument("--out", type=Path, help="writes PREFIX.json")
    args = p.parse_args(argv)
    if args.url and not (args.http_url and args.metrics_url):
        p.error("--url needs --http-url and --metrics-url")
    if not 2 <= args.min_tokens <= args.max_tokens:
        p.error("need 2 <= --min-tokens <= --max-tokens (a cancelled request stops after 1..max_tokens-1)")
    return args


def config_from(args) -> SoakConfig:
    from zipmoe.clients.bench_common import parse_size

    return SoakConfig(requests=args.requests, concurrency=args.concurrency, max_images=args.max_images,
                      image_pool=args.image_pool, image_size=parse_size(args.image_size) if args.image_size else None,
                      min_tokens=args.min_tokens, max_tokens=args.max_tokens, cancel_fraction=args.cancel_fraction,
                      seed=args.seed, warmup=args.warmup, models=tuple(m.strip() for m in args.models.split(",")),
                      timeout=args.timeout, rss_bound_mb=args.rss_bound_mb, rss_bound_frac=args.rss_bound_frac,
                      gpu_bound_mb=args.gpu_bound_mb, allow_divergent=args.allow_divergent,
                      diagnose_max=args.diagnose_max, memory_period=args.memory_period)


def main(argv=None) -> int:
    from zipmoe.clients.checkpoint_paths import display_path, resolve_checkpoint

    args = parse_args(argv)
    config = config_from(args)
    overrides = repository_config.load_format_overrides(args.load_format, repository_config.parse_overrides(args.set))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    started = time.time()
    if args.url:
        summary = soak(args.url, args.http_url, args.metrics_url, config, args.server_pid, log)
        summary["server"] = {"url": args.url, "checkpoint": args.checkpoint}
    else:
        checkpoint = resolve_checkpoint(args.checkpoint or serve.TINY_CHECKPOINT)
        ports = serve.free_server_ports()
        log(f"starting tritonserver on {checkpoint} (log: {args.log_file}) ...")
        with serve.TritonServer(serve.DEFAULT_REPOSITORY, checkpoint=str(checkpoint), log_path=args.log_file,
                                extra_args=args.extra_arg, overrides=overrides, **ports) as server:
            t = time.perf_counter()
            server.wait_ready(timeout=args.ready_timeout)
            load_s = time.perf_counter() - t
            summary = soak(server.url_grpc, server.url_http, server.url_metrics, config, server.process.pid, log)
            summary["timings_s"]["server_load"] = round(load_s, 1)
        summary["server"] = {"checkpoint": display_path(checkpoint), "overrides": overrides,
                             "extra_args": args.extra_arg, "log": str(args.log_file)}
    summary["started"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started))
    summary["device"] = device_info()[0]
    log(brief(summary))
    if args.out:
        path = args.out if args.out.suffix == ".json" else args.out.with_name(args.out.name + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
        log(f"wrote {path}")
    log("soak " + ("passed" if summary["ok"] else "FAILED: " + ", ".join(k for k, v in summary["checks"].items() if not v["ok"])))
    return 0 if summary["ok"] else 1



if __name__ == "__main__":
    raise SystemExit(main())
