"""The SERE calibration file (`sere.safetensors` beside the checkpoint): writing, checking, loading.

Tensors: `similarity` float32 [L_moe, E, E], `protect` bool [L_moe, E], `moe_layers` int32 [L_moe]
(the decoder layer of each row; dense layers have no row). String metadata: `format`,
`fingerprint` (of the checkpoint it was calibrated on), `method`, `num_tokens`, and whatever the
calibration adds (`num_protect`, ...). A file that is missing, of another format, from another
checkpoint or of the wrong shape is refused with a message saying what to run.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .checkpoint import TextConfig

SERE_FILE = "sere.safetensors"
FORMAT = "zipmoe-sere/1"
METHODS = ("frobenius", "cosine")
# Fingerprint samples of each shard's tensor data: weights that differ (another seed, a fine-tune)
# leave config and headers unchanged, so a few evenly spaced blocks are hashed too (not the whole file).
_SAMPLES, _SAMPLE_BYTES = 16, 4096


@dataclass
class SereTables:
    similarity: torch.Tensor  # float32 [L_moe, E, E]
    protect: torch.Tensor  # bool [L_moe, E]
    moe_layers: list[int]  # decoder layer index of each row
    method: str
    num_tokens: int


def _read_header(f) -> bytes:
    n = int.from_bytes(f.read(8), "little")
    return f.read(n)


def checkpoint_fingerprint(checkpoint: str | Path) -> str:
    """sha256 of config.json and, per weight shard (by name): its size, its JSON header and sampled data blocks."""
    checkpoint = Path(checkpoint)
    h = hashlib.sha256()

    def put(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: no two inputs hash alike

    put((checkpoint / "config.json").read_bytes())
    for path in sorted(checkpoint.glob("*.safetensors")):
        with path.open("rb") as f:
            header = _read_header(f)
            if json.loads(header).get("__metadata__", {}).get("format") == FORMAT:
                continue  # a calibration file beside the weights is not part of the checkpoint
            start, size = 8 + len(header), path.stat().st_size
            put(path.name.encode() + b"\0" + str(size).encode())
            put(header)
            span = max(0, size - start - _SAMPLE_BYTES)
            for i in range(_SAMPLES):
                f.seek(start + span * i // (_SAMPLES - 1))
                put(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def save_sere(path: str | Path, tables: SereTables, fingerprint: str, **extra: str) -> Path:
    """Writes the tables; the same tables and metadata give the same bytes."""
    path = Path(path)
    metadata = {**extra, "format": FORMAT, "fingerprint": fingerprint, "method": tables.method,
                "num_tokens": str(tables.num_tokens)}
    blob = save({
        "similarity": tables.similarity.to("cpu", torch.float32).contiguous(),
        "protect": tables.protect.to("cpu", torch.bool).contiguous(),
        "moe_layers": torch.tensor(tables.moe_layers, dtype=torch.int32),
    }, metadata=metadata)
    # safetensors writes the metadata in hash-map order, which changes from run to run: sort it.
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors pads it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n:])
    return path


def load_sere(checkpoint: str | Path, path: str | Path | None = None) -> SereTables:
    """Reads `path` (default: CHECKPOINT/sere.safetensors) and checks it belongs to the checkpoint."""
    checkpoint = Path(checkpoint)
    path = checkpoint / SERE_FILE if path is None else Path(path)
    run = f"run `zipmoe calibrate {checkpoint}`"
    if not path.is_file():
        where = f"no {SERE_FILE} beside {checkpoint}" if path == checkpoint / SERE_FILE else f"no {path}"
        raise FileNotFoundError(f"{where}: {run}")
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a SERE calibration file of format {FORMAT} "
                             f"(format {meta.get('format')!r}): {run}")
        tensors = {k: f.get_tensor(k) for k in ("similarity", "protect", "moe_layers")}
    want = checkpoint_fingerprint(checkpoint)
    if meta.get("fingerprint") != want:
        raise ValueError(f"{path.name} was calibrated for another checkpoint (fingerprint "
                         f"{meta.get('fingerprint')}, {checkpoint} has {want}): {run}")
    if meta.get("method") not in METHODS:
        raise ValueError(f"{path}: unknown method {meta.get('method')!r}, expected one of {METHODS}")

    cfg = TextConfig.from_dir(checkpoint)
    layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    L, E = len(layers), cfg.num_experts
    sim, protect, rows = tensors["similarity"], tensors["protect"], tensors["moe_layers"].tolist()
    if rows != layers:
        raise ValueError(f"{path}: rows for MoE layers {rows}, the checkpoint's MoE layers are {layers}: {run}")
    if tuple(sim.shape) != (L, E, E) or tuple(protect.shape) != (L, E):
        raise ValueError(f"{path}: similarity shape {tuple(sim.shape)} and protect shape {tuple(protect.shape)}, "
                         f"expected {(L, E, E)} and {(L, E)} for {E} experts: {run}")
    return SereTables(similarity=sim.float(), protect=protect.bool(), moe_layers=rows, method=meta["method"],
                      num_tokens=int(meta["num_tokens"]))
