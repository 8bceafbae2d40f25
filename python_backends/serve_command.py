"""`zipmoe serve`: tritonserver on the model repository (`serve.TritonServer`) and, with
`--openai-port`, the OpenAI-compatible frontend beside it (`openai_frontend`), until a signal.

With no flags it serves `checkpoints/notes`, the trained checkpoint (the configs' `checkpoint_path`).
SIGINT/SIGTERM drain the server (`drain.py`: the requests in flight finish, new ones are refused),
then stop it; a second signal kills it at once. Then the frontend stops. While it runs,
`supervisor.supervise` restarts it when a model's stub process dies (server 2.51 does not recover).
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from .repository_config import load_format_overrides, parse_overrides
from .serve import DEFAULT_REPOSITORY, TritonServer
from .settings import LOAD_FORMATS
from .supervisor import supervise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--openai-port", type=int, default=None,
                        help="also serve the OpenAI-compatible API (/v1/chat/completions, /v1/models) on this port")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--checkpoint", help="checkpoint directory for every model's checkpoint_path parameter "
                                             "(default: the configs' checkpoints/notes, the trained model)")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                        help="dummy: random weights of the checkpoint's config.json shapes, made on the device "
                             "(e.g. --checkpoint checkpoints/qwen3-vl-30b-a3b, a config-only directory)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument("--log-file", type=Path, help="server log (default: this terminal)")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.PARAMETER=VALUE",
                        help="override a config.pbtxt parameter, e.g. moe_decoder.routing_policy=sere, or a "
                             "model's instance_group, e.g. 'moe_decoder.instance_group=[{kind: KIND_GPU gpus: [0, 1]}]' "
                             "(repeatable)")


def run(args: argparse.Namespace) -> int:
    try:
        overrides = load_format_overrides(args.load_format, parse_overrides(args.set))
    except ValueError as e:
        print(f"zipmoe: {e}", file=sys.stderr)
        return 2
    server = TritonServer(
        args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, checkpoint=args.checkpoint, log_path=args.log_file, host=args.host,
        overrides=overrides,
    )
    signalled = []

    def forward(signum, _frame):
        # Loading: the server stops. Serving: the first signal drains it (supervise -> stop). A second
        # signal, in either case, kills it at once.
        signalled.append(signum)
        if len(signalled) > 1:
            server.stop_now()
        elif not server.ready:
            server.send_signal(signum)
        else:
            print("zipmoe: draining: requests in flight finish, new ones are refused (again to kill now)", flush=True)

    try:
        server.check_ports()
    except RuntimeError as e:
        print(f"zipmoe: {e}", file=sys.stderr)
        return 1
    with server:
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        frontend = None
        try:
            try:
                models = server.wait_ready()
                if args.openai_port is not None:
                    from .openai_frontend.server import OpenAIFrontend

                    frontend = OpenAIFrontend(server.url_grpc, args.host, args.openai_port)
                    frontend.start()
            except (RuntimeError, TimeoutError) as e:
                if signalled:  # we were asked to stop while loading
                    return server.stop()
                print(f"zipmoe: {e}", file=sys.stderr)
                return 1
            h = server.host
            openai = f"openai {h}:{args.openai_port}  " if frontend is not None else ""
            print(
                f"zipmoe: ready — http {h}:{server.http_port}  grpc {h}:{server.grpc_port}  "
                f"metrics {h}:{server.metrics_port}  {openai}models: {', '.join(models)}",
                flush=True,
            )
            return supervise(server, lambda: bool(signalled), log=lambda line: print(line, flush=True))
        finally:
            if frontend is not None:
                frontend.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
