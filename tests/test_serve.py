"""zipmoe.serve: repository rendering, server environment, and a real tritonserver on
a throwaway repository (echo, a decoupled streamer, an ensemble over echo)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

from zipmoe import repository_config, serve
from zipmoe.serving.shared_level import segment_path

ECHO_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
'''

STREAM_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for i in range(3):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def _config(name: str, body: str) -> str:
    return f'name: "{name}"\n' + textwrap.dedent(body)


ECHO_IO = """
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def make_repository(root: Path) -> Path:
    repo = root / "repo"
    for name, model in (("echo", ECHO_MODEL), ("stream", STREAM_MODEL)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(model)
    (repo / "echo" / "config.pbtxt").write_text(
        _config("echo", 'backend: "python"' + ECHO_IO + "instance_group [ { kind: KIND_CPU count: 1 } ]\n")
    )
    (repo / "stream" / "config.pbtxt").write_text(
        _config("stream", """
            backend: "python"
            max_batch_size: 0
            model_transaction_policy { decoupled: true }
            input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
            output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
            instance_group [ { kind: KIND_CPU count: 1 } ]
        """)
    )
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(
        _config("pipe", 'platform: "ensemble"' + ECHO_IO + """
            ensemble_scheduling { step [ {
              model_name: "echo" model_version: -1
              input_map { key: "IN" value: "IN" }
              output_map { key: "OUT" value: "OUT" }
            } ] }
        """)
    )
    return repo


# ---------------------------------------------------------------- unit tests

CONFIG_WITH_PARAMS = """name: "m"
backend: "python"
parameters { key: "checkpoint_path" value: { string_value: "/old/ckpt" } }
parameters: {
  key: "checkpoint_path"
  value: {
    string_value: "relative/ckpt"
  }
}
parameters { key: "other_path" value: { string_value: "/keep/me" } }
parameters: { key: "max_tokens" value: { string_value: "64" } }
"""


def test_render_repository_rewrites_checkpoint_only(tmp_path):
    src = tmp_path / "src"
    (src / "m" / "1").mkdir(parents=True)
    (src / "m" / "1" / "model.py").write_text("# model\n")
    (src / "m" / "config.pbtxt").write_text(CONFIG_WITH_PARAMS)
    (src / "ens" / "1").mkdir(parents=True)  # empty version folder of an ensemble
    (src / "ens" / "config.pbtxt").write_text('name: "ens"\nplatform: "ensemble"\n')
    ckpt = tmp_path / "my ckpt"

    out = repository_config.render_repository(src, tmp_path / "dst", str(ckpt))

    text = (out / "m" / "config.pbtxt").read_text()
    assert text == (
        CONFIG_WITH_PARAMS.replace('"/old/ckpt"', f'"{ckpt}"').replace('"relative/ckpt"', f'"{ckpt}"')
    )
    assert (out / "m" / "1" / "model.py").read_text() == "# model\n"
    assert (out / "ens" / "1").is_dir() and not any((out / "ens" / "1").iterdir())
    assert (out / "ens" / "config.pbtxt").read_text() == 'name: "ens"\nplatform: "ensemble"\n'
    assert (src / "m" / "config.pbtxt").read_text() == CONFIG_WITH_PARAMS  # source untouched


def test_render_repository_without_checkpoint_anchors_relative_paths(tmp_path):
    src = tmp_path / "src"
    (src / "m" / "1").mkdir(parents=True)
    (src / "m" / "config.pbtxt").write_text(CONFIG_WITH_PARAMS)
    out = repository_config.render_repository(src, tmp_path / "dst", None)
    text = (out / "m" / "config.pbtxt").read_text()
    assert '"/old/ckpt"' in text  # absolute paths stay
    assert f'"{tmp_path / "relative/ckpt"}"' in text  # relative ones mean what they meant beside src
    assert '"/keep/me"' in text


def test_server_env_for_bundled_server(monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/existing/lib")
    server = serve._bundled_server()
    env = serve.server_env(server)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[0] == sysconfig.get_config_var("LIBDIR")
    assert Path(libs[1]).name == "nvidia_pytriton.libs" and Path(libs[1]).is_dir()
    assert libs[-1] == "/existing/lib"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_cuda_pool_is_set_on_every_gpu_unless_the_caller_set_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gib = serve.CUDA_POOL_BYTES
    assert serve.cuda_pool_args([]) == [f"--cuda-memory-pool-byte-size=0:{gib}", f"--cuda-memory-pool-byte-size=1:{gib}"]
    assert serve.cuda_pool_args(["--cuda-memory-pool-byte-size=0:1024"]) == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert serve.cuda_pool_args(["--log-verbose=1"]) == []


def test_free_ports_are_distinct():
    """Asked for together, no two ports coincide (asked one at a time, a server was once handed the
    same port for HTTP and gRPC, and refused to start)."""
    for _ in range(20):
        ports = serve.free_ports(3)
        assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)
    assert set(serve.free_server_ports()) == {"http_port", "grpc_port", "metrics_port"}


def test_prepare_backend_dir(tmp_path):
    server = serve._bundled_server()
    backends = serve.prepare_backend_dir(server, tmp_path)
    names = {p.name for p in (backends / "python").iterdir()}
    assert names == {"libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"}
    assert all(p.exists() for p in (backends / "python").iterdir())
    # An NGC-style server (backends/ but no python_backend_stubs/) uses its own default.
    (tmp_path / "ngc" / "bin").mkdir(parents=True)
    (tmp_path / "ngc" / "backends").mkdir()
    assert serve.prepare_backend_dir(tmp_path / "ngc" / "bin" / "tritonserver", tmp_path / "w") is None


# ---------------------------------------------------------------- integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    with serve.TritonServer(make_repository(root), log_path=root / "server.log", **serve.free_server_ports()) as s:
        s.models = s.wait_ready(timeout=120)
        yield s


@pytest.mark.integration
def test_all_models_ready(server):
    assert server.models == ["echo", "pipe", "stream"]


@pytest.mark.integration
@pytest.mark.parametrize("model", ["echo", "pipe"])
def test_string_round_trip_over_http(server, model):
    import tritonclient.http as httpclient

    data = np.array(["你好 🙂".encode(), b"\x00bytes\xff"], dtype=np.object_)
    inp = httpclient.InferInput("IN", [2], "BYTES")
    inp.set_data_from_numpy(data)
    with httpclient.InferenceServerClient(server.url_http) as client:
        out = client.infer(model, [inp]).as_numpy("OUT")
    assert out.tolist() == data.tolist()


@pytest.mark.integration
def test_decoupled_stream_over_grpc(server):
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    inp = grpcclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([0], np.int32))
    client = grpcclient.InferenceServerClient(server.url_grpc)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("stream", [inp], enable_empty_final_response=True)
        got = [results.get(timeout=30) for _ in range(4)]
        client.stop_stream()
    finally:
        client.close()
    assert [e for _, e in got] == [None] * 4
    final = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert final == [False, False, False, True]
    assert [r.as_numpy("OUT").tolist() for r, _ in got[:3]] == [[0], [1], [2]]


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.integration
def test_stop_leaves_no_process(tmp_path):
    s = serve.TritonServer(make_repository(tmp_path), log_path=tmp_path / "server.log", **serve.free_server_ports())
    with s:
        s.wait_ready(timeout=120)
        pid = s.process.pid
        workdir = s._workdir
        assert s.stop() == 0
        assert _group_gone(pid)  # server and its Python stub processes
    assert not workdir.exists()


