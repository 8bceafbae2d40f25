# Deployment on an NGC Triton image (Python backend included; 24.10 = tritonserver 2.51). Installs the
# project the way `make` does, then serves model_repository/ with `zipmoe serve`, which finds
# /opt/tritonserver, and the OpenAI-compatible API beside it. docs/OPERATIONS.md has the whole recipe.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/zipmoe
COPY pyproject.toml README.md ./
COPY python_backends python_backends
COPY kernels kernels
COPY build build
COPY clients clients
COPY model_repository model_repository
# The trained notes checkpoint (25 MB): what the configs' checkpoint_path names, served by default.
COPY checkpoints/notes checkpoints/notes

# Same pinned dependencies as `make install` (torch from PyPI is the CUDA build here).
RUN python3 -m venv /opt/zipmoe/.venv \
 && /opt/zipmoe/.venv/bin/pip install --no-cache-dir -e .

ENV PATH=/opt/zipmoe/.venv/bin:$PATH
# 8000 HTTP (health: /v2/health/ready, /v2/health/live), 8001 gRPC, 8002 metrics, 9000 OpenAI API.
EXPOSE 8000 8001 8002 9000
# Another checkpoint: docker run ... -v /models:/models IMAGE --checkpoint /models/Qwen3-VL-30B-A3B-Instruct
ENTRYPOINT ["zipmoe", "serve", "--host", "0.0.0.0", "--openai-port", "9000"]
