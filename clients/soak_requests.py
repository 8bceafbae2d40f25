"""The soak's requests and how it sends them (`clients/soak.py` checks what comes back).

A seeded request set (`make_requests`: images from a pool of distinct small images, varied questions,
lengths, keep ratios, priorities, pipelines, and which are cancelled after how many responses), sent
streamed through tritonclient's gRPC stream (`triton_client.grpc_generate`) at a concurrency, and
again alone, not streamed, for the reference answers. What the client saw of each is an `Outcome`.
"""
from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from zipmoe.clients.triton_client import ServerBusy, ServerError, grpc_generate
from zipmoe.serving.interface import KEEP_RATIO_USED

KEEP_USED = KEEP_RATIO_USED.name  # the keep ratio VisionZip used, in every response

MODELS = ("mm_qa", "mm_qa_bls")
KEEP_CHOICES = (None, 1.0, 0.6, 0.4)
PRIORITY_CHOICES = (None, 0, 1, 2)  # None: the server's default
QUESTIONS = (
    "What do these notes say?", "Which note mentions the highest amount?", "你好，这些图片里有什么？",
    "Summarise every picture in one line each 🙂", "Is there any text in the images?",
    "Compare the first and the last picture.", "What colour is the background of each note?",
    "Read the amounts aloud, please.", "Écris une réponse courte : combien d'images ?",
    "List the numbers you can see.", "Tell me a story about these notes.", "Why is the sky blue?",
)


# ------------------------------------------------------------------------------------------ requests

def pool_image(i: int, size: tuple[int, int] | None = None) -> bytes:
    """Distinct deterministic image i of the pool: a small note (JPEG or PNG, 96..160 x 64..128 pixels,
    its own colour and text) by default, or a detailed JPEG of `size` (bench_common.synthetic_jpeg)."""
    if size is not None:
        from zipmoe.clients.bench_common import synthetic_jpeg

        return synthetic_jpeg(10_000 + i, size)
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (96 + 32 * (i % 3), 64 + 32 * (i % 3 == 1) + 32 * (i % 5 == 0)),
                    ((37 * i + 11) % 256, (91 * i + 60) % 256, (53 * i + 150) % 256))
    ImageDraw.Draw(img).text((4, 4), f"soak {i}: {i * 7 % 100}.{i % 10}0", fill="black" if i % 2 else "white")
    buf = io.BytesIO()
    img.save(buf, format="PNG" if i % 4 == 0 else "JPEG")
    return buf.getvalue()


@dataclass(frozen=True)
class SoakRequest:
    index: int
    model: str
    question: str
    images: tuple[int, ...]  # indices into the image pool
    max_tokens: int
    ignore_eos: bool
    keep: float | None  # visual_keep_ratio sent (None: the server's default)
    cancel_after: int | None  # the client cancels after this many responses (None: reads to the end)
    priority: int | None = None  # sent where the server takes one (None: its default)

    def inputs(self, pool: list[bytes], stream: bool, keep: float | None = None,
               priority: int | None = None) -> dict:
        """The request's inputs; `keep` and `priority` replace its own (the reference run's)."""
        inputs = dict(text_input=self.question, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                      stream=stream)
        if self.images:
            inputs["images"] = [pool[i] for i in self.images]
        keep = self.keep if keep is None else keep
        if keep is not None:
            inputs["visual_keep_ratio"] = keep
        priority = self.priority if priority is None else priority
        if priority is not None:
            inputs["priority"] = priority
        return inputs


