"""`zipmoe` command line: serve, ask, demo, calibrate, eval."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from . import serve

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny"
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "random_seed")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_images(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", action="append", default=[], help="image file (repeatable, in order)")
    p.add_argument("--keep-ratio", type=float, default=None, dest="visual_keep_ratio",
                   help="visual tokens kept, in (0, 1] (default: the server's keep_ratio)")


def _inputs(args, images: list[bytes] = ()) -> dict:
    inputs = {"text_input": args.question}
    inputs.update({k: getattr(args, k) for k in SAMPLING + ("visual_keep_ratio",) if getattr(args, k) is not None})
    if args.stop:
        inputs["stop_words"] = args.stop
    images = list(images) + [Path(p).read_bytes() for p in args.image]
    if images:
        inputs["images"] = images
    return inputs


def stream_answer(url: str, inputs: dict, protocol: str = "grpc", out=sys.stdout) -> dict:
    """Prints the answer as it streams; returns counts and client-side TTFT / TPOT."""
    from zipmoe.clients.triton_client import grpc_generate, http_generate_stream

    if protocol == "http" and inputs.get("images"):
        raise SystemExit("images need gRPC (Triton's HTTP generate endpoint takes text only)")
    gen = grpc_generate if protocol == "grpc" else http_generate_stream
    start = time.perf_counter()
    first = last = None
    final: dict = {}
    for r in gen(url, stream=True, **inputs):
        last = time.perf_counter()
        first = first or last
        out.write(r.get("text_output", ""))
        out.flush()
        final = r
    out.write("\n")
    n = final.get("output_token_count") or 0
    final["client_ttft_ms"] = (first - start) * 1e3 if first else None
    final["client_tpot_ms"] = (last - first) * 1e3 / (n - 1) if first and n > 1 else None
    return final


def scrape_metrics(url: str) -> dict[str, float]:
    """zipmoe_* counters from the metrics endpoint, summed over labels."""
    totals: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("zipmoe_"):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                totals[name] = totals.get(name, 0.0) + value
    return totals


def cmd_ask(args) -> int:
    from zipmoe.clients.triton_client import ServerError

    try:
        r = stream_answer(args.url, _inputs(args), "http" if args.http else "grpc")
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"[{r.get('input_token_count')} prompt tokens, {r.get('output_token_count')} generated, "
          f"finish: {r.get('finish_reason')}, visual tokens kept per image: {r.get('visual_tokens_kept')}, "
          f"TTFT {r['client_ttft_ms']:.1f} ms]", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from zipmoe.build.demo_images import plain_png, receipt_png
    from zipmoe.build.tiny_checkpoint import build_tiny_checkpoint

    checkpoint = Path(args.checkpoint) if args.checkpoint else build_tiny_checkpoint(TINY)
    ports = [serve.free_port() for _ in range(3)]
    log = Path(tempfile.gettempdir()) / "zipmoe-demo-server.log"
    print(f"starting tritonserver (log: {log}) ...", flush=True)
    with serve.TritonServer(serve.DEFAULT_REPOSITORY, *ports, checkpoint=str(checkpoint), log_path=log) as server:
        models = server.wait_ready()
        print(f"ready: {', '.join(models)}\n\nQ (a receipt + a plain picture): {args.question}\nA: ", end="",
              flush=True)
        before = scrape_metrics(server.url_metrics)
        r = stream_answer(server.url_grpc, _inputs(args, [receipt_png(), plain_png()]))
        after = scrape_metrics(server.url_metrics)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    tokens = d.get("zipmoe_decode_tokens_total", 0)
    ttft = d.get("zipmoe_ttft_microseconds_total", 0) / 1e3
    tpot = d.get("zipmoe_decode_microseconds_total", 0) / 1e3 / tokens if tokens else float("nan")
    print(f"\n{r['input_token_count']} prompt tokens, {r['output_token_count']} generated "
          f"(finish: {r['finish_reason']}); visual tokens kept per image: {r['visual_tokens_kept']}")
    print(f"server: TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms   client: TTFT {r['client_ttft_ms']:.1f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # its own parser: `zipmoe calibrate --help`
        from zipmoe.build.sere_calibrate import main as calibrate

        return calibrate(argv[1:])
    parser = argparse.ArgumentParser(prog="zipmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start tritonserver on the model repository")
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)

    p = sub.add_parser("ask", help="ask a running server a question, streaming the answer")
    p.add_argument("question")
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC, :8000 with --http)")
    p.add_argument("--http", action="store_true", help="HTTP generate_stream instead of gRPC")
    _add_sampling(p)
    _add_images(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="build the tiny checkpoint, start a server, ask, print TTFT/TPOT, stop")
    p.add_argument("question", nargs="?", default="Which note mentions the cheapest coffee, and what does it cost?")
    p.add_argument("--checkpoint", default=None, help="HF directory (default: build the tiny one)")
    _add_sampling(p)
    _add_images(p)
    p.set_defaults(func=cmd_demo, max_tokens=48)

    sub.add_parser("calibrate", help="SERE calibration: write sere.safetensors beside a checkpoint (--help)")

    from zipmoe.clients import eval_quality

    p = sub.add_parser("eval", help="exact-match accuracy per keep ratio and decode routing (starts servers)")
    eval_quality.add_arguments(p)
    p.set_defaults(func=eval_quality.run)

    args = parser.parse_args(argv)
    if args.command == "ask" and args.url is None:
        args.url = "127.0.0.1:8000" if args.http else "127.0.0.1:8001"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