@pytest.mark.integration
def test_a_killed_server_leaves_no_shared_memory(tmp_path):
    """The Python stubs' regions in /dev/shm carry the server's own prefix; a server killed (no clean
    exit of its stubs) leaves them behind, and kill() removes them."""
    s = serve.TritonServer(make_repository(tmp_path), log_path=tmp_path / "server.log", **serve.free_server_ports())
    with s:
        s.wait_ready(timeout=120)
        regions = list(Path("/dev/shm").glob(f"{s._shm_prefix}*"))
        level = segment_path(s._repository / "any_model")  # as a zipmoe model of this server makes it
        level.write_bytes(b"\0" * 8)
        assert regions
        s.kill()
        assert not [r for r in regions if r.exists()] and not level.exists()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        s = serve.TritonServer(make_repository(tmp_path), **{**serve.free_server_ports(), "http_port": port})
        with pytest.raises(RuntimeError, match=f"port\\(s\\) {port} on 127.0.0.1 in use"):
            s.start()
        assert s.process is None


@pytest.mark.integration
def test_run_stops_cleanly_on_sigint(tmp_path):
    ports = serve.free_server_ports()
    code = (
        "import argparse, sys; from zipmoe.serve_command import add_arguments, run; "
        "p = argparse.ArgumentParser(); add_arguments(p); sys.exit(run(p.parse_args(sys.argv[1:])))"
    )
    args = [
        "--model-repository", str(make_repository(tmp_path)), "--log-file", str(tmp_path / "server.log"),
        "--http-port", str(ports["http_port"]), "--grpc-port", str(ports["grpc_port"]),
        "--metrics-port", str(ports["metrics_port"]),
    ]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("zipmoe: ready — http 127.0.0.1:"), line
        assert line.rstrip().endswith("models: echo, pipe, stream")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_render_repository_sets_parameters(tmp_path):
    src = tmp_path / "src"
    (src / "m" / "1").mkdir(parents=True)
    (src / "m" / "config.pbtxt").write_text(CONFIG_WITH_PARAMS)
    out = repository_config.render_repository(src, tmp_path / "dst", None,
                                  repository_config.parse_overrides(["m.max_tokens=8", 'm.other_path=/new "x"']))
    text = (out / "m" / "config.pbtxt").read_text()
    assert 'string_value: "8"' in text and r'"/new \"x\""' in text
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        repository_config.render_repository(src, tmp_path / "d2", None, {"m": {"nope": "1"}})
    with pytest.raises(ValueError, match="no model named ghost"):
        repository_config.render_repository(src, tmp_path / "d3", None, {"ghost": {"x": "1"}})
    with pytest.raises(ValueError, match="MODEL.PARAMETER=VALUE"):
        repository_config.parse_overrides(["max_tokens=8"])


