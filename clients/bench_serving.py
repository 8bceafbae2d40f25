"""Serving benchmark: the real server, measured from the client over gRPC streaming into mm_qa.

    python -m zipmoe.clients.bench_serving [--checkpoint DIR] [--set MODEL.PARAMETER=VALUE ...]
        [--extra-arg=--TRITONSERVER-FLAG ...] [--bench ttft_30img,image_decode,tpot_c1,mixed,mixed_text] [--out PREFIX]
    python -m zipmoe.clients.bench_serving --url HOST:GRPC [--http-url HOST:HTTP] [--metrics-url HOST:METRICS] ...

Starts one tritonserver on free loopback ports (default checkpoint: the tiny one) unless --url names a
running one (whose server-side figures need --http-url and --metrics-url). Write --extra-arg with `=`.
copy_gbps: with CUDA, an eager copy_ of 1 GiB (kernels/benchmarks/timing), in a child process before
the server starts. Rows: bench, keep_ratio, routing, concurrency, images, n, ttft_ms_p50/p90,
tpot_ms_p50/p90, itl_ms_p99, tokens_per_s, images_per_s (null where meaningless), extra keys.

ttft_30img    One request at a time, idle server: --images JPEGs of --image-size (repeatable) and a
              question, stream=true, --ttft-tokens tokens; per keep ratio --warmup, then --n requests.
              TTFT: sending to the first streamed response (opening the gRPC stream included; also min).
              --channel persistent (default): every request opens its stream on one gRPC channel, as
              perf_analyzer does; per-request: a new channel each, inside the timed span (the old way).
              breakdown_ms per request: Triton's compute_infer of preprocess, image_decode,
              vision_encoder (of which vision_forward and visionzip, when it exports those counters),
              postprocess; decoder_ttft is moe_decoder's arrival-to-first-token (queue + prefill).
              TTFT beyond their sum is ensemble hand-offs, Python-backend IPC and gRPC. With --trace,
              timeline_ms: the medians of Triton's trace spans per request (clients/trace_timeline:
              each step's wait, input, execute, output and the hand-offs between steps).
image_decode  --decode-images JPEGs of --decode-size straight to image_decode (gRPC infer, only
              image_sizes asked for: the model then builds no pixel_values output, so the figure leaves
              out handing the pixels on, which mm_qa does on the GPU). images_per_s: images / the
              server's compute_infer per request;
              client_images_per_s adds IPC and gRPC. phases_ms: the model's own counters per request
              (input, check, pipeline, output) and `response`, the compute time beyond them; with
              --trace, timeline_ms as for ttft_30img (the model's wait, input, execute, output).
tpot_c1       One text request at a time, --tpot-tokens tokens, ignore_eos: tpot = (last - first
              response) / (tokens - 1), a batch-1 decode step plus the per-token serving path;
              server_tpot_ms is moe_decoder's own. The TPOT target compares against the engine-only
              step of `python -m zipmoe.kernels.benchmarks.bench_kernels` (decode rows); the gap is serving.
mixed         --streams text streams decoding back to back (--stream-tokens, ignore_eos) while a request
              of --images images (first --image-size, keep --mixed-keep) arrives every --period s for
              --duration s. ITL: gaps between a stream's consecutive responses (p50, p99, percentiles
              0..100 in itl_ms_quantiles): how far image prefills stall decoding; long_gaps: when the
              gaps over 2.5x the median start after an image request is sent (clients/bench_mixed.py).
              ttft: the image requests' under load; tokens_per_s: the streams' tokens in the window. Streams running
              at the end are read to their end, not cancelled (an mm_qa cancel leaves the decoder going).
mixed_text    The same, but what arrives is a text-only prompt as long, in decoder tokens, as the image
              request's (padded from the measured input_token_count): the decoder's prefill without the
              vision tower's work on the GPU at the same time, so the two causes of stalls separate.

Timestamps are taken in this Python process: on a busy client host its threads add jitter to ITL.
Writes PREFIX.json {device, copy_gbps, checkpoint, overrides, extra_args, rows} after every bench, then
prints a table and writes PREFIX.png (matplotlib) with bench_serving_report, which re-renders a saved JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from zipmoe import repository_config, serve
from zipmoe.clients import bench_serving_report as report
from zipmoe.clients.bench_common import (QUESTION, STORY, device_info, parse_size, pct, row, synthetic_jpeg,
                                         timed_stream)
from zipmoe.clients.bench_mixed import bench_mixed
from zipmoe.clients.checkpoint_paths import display_path, resolve_checkpoint
from zipmoe.clients.eval_quality import routing_effect
from zipmoe.clients.server_breakdown import STAGES, breakdown, decode_phases, diff, model_stats, settled
from zipmoe.clients.trace_timeline import median_segments, read, requests, server_args
from zipmoe.clients.triton_client import ServerError, scrape_metrics
from zipmoe.plotting import write_plot

BENCHES = ("ttft_30img", "image_decode", "tpot_c1", "mixed", "mixed_text")


class Bench:
    """The server's endpoints and the run's settings."""

    def __init__(self, url: str, http: str | None, metrics: str | None, args: argparse.Namespace, routing: str):
        self.url, self.http, self.metrics, self.args, self.routing = url, http, metrics, args, routing

    def stats(self, model: str) -> dict[str, list[int]] | None:
        return model_stats(self.http, model) if self.http else None

    def scrape(self) -> dict[str, float]:
        return scrape_metrics(self.metrics) if self.metrics else {}

    def snapshot(self) -> dict:
        return settled(lambda: {"stats": {m: self.stats(m) for m in STAGES}, "metrics": self.scrape()})

    def timeline(self, since_ns: int, until_ns: int, n: int, model: str = "mm_qa") -> dict | None:
        """Median trace spans of the n requests to `model` that arrived in the window (--trace), None without;
        Triton writes a trace file once a request's last step has finished, so wait a little for them."""
        if self.args.trace is None:
            return None
        deadline = time.monotonic() + 5
        while len(reqs := requests(read(self.args.trace), model, since_ns, until_ns)) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        return median_segments(reqs) if reqs else None


