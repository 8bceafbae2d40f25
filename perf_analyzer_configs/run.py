"""Load tests with the real perf_analyzer over gRPC streaming: fixed concurrency and fixed request rate.

    python -m perf_analyzer_configs.run [--checkpoint DIR] [--load-format dummy] [--set MODEL.PARAMETER=VALUE ...]
        [--extra-arg=--TRITONSERVER-FLAG ...] [--url HOST:GRPC [--metrics-url HOST:METRICS]]
        [--model mm_qa,mm_qa_bls] [--workload business,text,...|FILE.json] [--inputs ci|full]
        (--concurrency 1,4 | --sweep | --rate R[,R...]) [--requests N] [--distribution poisson|constant]
        [--warmup N] [--routing LABEL] [--out PREFIX [--append]]

Starts one tritonserver on free loopback ports (default checkpoint: the tiny one) unless --url names a
running one. For each model x workload it warms the server up (--warmup requests at concurrency 1, not
measured), then runs perf_analyzer once per concurrency (`--concurrency-range C`) and once per rate
(`--request-rate-range R`, --distribution arrivals), each for exactly --requests requests
(`--request-count`; default 1000 at a rate, the seed's measurement, and max(32, 8 x C) at a
concurrency). Every run keeps perf_analyzer's profile export and log in --work-dir; the rows are
derived from the export (profile_export.py: TTFT, TPOT, ITL, out_tok_s; p50/p90/p99) and, from the
server's counters when its metrics endpoint is known, the experts read per MoE layer-step, the
preemptions and the share of engine steps that ran pipelined.

Workloads are make_inputs.py's: `--inputs ci` uses the small files committed in inputs/ (CPU, CI),
`--inputs full` generates the H200 files into .work/inputs/full/ when missing. A workload ending in
.json is used as it is. perf_analyzer's libraries are fetched first when missing (deps.py).

Writes PREFIX.json {device, checkpoint, overrides: {routing: its server's --set}, extra_args, perf_analyzer,
distribution, inputs, rows}
after every run (--append keeps the rows of an existing PREFIX.json, replacing those measured again),
then prints a table and writes PREFIX.png (report.py, which re-renders a saved JSON). A run whose
perf_analyzer fails (it stops at the first failed request) gives a row with n 0, errors = --requests,
and the log's last lines in `note`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from perf_analyzer_configs import deps, make_inputs, profile_export, report
from zipmoe import repository_config, serve
from zipmoe.clients.bench_common import device_info
from zipmoe.clients.bench_serving import add_server_arguments
from zipmoe.clients.checkpoint_paths import display_path, resolve_checkpoint
from zipmoe.clients.eval_quality import routing_effect
from zipmoe.clients.triton_client import counter_deltas, scrape_metrics
from zipmoe.settings import LOAD_FORMATS

MODELS = ("mm_qa", "mm_qa_bls")
SWEEP = (1, 4, 16, 64)
WORK = Path(__file__).resolve().parent / ".work" / "runs"
ROW_KEY = ("workload", "routing", "model", "mode", "value")  # --append replaces rows with the same key


@dataclass(frozen=True)
class Run:
    model: str
    workload: str
    input_file: Path
    mode: str  # "concurrency" | "rate"
    value: float
    requests: int

    @property
    def name(self) -> str:
        return f"{self.model}_{self.workload}_{self.mode}{self.value:g}"


def perf_analyzer_args(run: Run, url: str, export: Path | None, distribution: str) -> list[str]:
    """perf_analyzer's arguments for one run (the binary not included)."""
    args = ["-m", run.model, "-i", "grpc", "-u", url, "--streaming", "--input-data", str(run.input_file),
            "--request-count", str(run.requests)]
    if run.mode == "concurrency":
        args += ["--concurrency-range", str(int(run.value))]
    else:  # more sending threads than its default 4: a long-prefill burst must not delay the next send
        args += ["--request-rate-range", f"{run.value:g}", "--request-distribution", distribution, "--max-threads", "16"]
    return args + (["--profile-export-file", str(export)] if export is not None else [])


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


