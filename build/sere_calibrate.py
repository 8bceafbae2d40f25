"""Offline SERE calibration: expert similarity and protected experts of every MoE layer.

    python -m zipmoe.build.sere_calibrate CHECKPOINT [--method frobenius|cosine] [--protect N]
        [--prompts FILE.jsonl] [--device cuda] [--dtype bfloat16] [--max-tokens N] [--out FILE]

Calibration tokens are the MoE-layer inputs the engine's own prefill computes for a fixed set of
chat prompts (text, and image-text through the vision tower at keep ratio 1.0) plus the user's
JSON lines `{"text": ...}`. Every expert of a layer runs on every token; with A_p = expert p's
outputs [T, H]:

    frobenius: sim[p, q] = 1 - ‖A_p - A_q‖_F / max_{p', q'} ‖A_p' - A_q'‖_F
    cosine:    sim[p, q] = <A_p, A_q> / (‖A_p‖_F ‖A_q‖_F)

Both come from the Gram matrix G[p, q] = <A_p, A_q> (‖A_p - A_q‖² = G_pp + G_qq - 2 G_pq), summed
in float64 over token chunks, so memory is O(E² + E · chunk · H) and never [E, T, H].
`protect[l, e]` marks the N experts per layer whose slot, handed to their most similar expert,
changes the layer output most on the calibration tokens routed to them.
"""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

from zipmoe.build.demo_images import plain_png, receipt_png
from zipmoe.checkpoint import TextConfig
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.settings import DTYPE_NAMES, LOAD_FORMATS, dtypes
from zipmoe.engine.multimodal import VisualInputs, splice_images
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels.layer_ops import router_reference
from zipmoe.prompt import ChatPrompt
from zipmoe.sere_file import METHODS, SERE_FILE, SereTables, checkpoint_fingerprint, save_sere
from zipmoe.vision import VisionEncoder, pixels_of
from zipmoe.visionzip import compress

# Captured inputs are kept on the host: 48 layers x 2048 x bf16 = 192 KiB a token on a 30B-A3B (3 GiB here).
DEFAULT_MAX_TOKENS = 16384
CHUNK_BYTES = 1 << 29  # float64 expert outputs of one token chunk, [E, chunk, H]
EXPERT_CHUNK = 8  # experts per batched matmul
BATCH_TOKENS = 4096  # prompt tokens per prefill step

TEXT_PROMPTS = (
    "What is the capital of France, and how many people live there?",
    "Summarise the plot of a short story about a lighthouse keeper in two sentences.",
    "Translate into English: 今天的天气很好，我们去公园散步吧。",
    "这张收据上的总金额是多少？请只回答数字。",
    "请用三句话介绍一下长城的历史。",
    "北京、上海和广州哪个城市的人口最多？",
    "Compute 17 * 23 and explain each step.",
    "What is 3.75 + 12.40 - 0.99? Give the answer with two decimals.",
    "List the prime numbers between 10 and 50.",
    "Convert 72 degrees Fahrenheit to Celsius.",
    "The meeting is on 2024-03-15 at 14:30. What day of the week is that?",
    "CAFE NOTE #0042\nespresso 2.80\nflat white 3.90\ncroissant 2.40\nTOTAL 9.10\nIs the total correct?",
    "RECEIPT\nmilk 1L x2 ... 2.58\nbread ... 1.99\neggs (12) ... 3.49\nVAT 7% incl.\nHow much was spent on eggs?",
    "Invoice no. 2023-118, due 30 days, amount EUR 1,250.00, paid EUR 400.00. What is still owed?",
    "发票号码：00387461，金额：¥ 268.50，税率：6%。税额是多少？",
    "Order #5521: 3 x T-shirt @ $12.99, 1 x cap @ $8.50, shipping $4.95. What is the order total?",
    "Write a haiku about autumn leaves.",
    "Explain the difference between a list and a tuple in Python.",
    "def add(a, b):\n    return a + b\nWhat does this function return for add(2, 3)?",
    "Give three tips for taking clear photographs of documents.",
    "Describe the colours of a sunset over the sea.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "Name the days of the week in French.",
    "How many minutes are there in 3 hours and 45 minutes?",
    "A train leaves at 09:12 and arrives at 11:47. How long is the journey?",
    "Please answer briefly: is 1,024 a power of two?",
    "Rewrite this sentence politely: give me the report now.",
    "What are the opening hours on the sign: Mon-Fri 8:00-18:00, Sat 9:00-13:00, Sun closed?",
    "桌子上有三个红苹果和两个香蕉，一共有几个水果？",
    "Describe a busy kitchen in a restaurant at dinner time.",
    "What does the chart show if sales rose from 120 to 180 units?",
    "Spell the number 4,506,312 in words.",
)
# (images by name, question): the receipt is detail-dense, the plain picture nearly empty.
IMAGE_PROMPTS = (
    (("receipt",), "What is the total on this receipt, and which item costs the most?"),
    (("plain",), "Describe the shape in this picture and its colours."),
    (("receipt", "plain"), "Which of these two pictures contains text? 请用中文回答。"),
)
IMAGES = {"receipt": receipt_png, "plain": plain_png}