@contextlib.contextmanager
def channel(b: Bench):
    """The gRPC client the sequential benches send every request on (--channel persistent), or None."""
    if b.args.channel != "persistent":
        yield None
        return
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(b.url)
    try:
        yield client
    finally:
        client.close()


def bench_ttft(b: Bench, size: tuple[int, int]) -> list[dict]:
    a, label = b.args, f"{size[0]}x{size[1]}"
    images = [synthetic_jpeg(i, size) for i in range(a.images)]
    rows = []
    with channel(b) as client:
        for keep in a.keep:
            request = dict(text_input=QUESTION, images=images, max_tokens=a.ttft_tokens, ignore_eos=True,
                           visual_keep_ratio=keep, priority=0, client=client)  # priority 0: never degraded
            try:
                for _ in range(a.warmup):
                    timed_stream(b.url, **request)
                before, ttfts, since = b.snapshot(), [], time.monotonic_ns()
                for _ in range(a.n):
                    start, times, last = timed_stream(b.url, **request)
                    ttfts.append((times[0] - start) * 1e3)
                until, after = time.monotonic_ns(), b.snapshot()
            except ServerError as e:  # e.g. more tokens than max_model_len: the other keep ratios still run
                rows.append(row("ttft_30img", keep, b.routing, images=a.images, image_size=label, note=f"failed: {e}"))
                continue
            compute, queue = breakdown(before, after, a.n)
            kept = sum(last.get("visual_tokens_kept") or [])
            rows.append(row("ttft_30img", keep, b.routing, images=a.images, n=a.n, ttft=ttfts, image_size=label,
                            ttft_ms_min=min(ttfts), visual_tokens=kept, breakdown_ms=compute, queue_ms=queue,
                            channel=a.channel, timeline_ms=b.timeline(since, until, a.n),
                            jpeg_kb=sum(map(len, images)) / len(images) / 1024,
                            note=f"{a.images} images of {label}: {kept} visual tokens after VisionZip"))
    return rows