class Runner:
    """perf_analyzer against one server, one run at a time."""

    def __init__(self, url: str, metrics: str | None, args: argparse.Namespace, routing: str,
                 tool: tuple[Path, dict[str, str]]):
        self.url, self.metrics, self.args, self.routing = url, metrics, args, routing
        self.binary, self.env = tool  # deps.ensure()'s binary and environment
        self.work = args.work_dir
        self.work.mkdir(parents=True, exist_ok=True)

    def perf_analyzer(self, run: Run, export: Path | None, log: Path) -> int:
        """Runs it, its output to log; its exit status (124: past --timeout)."""
        cmd = [str(self.binary)] + perf_analyzer_args(run, self.url, export, self.args.distribution)
        with open(log, "w") as out:
            out.write(" ".join(cmd) + "\n\n")
            out.flush()
            try:
                return subprocess.run(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=self.args.timeout).returncode
            except subprocess.TimeoutExpired:
                return 124

    def warm_up(self, model: str, workload: str, input_file: Path) -> None:
        if self.args.warmup:
            run = Run(model, workload, input_file, "concurrency", 1, self.args.warmup)
            self.perf_analyzer(run, None, self.work / f"{self.routing}_{run.name}_warmup.log")

    def measure(self, run: Run) -> dict:
        name = f"{self.routing}_{run.name}"  # one work dir can hold every routing's runs
        export, log = self.work / f"{name}.json", self.work / f"{name}.log"
        export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite one
        before = scrape_metrics(self.metrics) if self.metrics else {}
        rc = self.perf_analyzer(run, export, log)
        after = scrape_metrics(self.metrics) if self.metrics else {}
        row = {"workload": run.workload, "routing": self.routing, "model": run.model, "mode": run.mode,
               "value": run.value, "requests": run.requests}
        exported = export.exists() and export.stat().st_size > 0  # seen once under load: exit 0, an empty file
        if rc != 0 or not exported:
            return {**row, **profile_export.summarise([], run.requests), "export": display_path(export),
                    "note": f"perf_analyzer exit {rc}{'' if exported else ', no export'}: {tail(log.read_text())}"}
        ((_, _, requests),) = profile_export.experiments(profile_export.load(export))
        effect = routing_effect(before, after) if after else {}
        counted = counter_deltas(before, after, ("zipmoe_preemptions_total", "zipmoe_engine_steps_total",
                                                 "zipmoe_engine_steps_pipelined_total"))
        steps = counted["zipmoe_engine_steps_total"]
        return {**row, **profile_export.summarise(requests, run.requests),
                "experts_read": None if effect.get("experts_read") is None else round(effect["experts_read"], 3),
                "preemptions": int(counted["zipmoe_preemptions_total"]) if after else None,
                # share of the engine's steps launched behind the one in flight (async scheduling)
                "steps_pipelined": round(counted["zipmoe_engine_steps_pipelined_total"] / steps, 3) if steps else None,
                "export": display_path(export)}


def workload_file(workload: str, inputs: str) -> tuple[str, Path]:
    """(label, input-data file) of a --workload item: a make_inputs workload or a JSON file."""
    if workload.endswith(".json"):
        return Path(workload).stem, Path(workload).resolve()
    if workload not in make_inputs.WORKLOADS:
        raise SystemExit(f"unknown workload {workload!r}: one of {', '.join(make_inputs.WORKLOADS)} or a .json file")
    return workload, make_inputs.ensure_input(workload, inputs, workers=os.cpu_count() or 1)


def plan(args: argparse.Namespace) -> list[Run]:
    runs = []
    for workload in args.workload:
        label, path = workload_file(workload, args.inputs)
        for model in args.model:
            runs += [Run(model, label, path, "concurrency", c, args.requests or max(32, 8 * c)) for c in args.concurrency]
            runs += [Run(model, label, path, "rate", r, args.requests or 1000) for r in args.rate]
    return runs


def execute(runner: Runner, runs: list[Run], result: dict, save) -> None:
    warmed = set()
    for run in runs:
        if (run.model, run.workload) not in warmed:
            runner.warm_up(run.model, run.workload, run.input_file)
            warmed.add((run.model, run.workload))
        print(f"{run.name}: {run.requests} requests ...", flush=True)
        row = runner.measure(run)
        key = tuple(row[k] for k in ROW_KEY)
        result["rows"] = [r for r in result["rows"] if tuple(r.get(k) for k in ROW_KEY) != key] + [row]
        save()


