"""The soak's checks of what one request's client saw (`clients/soak.py` runs them over the whole run).

A stream's shape (one response per token, one finish at the end), a loaded answer against its
unloaded reference, and for an answer that differs, the same request run again alone and streamed,
to tell a dropped or repeated response (`loss_pattern`) from numerics; also the memory bound.
"""
from __future__ import annotations

from zipmoe.clients.soak_requests import KEEP_USED, Outcome, SoakRequest, reference_inputs, run_streamed


def stream_problems(req: SoakRequest, out: Outcome) -> list[str]:
    """What is wrong with a stream's shape (an empty list when nothing): one response per token with
    output_token_count 1, 2, ..., n; finish_reason only on the last; the same prompt length throughout."""
    problems = []
    counts = [r.get("output_token_count") for r in out.responses]
    if counts != list(range(1, len(counts) + 1)):
        problems.append(f"output_token_count runs {counts[:12]}{'...' if len(counts) > 12 else ''}, not 1..{len(counts)}")
    reasons = [r.get("finish_reason") or "" for r in out.responses]
    if any(reasons[:-1]):
        problems.append(f"finish_reason before the last response: {reasons}")
    if out.finished and len(counts) > req.max_tokens:
        problems.append(f"{len(counts)} tokens for max_tokens {req.max_tokens}")
    if len({r.get("input_token_count") for r in out.responses}) > 1:
        problems.append("input_token_count changes within the stream")
    if out.cancelled and out.finished:
        problems.append("cancelled, yet finished")
    if out.cancelled and req.cancel_after is not None and len(counts) != req.cancel_after:
        problems.append(f"cancelled after {len(counts)} responses, meant {req.cancel_after}")
    return problems


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def loss_pattern(loaded: list[str], reference: list[str]) -> str | None:
    """Whether the loaded deltas are the reference deltas with one dropped or one repeated."""
    for i in range(len(reference)):
        if loaded == reference[:i] + reference[i + 1:]:
            return f"reference delta {i} dropped"
        if loaded == reference[:i + 1] + reference[i:]:
            return f"reference delta {i} repeated"
    return None


def compare(req: SoakRequest, out: Outcome, ref: Outcome) -> dict | None:
    """None when the completed stream equals its reference; else what differs."""
    last, whole = out.responses[-1], ref.responses[-1]
    fields = ("output_token_count", "finish_reason", "input_token_count", "visual_tokens_kept", KEEP_USED)
    diff = {k: (last.get(k), whole.get(k)) for k in fields if last.get(k) != whole.get(k)}
    if out.text == whole.get("text_output") and not diff:
        return None
    text, ref_text = out.text, whole.get("text_output") or ""
    at = first_difference(text, ref_text)
    return {"index": req.index, "model": req.model, "images": len(req.images), "keep": req.keep,
            "max_tokens": req.max_tokens, "ignore_eos": req.ignore_eos, "fields": diff,
            "keep_applied_differs": "visual_tokens_kept" in diff or KEEP_USED in diff,
            "first_char_differing": at, "chars": [len(text), len(ref_text)],
            "loaded_text_around": text[max(0, at - 10):at + 20], "reference_text_around": ref_text[max(0, at - 10):at + 20]}


def diagnose(url: str, req: SoakRequest, pool: list[bytes], out: Outcome, timeout: float) -> dict:
    """Runs a differing request again alone, streamed: its deltas against the loaded ones."""
    alone = run_streamed(url, req, pool, timeout, cancel=False, **reference_inputs(req, out))
    if alone.error:
        return {"alone_error": alone.error}
    loaded = [r.get("text_output") or "" for r in out.responses]
    reference = [r.get("text_output") or "" for r in alone.responses]
    first = next((i for i, (a, b) in enumerate(zip(loaded, reference)) if a != b), min(len(loaded), len(reference)))
    return {"alone_streamed_equals_loaded": loaded == reference,
            "alone_streamed_joins_to_reference": None,  # filled by the caller
            "first_token_differing": first, "tokens": [len(loaded), len(reference)],
            "loss_pattern": loss_pattern(loaded, reference), "alone_text": alone.text}


def growth_ok(start: float, end: float, bound_mb: float, bound_frac: float) -> bool:
    return end - start <= max(bound_mb, bound_frac * start)