def bench_image_decode(b: Bench) -> list[dict]:
    import tritonclient.grpc as grpcclient

    a = b.args
    images = np.array([synthetic_jpeg(1000 + i, parse_size(a.decode_size)) for i in range(a.decode_images)],
                      dtype=np.object_)
    tensor = grpcclient.InferInput("images", [len(images)], "BYTES")
    tensor.set_data_from_numpy(images)
    outputs = [grpcclient.InferRequestedOutput("image_sizes")]
    client = grpcclient.InferenceServerClient(b.url)
    try:
        for _ in range(a.warmup):
            client.infer("image_decode", [tensor], outputs=outputs)
        snapshot = lambda: (b.stats("image_decode"), b.scrape())  # noqa: E731
        (before, mb), start, since = settled(snapshot), time.perf_counter(), time.monotonic_ns()
        for _ in range(a.n):
            result = client.infer("image_decode", [tensor], outputs=outputs)
        wall, until, (after, ma) = time.perf_counter() - start, time.monotonic_ns(), settled(snapshot)
    finally:
        client.close()
    compute_ms = None
    if before and after:
        calls = after["compute_infer"][0] - before["compute_infer"][0]
        compute_ms = (after["compute_infer"][1] - before["compute_infer"][1]) / max(calls, 1) / 1e6
    h, w = result.as_numpy("image_sizes")[0].tolist()
    return [row("image_decode", images=len(images), n=a.n, images_per_s=len(images) * 1e3 / compute_ms
                if compute_ms else None, image_size=a.decode_size, resized=f"{w}x{h}",
                compute_ms_per_request=compute_ms, client_images_per_s=len(images) * a.n / wall,
                phases_ms=decode_phases(mb, ma, compute_ms), timeline_ms=b.timeline(since, until, a.n, "image_decode"))]


def bench_tpot(b: Bench) -> list[dict]:
    a = b.args
    with channel(b) as client:
        request = dict(text_input=STORY, max_tokens=a.tpot_tokens, ignore_eos=True, client=client)
        for _ in range(a.warmup):
            timed_stream(b.url, **request)
        before, ttfts, tpots, gaps = settled(b.scrape), [], [], []
        for _ in range(a.n):
            start, times, last = timed_stream(b.url, **request)
            tokens = last["output_token_count"]
            ttfts.append((times[0] - start) * 1e3)
            tpots.append((times[-1] - times[0]) * 1e3 / max(tokens - 1, 1))
            gaps.extend(np.diff(times) * 1e3)
    after = settled(b.scrape)
    steps, us = (diff(before, after, f"zipmoe_decode_{k}_total") for k in ("tokens", "microseconds"))
    return [row("tpot_c1", None, b.routing, n=a.n, ttft=ttfts, tpot=tpots, itl=gaps,
                tokens_per_s=1e3 / pct(tpots, 50), tokens=tokens, itl_ms_p50=pct(gaps, 50),
                server_tpot_ms=us / steps / 1e3 if steps else None, channel=a.channel,
                experts_read=routing_effect(before, after)["experts_read"] if after else None)]