@contextlib.contextmanager
def server(args: argparse.Namespace, overrides: dict[str, dict[str, str]]):
    """(gRPC url, metrics url or None, checkpoint label): --url's server, or one started on free ports."""
    if args.url:
        yield args.url, args.metrics_url, args.checkpoint or f"unknown (server at {args.url})"
        return
    checkpoint = resolve_checkpoint(args.checkpoint or serve.TINY_CHECKPOINT)
    print(f"starting tritonserver on {checkpoint} (log: {args.log_file}) ...", flush=True)
    ports = serve.free_server_ports()
    with serve.TritonServer(serve.DEFAULT_REPOSITORY, checkpoint=str(checkpoint), log_path=args.log_file,
                            extra_args=args.extra_arg, overrides=overrides, **ports) as started:
        started.wait_ready(timeout=args.ready_timeout)
        yield started.url_grpc, started.url_metrics, display_path(checkpoint)


def numbers(text: str, kind=float) -> list:
    return [kind(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf_analyzer_configs.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p)
    p.add_argument("--load-format", choices=LOAD_FORMATS, help="both models' load_format (as zipmoe serve)")
    p.add_argument("--model", default="mm_qa", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--workload", default="business", help="comma list of workloads or input-data .json files")
    p.add_argument("--inputs", choices=sorted(make_inputs.PROFILES), default="ci",
                   help="which make_inputs profile the named workloads use (default ci)")
    p.add_argument("--concurrency", default="", help="comma list of concurrencies")
    p.add_argument("--sweep", action="store_true", help=f"the latency-throughput curve: --concurrency {SWEEP}")
    p.add_argument("--rate", default="", help="comma list of request rates (requests/s)")
    p.add_argument("--requests", type=int, help="requests per run (default: 1000 at a rate, max(32, 8 x C) at C)")
    p.add_argument("--distribution", choices=("poisson", "constant"), default="poisson",
                   help="arrivals at a fixed rate (default poisson)")
    p.add_argument("--warmup", type=int, default=4, help="requests before a model x workload's first run (0: none)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one perf_analyzer run may take")
    p.add_argument("--ready-timeout", type=float, default=1800)
    p.add_argument("--work-dir", type=Path, help="exports and logs (default: .work/runs/PREFIX-name)")
    p.add_argument("--log-file", type=Path, default=Path(tempfile.gettempdir()) / "zipmoe-perf-analyzer-server.log")
    p.add_argument("--out", type=Path, help="writes PREFIX.json and PREFIX.png")
    p.add_argument("--append", action="store_true", help="keep the rows of an existing PREFIX.json")
    args = p.parse_args(argv)
    args.model = [m.strip() for m in args.model.split(",") if m.strip()]
    args.workload = [w.strip() for w in args.workload.split(",") if w.strip()]
    args.concurrency = sorted(set(numbers(args.concurrency, int)) | (set(SWEEP) if args.sweep else set()))
    args.rate = numbers(args.rate)
    if set(args.model) - set(MODELS):
        p.error(f"unknown model in {args.model}; choose from {', '.join(MODELS)}")
    if not (args.concurrency or args.rate):
        p.error("nothing to run: give --concurrency, --sweep or --rate")
    if min(args.concurrency + args.rate) <= 0 or (args.requests is not None and args.requests < 1):
        p.error("concurrencies, rates and --requests must be positive")
    if args.append and not args.out:
        p.error("--append needs --out")
    name = report.prefix(args.out).name if args.out else "last"
    args.work_dir = (args.work_dir or WORK / name).resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = repository_config.load_format_overrides(args.load_format, repository_config.parse_overrides(args.set))
    routing = args.routing or overrides.get("moe_decoder", {}).get("routing_policy", "topk")
    runs = plan(args)  # input files first: a missing one fails before a server starts
    tool = deps.ensure()
    device, _ = device_info()
    out = report.prefix(args.out) if args.out else None
    saved = out.with_name(out.name + ".json") if out else None
    result = json.loads(saved.read_text()) if args.append and saved.exists() else {"rows": []}
    result.update(device=device, checkpoint=None, extra_args=args.extra_arg,
                  perf_analyzer=deps.version(*tool), distribution=args.distribution, inputs=args.inputs)
    result.setdefault("overrides", {})[routing] = overrides  # one server per routing: each its own settings

    def save() -> None:  # after every run: a run cut short keeps what it measured
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(result, indent=1) + "\n")

    with server(args, overrides) as (url, metrics, checkpoint):
        result["checkpoint"] = checkpoint
        execute(Runner(url, metrics, args, routing, tool), runs, result, save)
    save()
    report.show(result, out)
    if saved is not None:
        print(f"wrote {saved} (exports and logs: {display_path(args.work_dir)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
