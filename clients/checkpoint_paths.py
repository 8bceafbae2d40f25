"""Checkpoint directories as the clients (eval, bench-serve, soak, degradation, perf_analyzer runs) name them.

`resolve_checkpoint` turns a `--checkpoint` argument into a directory (the trained notes model by
default; the tiny test checkpoint built on first use), `ensure_sere` calibrates SERE beside it when
a run needs sere routing, and `display_path` is the path results files record.
"""
from __future__ import annotations

from pathlib import Path

from zipmoe import serve

REPO = Path(__file__).resolve().parents[1]


def resolve_checkpoint(checkpoint: str | Path | None) -> Path:
    """The given directory (the tiny one is built when needed); the trained one by default."""
    from zipmoe.build.tiny_checkpoint import build_tiny_checkpoint

    path = serve.TRAINED_CHECKPOINT if checkpoint is None else Path(checkpoint).expanduser()
    if path.resolve() == serve.TINY_CHECKPOINT.resolve():
        return build_tiny_checkpoint(serve.TINY_CHECKPOINT)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    return path


def ensure_sere(checkpoint: Path) -> None:
    """sere.safetensors beside the checkpoint, calibrated now when missing or stale."""
    from zipmoe.sere_file import load_sere

    try:
        load_sere(checkpoint)
    except (FileNotFoundError, ValueError) as e:
        import torch

        from zipmoe.build.sere_calibrate import calibrate

        cuda = torch.cuda.is_available()
        print(f"{e}; calibrating", flush=True)
        calibrate(checkpoint, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32")


def display_path(path: Path) -> str:
    """Relative to the repository when inside it (what results files record)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path.resolve())
