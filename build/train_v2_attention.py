"""Where the decoder should look: attention targets for task set v2's answers (`build/train_v2.py`).

Why. Two runs of `train_v2` (sessions 15 and 16) trained a tower that reads (its reading head's
loss fell to 0.05) and a decoder that does not use it: its loss was the same with blank images.
To answer, the decoder must find, among the ~1,400 tokens of an example, the one visual token
that holds the next character to write, and nothing in the loss says which one until the answer
is already right. Task set v2 knows: every printed character is a `Mark` with its ink centre, so
each answer token that transcribes printed text has a visual token it is read from.

What. `attention_targets` aligns an answer with the marks of the example's images (each
whitespace-separated word of the answer found as a run of printed characters, preferring the
images the question names and continuing where the last word was found), and returns, per answer
token whose first character is printed, (query position, key position): the position that predicts
the token and the visual token whose 32 x 32 block holds that character. Words that are not printed
("image", "a red circle") have no target.

`AnswerAttention` supervises one head of one decoder layer with them: a training-only attention
function (`ATTENTION`, transformers' SDPA plus a capture of that layer's queries and keys after
q/k norm and mRoPE), `loss()`, the cross-entropy of that head's attention at each query position
against its target, and `hits()` for validation (how often the head looks most at its target).
The saved checkpoint is the plain model: nothing here changes inference.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from zipmoe.build.taskset_v2_docs import Mark

ATTENTION = "sdpa_answer_reads"  # the text attention name while training with AnswerAttention
IMAGE_NUMBER = re.compile(r"image (\d+)")


def char_marks(answer: str, marks: list[tuple[Mark, ...]], question: str) -> list[tuple[int, Mark] | None]:
    """Per character of `answer`: (image index, the Mark it transcribes), or None (a space, a word
    not printed in any image, or an image number: "image 2"). A word is looked for first in the images the question names
    ("image 2"), from where the previous word was found onwards, then from the start; a trailing
    "," or ";" (the answer's own list punctuation) may be left out of the match."""
    named = [int(n) - 1 for n in IMAGE_NUMBER.findall(question) if 0 < int(n) <= len(marks)]
    order = list(dict.fromkeys(named + list(range(len(marks)))))
    printed = ["".join(m.char for m in image) for image in marks]
    out: list[tuple[int, Mark] | None] = [None] * len(answer)
    last = {j: 0 for j in order}  # where the previous word ended, per image
    # "image 2" in an answer (multi_find) names an image; its digit is not printed anywhere
    named_in_answer = {k for m in IMAGE_NUMBER.finditer(answer) for k in range(m.start(), m.end())}
    for word in re.finditer(r"\S+", answer):
        if word.start() in named_in_answer:
            continue
        text = word.group()
        for candidate in (text, text.rstrip(",;")):
            found = _find(candidate, printed, order, last) if candidate else None
            if found is not None:
                j, at = found
                for k in range(len(candidate)):
                    out[word.start() + k] = (j, marks[j][at + k])
                last[j] = at + len(candidate)
                break
    return out


def _find(text: str, printed: list[str], order: list[int], last: dict[int, int]) -> tuple[int, int] | None:
    for j in order:
        at = printed[j].find(text, last[j])
        if at < 0:
            at = printed[j].find(text)
        if at >= 0:
            return j, at
    return None


def attention_targets(answer: str, offsets: list[tuple[int, int]], answer_start: int, image_starts: list[int],
                      image_cols: list[int], chars: list[tuple[int, Mark] | None], block: int = 32) -> torch.Tensor:
    """[targets, 2] (query position, key position) of an example's sequence: answer token t sits at
    answer_start + t (its characters answer[offsets[t]]); the position before it predicts it, and
    reads the visual token of image j's block (y // block, x // block), which image_starts[j] +
    row * image_cols[j] + col places in the sequence."""
    rows = []
    for t, (start, end) in enumerate(offsets):
        first = next((c for c in range(start, min(end, len(answer))) if not answer[c].isspace()), None)
        if first is None or chars[first] is None:
            continue
        j, mark = chars[first]
        key = image_starts[j] + int(mark.y // block) * image_cols[j] + int(mark.x // block)
        rows.append((answer_start + t - 1, key))
    return torch.tensor(rows, dtype=torch.long).view(-1, 2)


class AnswerAttention:
    """Captures one decoder layer's queries and keys in each forward (through the `ATTENTION`
    function, which the text config must name while training) and scores one of its heads'
    attention against the targets."""

    def __init__(self, model: torch.nn.Module, layer: int, head: int = 0):
        self.layer, self.head = layer, head
        self.query: torch.Tensor | None = None  # [batch, heads, length, dim]
        self.key: torch.Tensor | None = None  # [batch, kv heads, length, dim]
        self.scaling = 1.0
        # A plain attribute (not a submodule): not in the state dict, so not in the checkpoint.
        model.model.language_model.layers[layer].self_attn.answer_reads = self

    def capture(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        self.query, self.key, self.scaling = query, key, scaling

    def _logits(self, targets: torch.Tensor) -> torch.Tensor:
        row, q_pos, _ = targets.unbind(1)
        groups = self.query.shape[1] // self.key.shape[1]
        q = self.query[row, self.head, q_pos].float()  # [n, dim]
        k = self.key[row, self.head // groups].float()  # [n, length, dim]
        logits = torch.einsum("nd,nld->nl", q, k) * self.scaling
        causal = torch.arange(k.shape[1], device=k.device)[None, :] > q_pos[:, None]
        return logits.masked_fill(causal, float("-inf"))

    def loss(self, targets: torch.Tensor) -> torch.Tensor:
        """targets [n, 3] (batch row, query position, key position) of the last forward -> mean
        cross-entropy of the head's causal attention at each query position against its key
        position (0 with no targets)."""
        if targets.numel() == 0:
            return self.query.new_zeros((), dtype=torch.float32)
        return F.cross_entropy(self._logits(targets), targets[:, 2])

    def hits(self, targets: torch.Tensor) -> tuple[int, int]:
        """(targets where the head attends most to the target token, targets) of the last forward."""
        if targets.numel() == 0:
            return 0, 0
        with torch.no_grad():
            return int((self._logits(targets).argmax(1) == targets[:, 2]).sum()), len(targets)


def sdpa_answer_reads(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention; the layer AnswerAttention watches also hands it its queries
    and keys (after q/k norm and mRoPE)."""
    reads = getattr(module, "answer_reads", None)
    if reads is not None:
        reads.capture(query, key, kwargs.get("scaling") or module.scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, sdpa_answer_reads)