def _instance_groups(config_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    kinds = model_config_pb2.ModelInstanceGroup.Kind
    return [(g.count, kinds.Name(g.kind), list(g.gpus)) for g in config.instance_group], config


def test_render_repository_sets_instance_group(tmp_path):
    """--set MODEL.instance_group=[...]: data parallel (or two CPU instances in the tests) without editing
    the shipped configs; the list may nest (gpus: [0, 1]), and the model's parameters stay."""
    gpus = "[{ count: 1 kind: KIND_GPU gpus: [0, 1] }]"
    out = repository_config.render_repository(serve.DEFAULT_REPOSITORY, tmp_path / "gpu", None,
                                  repository_config.parse_overrides([f"moe_decoder.instance_group={gpus}",
                                                         "vision_encoder.instance_group=[{count: 2 kind: KIND_CPU}]"]))
    groups, config = _instance_groups(out / "moe_decoder" / "config.pbtxt")
    assert groups == [(1, "KIND_GPU", [0, 1])] and config.parameters["max_num_seqs"].string_value == "64"
    assert _instance_groups(out / "vision_encoder" / "config.pbtxt")[0] == [(2, "KIND_CPU", [])]
    assert _instance_groups(out / "image_decode" / "config.pbtxt")[0] == [(1, "KIND_CPU", [])]  # untouched
    again = repository_config.render_repository(out, tmp_path / "cpu", None,  # a nested list replaced whole
                                    {"moe_decoder": {"instance_group": "[{ count: 2 kind: KIND_CPU }]"}})
    assert _instance_groups(again / "moe_decoder" / "config.pbtxt")[0] == [(2, "KIND_CPU", [])]
    with pytest.raises(ValueError, match="instance_group wants a pbtxt list"):
        repository_config.render_repository(serve.DEFAULT_REPOSITORY, tmp_path / "bad", None,
                                {"moe_decoder": {"instance_group": "count: 2"}})