def make_requests(n: int, seed: int = 0, max_images: int = 30, pool_size: int = 48, min_tokens: int = 8,
                  max_tokens: int = 64, cancel_fraction: float = 0.2, models=MODELS) -> list[SoakRequest]:
    """The seeded request set: exactly round(cancel_fraction * n) of them cancelled."""
    rng = np.random.default_rng(seed)
    cancelled = set(rng.choice(n, size=round(cancel_fraction * n), replace=False).tolist()) if n else set()
    out = []
    for i in range(n):
        count = int(rng.integers(0, max_images + 1))
        tokens = int(rng.integers(min_tokens, max_tokens + 1))
        question = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        if rng.random() < 0.5:
            question += f" (request {i}, {int(rng.integers(1000))})"
        out.append(SoakRequest(
            index=i, model=models[int(rng.integers(len(models)))], question=question,
            images=tuple(int(x) for x in rng.integers(0, pool_size, count)), max_tokens=tokens,
            ignore_eos=bool(rng.random() < 0.5), keep=KEEP_CHOICES[int(rng.integers(len(KEEP_CHOICES)))],
            cancel_after=int(rng.integers(1, tokens)) if i in cancelled else None,
            priority=PRIORITY_CHOICES[int(rng.integers(len(PRIORITY_CHOICES)))]))
    return out


# ------------------------------------------------------------------------------------------- running

@dataclass
class Outcome:
    """What the client saw of one request."""
    responses: list[dict] = field(default_factory=list)
    error: str | None = None
    busy: bool = False
    cancelled: bool = False  # the client closed the stream before the last response
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return "".join(r.get("text_output") or "" for r in self.responses)

    @property
    def finished(self) -> bool:
        return bool(self.responses) and bool(self.responses[-1].get("finish_reason")) and not self.error


def run_streamed(url: str, req: SoakRequest, pool: list[bytes], timeout: float,
                 cancel: bool = True, **replace) -> Outcome:
    """One streamed request; cancelled after req.cancel_after responses when `cancel`."""
    out, start = Outcome(), time.perf_counter()
    stream = grpc_generate(url, model=req.model, timeout=timeout, **req.inputs(pool, stream=True, **replace))
    try:
        for response in stream:
            out.responses.append(response)
            if cancel and req.cancel_after is not None and len(out.responses) >= req.cancel_after \
                    and not response.get("finish_reason"):
                out.cancelled = True
                break
    except ServerError as e:
        out.error, out.busy = f"{type(e).__name__}: {e}", isinstance(e, ServerBusy)
    except Exception as e:  # noqa: BLE001 -- a broken stream, a timeout: record it, go on
        out.error = f"{type(e).__name__}: {e}"
    finally:
        stream.close()  # a request still running is cancelled (grpc_generate's finally)
    out.seconds = time.perf_counter() - start
    return out


def reference_inputs(req: SoakRequest, loaded: Outcome | None) -> dict:
    """keep and priority of the reference run: where the server chose the loaded request's keep ratio
    (load-adaptive), the reference asks for that ratio at priority 0 (never lowered), so that it
    prefills the same visual tokens."""
    used = loaded.responses[-1].get(KEEP_USED) if loaded is not None and loaded.responses else None
    return {"priority": 0, **({"keep": float(used)} if used is not None and req.images else {})}


def run_whole(url: str, req: SoakRequest, pool: list[bytes], timeout: float, **replace) -> Outcome:
    """One non-streamed request read to its end (the reference); `replace`: keep, priority."""
    out, start = Outcome(), time.perf_counter()
    try:
        out.responses = list(grpc_generate(url, model=req.model, timeout=timeout,
                                           **req.inputs(pool, stream=False, **replace)))
    except ServerError as e:
        out.error, out.busy = f"{type(e).__name__}: {e}", isinstance(e, ServerBusy)
    except Exception as e:  # noqa: BLE001
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - start
    return out


def run_loaded(url: str, requests: list[SoakRequest], pool: list[bytes], concurrency: int, timeout: float,
               progress=None) -> list[Outcome]:
    done, lock = [0], threading.Lock()

    def one(req: SoakRequest) -> Outcome:
        out = run_streamed(url, req, pool, timeout)
        with lock:
            done[0] += 1
            if progress is not None and (done[0] % 50 == 0 or done[0] == len(requests)):
                progress(f"  {done[0]}/{len(requests)} requests")
        return out

    with ThreadPoolExecutor(concurrency, thread_name_prefix="soak") as pool_:
        return list(pool_.map(one, requests))
