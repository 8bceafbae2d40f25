"""The README's "Using it" commands, run in order on free ports, as a new user would after
`make install`: `zipmoe serve` (the trained checkpoints/notes, no --checkpoint), the notes, `zipmoe ask`
over gRPC and HTTP, Triton's HTTP generate and the OpenAI API with curl; each answer must be right."""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe import cli, serve
from zipmoe.clients.eval_quality import exact_match

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)


def using_it() -> list[str]:
    """The first bash block under "## Using it", without end-of-line comments."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Using it\n"):]
    block = section[section.index("```bash\n") + 8:section.index("\n```", section.index("```bash\n"))]
    return [re.sub(r"\s+#\s.*$", "", line) for line in block.splitlines() if line.strip()]


def on_ports(command: str, ports: dict, log: Path) -> str:
    """The command against the test's server: its ports instead of the defaults, this venv's bin/, and
    the server's log in a file."""
    command = command.replace(".venv/bin/", VENV_BIN + "/")
    command = command.replace("localhost:8000", f"127.0.0.1:{ports['http']}")
    command = command.replace("localhost:9000", f"127.0.0.1:{ports['openai']}")
    if " serve " in command:
        command = command.replace("--openai-port 9000", f"--openai-port {ports['openai']}")
        command += (f" --http-port {ports['http']} --grpc-port {ports['grpc']} --metrics-port {ports['metrics']}"
                    f" --log-file {log}")
    elif " ask " in command:
        url = ports["http"] if " --http " in command else ports["grpc"]
        command = command.replace(" ask ", f" ask --url 127.0.0.1:{url} ", 1)
    return command


def test_the_using_it_commands_work_in_order(tmp_path):
    commands = using_it()
    assert commands[0] == "make install" and commands[-1] == "kill -INT %1"  # the test runs in what `make install` made
    example = cli.demo_example()
    ports = dict(zip(("http", "grpc", "metrics", "openai"), serve.free_ports(4)))
    serve_line = commands[1]
    assert serve_line.endswith(" &") and "--checkpoint" not in serve_line
    log = tmp_path / "server.log"
    server = subprocess.Popen(shlex.split(on_ports(serve_line[:-2], ports, log)), cwd=tmp_path,
                              stdout=subprocess.PIPE, text=True)
    try:
        ready = server.stdout.readline()
        assert ready.startswith("zipmoe: ready") and f"openai 127.0.0.1:{ports['openai']}" in ready, \
            ready + (log.read_text()[-3000:] if log.exists() else "")
        answers = []
        for command in commands[2:-1]:
            done = subprocess.run(["bash", "-c", on_ports(command, ports, log)], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            answers.append(done.stdout)
        assert answers[0].startswith("wrote 1 examples") and (tmp_path / "notes" / f"{example.seed}_3.png").is_file()
        asked = answers[1:4]
        generate, chat = json.loads(answers[4]), json.loads(answers[5])
        for text in [a.strip() for a in asked] + [generate["text_output"], chat["choices"][0]["message"]["content"]]:
            assert exact_match(text, example.answer), (text, example.answer)
    finally:
        server.send_signal(signal.SIGINT)  # the README's `kill -INT %1`
        code = server.wait(timeout=60)
    assert code == 0