def run_benches(b: Bench, result: dict, save) -> None:
    for name in b.args.bench:
        print(f"{name} ...", flush=True)
        try:
            if name == "ttft_30img":
                rows = [r for size in b.args.image_size for r in bench_ttft(b, parse_size(size))]
            else:
                rows = {"image_decode": bench_image_decode, "tpot_c1": bench_tpot, "mixed": bench_mixed,
                        "mixed_text": lambda b: bench_mixed(b, text_only=True)}[name](b)
        except Exception as e:  # noqa: BLE001 -- one bench failing leaves the others' rows
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            rows = [row(name, note=f"failed: {type(e).__name__}: {e}")]
        result["rows"] += rows
        save()


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The server a benchmark measures: one it starts (--checkpoint, --set, --extra-arg) or a running
    one (--url, --metrics-url); and the routing label its rows carry. Shared with perf_analyzer_configs."""
    p.add_argument("--checkpoint", help="checkpoint directory (default: checkpoints/tiny, built); with --url a label")
    p.add_argument("--set", action="append", default=[], metavar="MODEL.PARAMETER=VALUE",
                   help="a config.pbtxt parameter of the server started (repeatable); with --url only recorded")
    p.add_argument("--extra-arg", action="append", default=[], help="a tritonserver flag (write it with =)")
    p.add_argument("--url", help="gRPC HOST:PORT of a running server (default: start one)")
    p.add_argument("--metrics-url", help="with --url: its metrics HOST:PORT")
    p.add_argument("--routing", help="the rows' routing label (default: --set moe_decoder.routing_policy, or topk)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zipmoe.clients.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p)
    p.add_argument("--http-url", help="with --url: its HTTP HOST:PORT (Triton's statistics)")
    p.add_argument("--bench", default=",".join(BENCHES), help=f"comma list of {', '.join(BENCHES)}")
    p.add_argument("--image-size", action="append", help="WxH, repeatable (default 512x512)")
    p.add_argument("--keep", default="1.0,0.6,0.4", help="ttft_30img's keep ratios (comma list)")
    p.add_argument("--decode-size", default="1024x768")
    for flag, default in (("--images", 30), ("--n", 10), ("--warmup", 2), ("--ttft-tokens", 1),
                          ("--decode-images", 64), ("--tpot-tokens", 256), ("--streams", 16), ("--stream-tokens", 512)):
        p.add_argument(flag, type=int, default=default, help=f"(default {default})")
    for flag, default in (("--period", 2.0), ("--duration", 30.0), ("--mixed-keep", 0.6), ("--ready-timeout", 1800)):
        p.add_argument(flag, type=float, default=default, help=f"(default {default})")
    p.add_argument("--channel", choices=("persistent", "per-request"), default="persistent",
                   help="ttft_30img and tpot_c1: one gRPC channel for all requests, or one per request; "
                        "mixed: one per arrival process, opened before the window, or one per arrival")
    p.add_argument("--trace", type=Path, metavar="PREFIX",
                   help="Triton's trace files: the server started traces every request into PREFIX.N (with --url, "
                        "start it with trace_timeline.server_args(PREFIX)); ttft_30img and image_decode rows gain timeline_ms")
    p.add_argument("--log-file", type=Path, default=Path(tempfile.gettempdir()) / "zipmoe-bench-serving-server.log")
    p.add_argument("--out", type=Path, help="writes PREFIX.json and PREFIX.png")
    args = p.parse_args(argv)
    args.keep = [float(k) for k in args.keep.split(",")]
    args.image_size = args.image_size or ["512x512"]
    args.bench = [name.strip() for name in args.bench.split(",") if name.strip()]
    if set(args.bench) - set(BENCHES):
        p.error(f"unknown bench in {args.bench}; choose from {', '.join(BENCHES)}")
    if min(args.images, args.n, args.ttft_tokens, args.decode_images, args.tpot_tokens, args.streams,
           args.stream_tokens) < 1 or min(args.period, args.duration) <= 0:
        p.error("counts must be at least 1, --period and --duration positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = repository_config.parse_overrides(args.set)
    routing = args.routing or overrides.get("moe_decoder", {}).get("routing_policy", "topk")
    device, gbps = device_info()
    print(f"device {device}" + (f": copy_ {gbps:.0f} GB/s (read + write)" if gbps else ""), flush=True)
    result = {"device": device, "copy_gbps": gbps, "checkpoint": None, "overrides": overrides,
              "extra_args": args.extra_arg, "rows": []}
    out = report.prefix(args.out) if args.out else None

    def save() -> None:  # after every bench: a run cut short keeps what it measured
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_name(out.name + ".json").write_text(json.dumps(result, indent=1) + "\n")

    if args.url:
        result["checkpoint"] = args.checkpoint or f"unknown (server at {args.url})"
        run_benches(Bench(args.url, args.http_url, args.metrics_url, args, routing), result, save)
    else:
        checkpoint = resolve_checkpoint(args.checkpoint or serve.TINY_CHECKPOINT)
        result["checkpoint"] = display_path(checkpoint)
        ports = serve.free_server_ports()
        print(f"starting tritonserver on {checkpoint} (log: {args.log_file}) ...", flush=True)
        extra_args = list(args.extra_arg)
        if args.trace is not None:  # a fresh trace: files of an earlier run would mix in
            args.trace.parent.mkdir(parents=True, exist_ok=True)
            for old in args.trace.parent.glob(args.trace.name + ".*"):
                old.unlink()
            extra_args += server_args(args.trace)
        with serve.TritonServer(serve.DEFAULT_REPOSITORY, checkpoint=str(checkpoint), log_path=args.log_file,
                                extra_args=extra_args, overrides=overrides, **ports) as server:
            server.wait_ready(timeout=args.ready_timeout)
            run_benches(Bench(server.url_grpc, server.url_http, server.url_metrics, args, routing), result, save)
    print(report.table(result))
    save()
    if out is not None:
        print(f"wrote {out.with_name(out.name + '.json')}")
        write_plot(result, out.with_name(out.name + ".png"), report.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
