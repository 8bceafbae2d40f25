# Deployment on an NGC Triton image (Python backend included). Installs the project the way
# `make` does, then serves model_repository/ with `zipmoe serve`, which finds /opt/tritonserver.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/zipmoe
COPY pyproject.toml README.md ./
COPY python_backends python_backends
COPY kernels kernels
COPY build build
COPY clients clients
COPY model_repository model_repository

# Same pinned dependencies as `make install` (torch from PyPI is the CUDA build here).
RUN python3 -m venv /opt/zipmoe/.venv \
 && /opt/zipmoe/.venv/bin/pip install --no-cache-dir -e . \
 && /opt/zipmoe/.venv/bin/python -m zipmoe.build.tiny_checkpoint --out checkpoints/tiny

ENV PATH=/opt/zipmoe/.venv/bin:$PATH
EXPOSE 8000 8001 8002
# Mount a real checkpoint and pass it: docker run ... -v /models:/models IMAGE --checkpoint /models/Qwen3-VL-30B-A3B-Instruct
ENTRYPOINT ["zipmoe", "serve", "--host", "0.0.0.0"]
