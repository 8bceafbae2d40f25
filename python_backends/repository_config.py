"""The model repository a server runs: a copy of `model_repository/` with its config.pbtxt files
edited (`render_repository`): every `checkpoint_path` made absolute, and the `--set
MODEL.PARAMETER=VALUE` overrides of `zipmoe serve` and the benchmarks (`parse_overrides`,
`load_format_overrides`) written into the models' parameters and instance groups. The shipped
files are never edited. `serve.TritonServer` starts tritonserver on the copy.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path


def _parameter_re(key: str) -> re.Pattern:
    """key: "KEY" <sep> value: { string_value: "<old>" }; pbtxt allows `:` to be omitted before a
    message and `,`/`;` between fields."""
    return re.compile(r'(key\s*:\s*"' + re.escape(key) +
                      r'"\s*[,;]?\s*value\s*:?\s*\{\s*string_value\s*:\s*)"((?:[^"\\]|\\.)*)"')


def _set_instance_group(text: str, value: str) -> tuple[str, int]:
    """config.pbtxt text with its `instance_group [ ... ]` list replaced by `value` (a pbtxt list, e.g.
    `[{ count: 1 kind: KIND_GPU gpus: [0, 1] }]`: data parallel without editing the shipped configs)."""
    value = value.strip()
    if not (value.startswith("[") and value.endswith("]")):
        raise ValueError(f"instance_group wants a pbtxt list such as [{{ count: 2 kind: KIND_CPU }}], got {value!r}")
    match = re.search(r"\binstance_group\s*:?\s*\[", text)
    if match is None:
        return text, 0
    depth = 0  # the list nests (gpus: [0, 1]): find the bracket that closes it
    for end in range(match.end() - 1, len(text)):
        depth += {"[": 1, "]": -1}.get(text[end], 0)
        if depth == 0:
            break
    return text[:match.start()] + "instance_group " + value + text[end + 1:], 1


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_repository(src: Path, dst: Path, checkpoint: str | None,
                      overrides: dict[str, dict[str, str]] | None = None) -> Path:
    """Copy the model repository to dst with every `checkpoint_path` parameter made absolute.

    With `checkpoint` given, it replaces the configured path. Otherwise a relative configured path
    keeps meaning what it means for the original repository: relative to the folder holding it.
    `overrides` {model: {parameter: value}} sets existing config.pbtxt parameters of a model, and the
    key `instance_group` its instance_group list.
    """
    src, dst = Path(src).resolve(), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)

    def absolute(match: re.Match) -> str:
        path = Path(checkpoint).expanduser().resolve() if checkpoint is not None else src.parent / match.group(2)
        return match.group(1) + _quote(str(path))

    for config in dst.glob("*/config.pbtxt"):
        text = _parameter_re("checkpoint_path").sub(absolute, config.read_text())
        for key, value in (overrides or {}).get(config.parent.name, {}).items():
            if key == "instance_group":
                text, found = _set_instance_group(text, value)
            else:
                text, found = _parameter_re(key).subn(lambda m, v=value: m.group(1) + _quote(v), text)
            if not found:
                raise ValueError(f"{config.parent.name}/config.pbtxt has no parameter {key!r} to set")
        config.write_text(text)
    unknown = set(overrides or {}) - {c.parent.name for c in dst.glob("*/config.pbtxt")}
    if unknown:
        raise ValueError(f"no model named {', '.join(sorted(unknown))} in {src}")
    return dst


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """["moe_decoder.routing_policy=sere", ...] -> {"moe_decoder": {"routing_policy": "sere"}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        model, dot, key = name.partition(".")
        if not (sep and dot and model and key):
            raise ValueError(f"--set wants MODEL.PARAMETER=VALUE, got {item!r}")
        out.setdefault(model, {})[key] = value
    return out


LOADING_MODELS = ("vision_encoder", "moe_decoder")  # the models with a load_format parameter


def load_format_overrides(load_format: str | None, overrides: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """--load-format sets both models' load_format (an explicit --set of one of them wins)."""
    if load_format is None:
        return overrides
    return {**overrides, **{m: {"load_format": load_format, **overrides.get(m, {})} for m in LOADING_MODELS}}