def load_prompts_file(path: str | Path) -> list[str]:
    """JSON lines, one `{"text": "..."}` per line; blank lines are skipped."""
    texts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"]:
            raise ValueError(f'{path}:{n}: expected an object with a non-empty string "text"')
        texts.append(item["text"])
    return texts


def _pixels(png: bytes, checkpoint: Path) -> torch.Tensor:
    """PNG -> normalised CHW float32 like the Qwen processor (x/255 - mean)/std, at half its size
    rounded to patch * merge (a fixed size: the vision tower needs sides that are multiples of it)."""
    cfg = json.loads((checkpoint / "preprocessor_config.json").read_text())
    factor = int(cfg["patch_size"]) * int(cfg["merge_size"])
    img = Image.open(io.BytesIO(png)).convert("RGB")
    w, h = (max(factor, round(s / 2 / factor) * factor) for s in img.size)
    mean, std = (torch.tensor(cfg[k]).view(3, 1, 1) for k in ("image_mean", "image_std"))
    return pixels_of(img.resize((w, h), Image.BICUBIC), mean, std)


def calibration_requests(checkpoint: Path, texts: list[str], device: str, dtype: str,
                         load_format: str = "auto") -> list[tuple[list[int], VisualInputs | None]]:
    """(prompt ids, visual inputs) of the image-text prompts, then of `texts`, all chat-templated."""
    chat = ChatPrompt(checkpoint)
    image_token = TextConfig.from_dir(checkpoint).image_token_id
    encoder = VisionEncoder(checkpoint, torch.device(device), dtypes()[dtype], load_format=load_format)
    names = list(IMAGES)
    features = dict(zip(names, encoder.features([_pixels(IMAGES[n](), checkpoint) for n in names])))
    requests = []
    for images, question in IMAGE_PROMPTS:
        tokens = compress([features[n] for n in images], 1.0)
        ids, positions, delta = splice_images(
            chat.encode(question, len(images)), image_token, [t.embeds.shape[0] for t in tokens],
            torch.cat([t.positions for t in tokens]), [t.grid for t in tokens])
        visual = VisualInputs(torch.cat([t.embeds for t in tokens]), torch.cat([t.deepstack for t in tokens], dim=1),
                              positions, delta)
        requests.append((ids, visual))
    requests += [(chat.encode(t), None) for t in texts]
    return requests


def capture_moe_inputs(engine: LLMEngine, requests: list[tuple[list[int], VisualInputs | None]]) -> dict[int, torch.Tensor]:
    """Prefills every request (one generated token, then it finishes) and returns each MoE layer's
    inputs [T, H] over all prompt tokens, in the model dtype, on the host (device memory stays flat)."""
    captured: dict[int, list[torch.Tensor]] = {i: [] for i, moe in enumerate(engine.text.moe_layers) if moe}
    engine.model.moe_input_hook = lambda layer, x: captured[layer].append(x.to("cpu"))
    try:
        for ids, visual in requests:
            engine.add_request(ids, SamplingParams(max_tokens=1), visual=visual)
        while engine.has_work:
            engine.step()
    finally:
        engine.model.moe_input_hook = None
    return {layer: torch.cat(xs) for layer, xs in captured.items()}


def expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_chunk: int,
                   progress: tqdm | None = None) -> torch.Tensor:
    """x [t, H] -> [E, t, H] float64: every expert on every token, down[p] @ (silu(gate) * up),
    computed in the weights' dtype like the engine, `expert_chunk` experts per batched matmul."""
    E = gate_up.shape[0]
    out = torch.empty(E, x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for s in range(0, E, expert_chunk):
        gate, up = torch.matmul(x, gate_up[s:s + expert_chunk].transpose(1, 2)).chunk(2, dim=-1)
        out[s:s + expert_chunk] = torch.matmul(F.silu(gate) * up, down[s:s + expert_chunk])
        if progress is not None:
            progress.update()
    return out


def gram_matrix(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, token_chunk: int,
                expert_chunk: int, progress: tqdm | None = None) -> torch.Tensor:
    """G[p, q] = Σ_tokens <A_p, A_q> [E, E] float64; x [T, H] (any device) streamed in token chunks."""
    E = gate_up.shape[0]
    g = torch.zeros(E, E, dtype=torch.float64, device=gate_up.device)
    for s in range(0, x.shape[0], token_chunk):
        a = expert_outputs(x[s:s + token_chunk].to(gate_up.device), gate_up, down, expert_chunk, progress)
        a = a.flatten(1)
        g += a @ a.T
    return (g + g.T) / 2  # exactly symmetric, whatever order the matmul summed in


def similarity(gram: torch.Tensor, method: str) -> torch.Tensor:
    """[E, E] float64 in [0, 1] (frobenius: the farthest pair is 0) or [-1, 1] (cosine); diagonal 1."""
    diag = gram.diagonal()
    if method == "frobenius":
        dist = (diag[:, None] + diag[None, :] - 2 * gram).clamp_min(0).sqrt().fill_diagonal_(0)
        far = dist.max()
        sim = 1 - dist / far if far > 0 else torch.ones_like(dist)
    elif method == "cosine":
        norm = diag.clamp_min(torch.finfo(torch.float64).tiny).sqrt()  # an all-zero expert: similarity 0
        sim = (gram / norm[:, None] / norm[None, :]).clamp(-1, 1)
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    return sim.fill_diagonal_(1)


def protection_scores(x: torch.Tensor, gate: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      sim: torch.Tensor, top_k: int, normalize: bool, token_chunk: int, expert_chunk: int,
                      progress: tqdm | None = None) -> torch.Tensor:
    """score[e] = Σ over tokens whose top-K holds e of w_e · ‖A_q*(x) - A_e(x)‖, q* = e's most similar
    other expert (ties: lower index): how much the layer output moves when e's slot goes to q*. [E] float64."""
    E = gate_up.shape[0]
    partner = sim.clone().fill_diagonal_(float("-inf")).argmax(dim=1)  # argmax takes the first maximum
    score = torch.zeros(E, dtype=torch.float64, device=gate_up.device)
    for s in range(0, x.shape[0], token_chunk):
        xc = x[s:s + token_chunk].to(gate_up.device)
        _, ids, w = router_reference(xc, gate, top_k, normalize)  # the engine's router
        weight = torch.zeros(xc.shape[0], E, dtype=torch.float64, device=xc.device).scatter_(1, ids, w.double())
        a = expert_outputs(xc, gate_up, down, expert_chunk, progress)
        for e in range(0, E, expert_chunk):  # chunked so a[partner] never copies all of a
            change = torch.linalg.vector_norm(a[partner[e:e + expert_chunk]] - a[e:e + expert_chunk], dim=-1)
            score[e:e + expert_chunk] += (change * weight[:, e:e + expert_chunk].T).sum(dim=1)
    return score


def top_n(scores: torch.Tensor, n: int) -> torch.Tensor:
    """bool mask of the n highest scores (ties: lower index)."""
    mask = torch.zeros(scores.shape[0], dtype=torch.bool)
    mask[torch.sort(scores.cpu(), descending=True, stable=True).indices[:n]] = True
    return mask


def _within_budget(requests: list, max_tokens: int) -> list:
    """The leading requests whose prompts fit in max_tokens (the built-in ones come first)."""
    kept, total = [], 0
    for ids, visual in requests:
        if total + len(ids) > max_tokens:
            break
        kept.append((ids, visual))
        total += len(ids)
    if len(kept) < len(requests):
        print(f"calibration: {len(kept)} of {len(requests)} prompts fit in --max-tokens {max_tokens}")
    return kept


@torch.inference_mode()
def calibrate(checkpoint: str | Path, out: str | Path | None = None, method: str = "frobenius",
              num_protect: int | None = None, prompts_file: str | Path | None = None, device: str = "cpu",
              dtype: str = "float32", max_tokens: int = DEFAULT_MAX_TOKENS, load_format: str = "auto") -> Path:
    """Calibrates CHECKPOINT and writes its SERE tables (default CHECKPOINT/sere.safetensors).

    load_format dummy: the dummy weights the server makes of the same config (same seed, same
    device type: a CUDA generator draws other numbers than the CPU's)."""
    checkpoint = Path(checkpoint)
    out = checkpoint / SERE_FILE if out is None else Path(out)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} not one of {DTYPE_NAMES}")
    text = TextConfig.from_dir(checkpoint)
    E, H = text.num_experts, text.hidden_size
    layers = [i for i, moe in enumerate(text.moe_layers) if moe]
    if not layers:
        raise ValueError(f"{checkpoint} has no MoE layers: nothing to calibrate")
    n = max(1, E // 8) if num_protect is None else num_protect
    if not 0 <= n <= E:
        raise ValueError(f"num_protect must be in [0, {E}], got {n}")

    texts = list(TEXT_PROMPTS) + (load_prompts_file(prompts_file) if prompts_file else [])
    requests = _within_budget(calibration_requests(checkpoint, texts, device, dtype, load_format), max_tokens)
    if not requests:
        raise ValueError(f"max_tokens {max_tokens} holds no calibration prompt")
    longest = max(len(ids) for ids, _ in requests)
    if longest >= text.max_position_embeddings:
        raise ValueError(f"a calibration prompt has {longest} tokens; the model's context is "
                         f"{text.max_position_embeddings}")
    batch = max(longest + 1, BATCH_TOKENS)
    engine = LLMEngine(checkpoint, EngineConfig(
        device=device, dtype=dtype, load_format=load_format, block_size=16, num_kv_blocks=-(-batch // 16),
        max_model_len=longest + 1, max_num_batched_tokens=batch))
    inputs = capture_moe_inputs(engine, requests)
    num_tokens = sum(len(ids) for ids, _ in requests)

    token_chunk = max(1, CHUNK_BYTES // (E * H * 8))
    steps = 2 * -(-num_tokens // token_chunk) * -(-E // EXPERT_CHUNK)  # two passes per layer
    sims, protect = [], []
    with tqdm(total=len(layers) * steps, desc="SERE calibration", unit="expert chunk") as progress:
        for l in layers:
            layer, x = engine.model.layers[l], inputs.pop(l)
            sim = similarity(gram_matrix(x, layer.gate_up, layer.down, token_chunk, EXPERT_CHUNK, progress), method)
            scores = protection_scores(x, layer.gate, layer.gate_up, layer.down, sim, text.top_k,
                                       text.norm_topk_prob, token_chunk, EXPERT_CHUNK, progress)
            sims.append(sim.float().cpu())
            protect.append(top_n(scores, n))
    tables = SereTables(torch.stack(sims), torch.stack(protect), layers, method, num_tokens)
    return save_sere(out, tables, checkpoint_fingerprint(checkpoint), num_protect=str(n),
                     num_prompts=str(len(requests)), dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="zipmoe calibrate", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("--method", choices=METHODS, default="frobenius", help="expert similarity (default: frobenius)")
    p.add_argument("--protect", type=int, default=None, metavar="N",
                   help="protected experts per MoE layer (default: experts / 8)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help='extra calibration prompts, one {"text": "..."} per line')
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="default: cuda when available")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="default: bfloat16 on a GPU (a 30B checkpoint fits one), float32 on the CPU")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"calibration tokens at most (default: {DEFAULT_MAX_TOKENS})")
    p.add_argument("--out", type=Path, default=None, help=f"default: CHECKPOINT/{SERE_FILE}")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: calibrate the random weights `--load-format dummy` serves (config-only checkpoints)")
    args = p.parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    print(calibrate(args.checkpoint, args.out, args.method, args.protect, args.prompts, args.device, dtype,
                    args.max_tokens, args.load_format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
