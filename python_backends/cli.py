"""`zipmoe` command line: serve, ask, demo, calibrate, eval."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from . import serve, serve_command

REPO = Path(__file__).resolve().parents[1]
DEMO_EXAMPLE = ("test", 35)  # notes_data split and index of the demo's question
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
    p.add_argument("--priority", type=int, default=None,
                   help="0: the keep ratio is never lowered under load; 1 (the server's default), 2: lowered, 2 first")


def _inputs(args, images: list[bytes] = ()) -> dict:
    inputs = {"text_input": args.question}
    inputs.update({k: getattr(args, k) for k in SAMPLING + ("visual_keep_ratio", "priority")
                   if getattr(args, k) is not None})
    if args.stop:
        inputs["stop_words"] = args.stop
    images = list(images) + [Path(p).read_bytes() for p in args.image]
    if images:
        inputs["images"] = images
    return inputs


def stream_answer(url: str, inputs: dict, protocol: str = "grpc", out=sys.stdout) -> dict:
    """Prints the answer as it streams; returns the last response's counts, the whole text ("text")
    and client-side TTFT / TPOT."""
    from zipmoe.clients.triton_client import grpc_generate, http_generate_stream

    gen = grpc_generate if protocol == "grpc" else http_generate_stream
    start = time.perf_counter()
    first = last = None
    final: dict = {}
    text = ""
    for r in gen(url, stream=True, **inputs):
        last = time.perf_counter()
        first = first or last
        delta = r.get("text_output", "")
        out.write(delta)
        out.flush()
        text += delta
        final = r
    out.write("\n")
    n = final.get("output_token_count") or 0
    final["text"] = text
    final["client_ttft_ms"] = (first - start) * 1e3 if first else None
    final["client_tpot_ms"] = (last - first) * 1e3 / (n - 1) if first and n > 1 else None
    return final


def cmd_ask(args) -> int:
    from tritonclient.utils import InferenceServerException

    from zipmoe.clients.triton_client import ServerError

    try:
        r = stream_answer(args.url, _inputs(args), "http" if args.http else "grpc")
    # the server's answer; a value out of its input's range; an image that cannot be read; no server
    # (tritonclient's own exception when the gRPC stream broke before the request went out)
    except (ServerError, ValueError, OSError, InferenceServerException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"[{r.get('input_token_count')} prompt tokens, {r.get('output_token_count')} generated, "
          f"finish: {r.get('finish_reason')}, visual tokens kept per image: {r.get('visual_tokens_kept')} "
          f"(keep ratio {r.get('visual_keep_ratio_used', 0):.2f}), TTFT {r['client_ttft_ms']:.1f} ms]", file=sys.stderr)
    return 0


def demo_example():
    """The demo's question: five notes (a triangle, a circle, a receipt, a solid colour, a table of
    digits), asking for the receipt's total (58); a test-split example, never seen in training."""
    from zipmoe.build import notes_data

    return notes_data.make_example(notes_data.split_seed(*DEMO_EXAMPLE))


def cmd_demo(args) -> int:
    from zipmoe.build import notes_data
    from zipmoe.clients.eval_quality import exact_match
    from zipmoe.clients.triton_client import counter_deltas, scrape_metrics

    checkpoint = Path(args.checkpoint) if args.checkpoint else serve.TRAINED_CHECKPOINT
    if args.image and args.question is None:
        print("error: ask your own question about your own images", file=sys.stderr)
        return 2
    example = demo_example()
    own = args.question is not None  # no reference answer for the user's own question
    args.question = args.question or example.question
    images = [] if args.image else [notes_data.png_bytes(im) for im in example.images]
    shown = (f"{len(args.image)} image(s) of yours" if args.image else
             f"{len(images)} notes: " + ", ".join(example.kinds))
    ports = serve.free_ports(3)
    log = Path(tempfile.gettempdir()) / "zipmoe-demo-server.log"
    print(f"starting tritonserver on {checkpoint} (log: {log}) ...", flush=True)
    with serve.TritonServer(serve.DEFAULT_REPOSITORY, *ports, checkpoint=str(checkpoint), log_path=log) as server:
        models = server.wait_ready()
        print(f"ready: {', '.join(models)}\n\nQ ({shown}): {args.question}\nA: ", end="", flush=True)
        before = scrape_metrics(server.url_metrics)
        r = stream_answer(server.url_grpc, _inputs(args, images))
        after = scrape_metrics(server.url_metrics)
    d = counter_deltas(before, after)
    tokens = d.get("zipmoe_decode_tokens_total", 0)
    ttft = d.get("zipmoe_ttft_microseconds_total", 0) / 1e3
    tpot = d.get("zipmoe_decode_microseconds_total", 0) / 1e3 / tokens if tokens else float("nan")
    print(f"\n{r['input_token_count']} prompt tokens, {r['output_token_count']} generated "
          f"(finish: {r['finish_reason']}); visual tokens kept per image: {r['visual_tokens_kept']}")
    print(f"server: TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms   client: TTFT {r['client_ttft_ms']:.1f} ms")
    if own:
        return 0
    right = exact_match(r["text"], example.answer)
    print(f"expected: {example.answer} -> {'right' if right else 'WRONG'}")
    return 0 if right else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # its own parser: `zipmoe calibrate --help`
        from zipmoe.build.sere_calibrate import main as calibrate

        return calibrate(argv[1:])
    parser = argparse.ArgumentParser(prog="zipmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the model repository (the trained checkpoints/notes unless --checkpoint) "
                                    "with tritonserver; --openai-port adds the OpenAI-compatible API")
    serve_command.add_arguments(p)
    p.set_defaults(func=serve_command.run)

    p = sub.add_parser("ask", help="ask a running server a question, streaming the answer")
    p.add_argument("question")
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC, :8000 with --http)")
    p.add_argument("--http", action="store_true", help="HTTP generate_stream instead of gRPC")
    _add_sampling(p)
    _add_images(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="start a server on the trained checkpoint, ask about five notes, print "
                                    "TTFT/TPOT and whether the answer is right, stop")
    p.add_argument("question", nargs="?", default=None,
                   help="your own question (default: the demo's, about its notes, checked against its answer); "
                        "needed with --image")
    p.add_argument("--checkpoint", default=None,
                   help=f"HF directory (default: {serve.TRAINED_CHECKPOINT.relative_to(REPO)})")
    _add_sampling(p)
    _add_images(p)
    p.set_defaults(func=cmd_demo)

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
