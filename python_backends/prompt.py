"""Chat template + tokenisation of a question with N images (one placeholder token per image).

Uses the checkpoint's own `chat_template` (Jinja, rendered like transformers does) and the
fast `tokenizers` library directly, so `preprocess` does not import transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatPrompt:
    def __init__(self, checkpoint: str | Path):
        checkpoint = Path(checkpoint)
        self.tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        template = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        jinja_file = checkpoint / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None:
            raise ValueError(f"{checkpoint} has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)

    def render(self, question: str, num_images: int) -> str:
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": question}]
        return self.template.render(messages=[{"role": "user", "content": content}], add_generation_prompt=True)

    def encode(self, question: str, num_images: int = 0) -> list[int]:
        return self.tokenizer.encode(self.render(question, num_images), add_special_tokens=False).ids
