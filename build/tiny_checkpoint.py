"""Build a tiny, deterministic Qwen3-VL-MoE checkpoint in Hugging Face format.

Tests and the demo use it in place of Qwen3-VL-30B-A3B-Instruct (no model hub
here). Same layout and file names as the real checkpoint, a few MB in size:

    python -m zipmoe.build.tiny_checkpoint --out checkpoints/tiny [--seed 0]

Two builds with the same seed are byte-identical. `zipmoe_build.json` is
written last; when it matches the recipe and seed, the build is skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

# Bump whenever anything below changes what is written, so stale builds are redone.
RECIPE_VERSION = 1
STAMP = "zipmoe_build.json"
OUTPUT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
)

LEARNED_VOCAB = 1792  # BPE vocabulary incl. the 256 byte tokens; special tokens come after
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen3-VL chat format, reduced to what the service sends: string content or a
# list of text / image / video items.
def chat_template(label_images: bool = False) -> str:
    """Qwen's chat template. label_images: write "image N: " before the N-th image of the
    conversation (what Qwen's templates do with add_vision_id, as "Picture N: "), so a question
    about "image 2" finds its image by the label instead of by counting image blocks."""
    counter = "{%- set images = namespace(count=0) %}" if label_images else ""
    label = ("{%- set images.count = images.count + 1 %}"
             "{{- 'image ' + images.count|string + ': ' }}") if label_images else ""
    return (
        counter +
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}"
        "{{- message['content'] }}"
        "{%- else %}"
        "{%- for item in message['content'] %}"
        "{%- if item['type'] == 'image' %}"
        + label +
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif item['type'] == 'video' %}"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
        "{%- elif item['type'] == 'text' %}"
        "{{- item['text'] }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}"
    )


# Image processor settings of Qwen3-VL (patch 16, 2x2 merge), with a pixel range
# scaled down to the tiny model: 64x64 (4 visual tokens) to 512x512 (256 tokens).
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 64 * 64, "longest_edge": 512 * 512},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def _corpus() -> list[str]:
    """A fixed training text for the BPE: the kinds of text the demo handles
    (English questions, prices and numbers, Chinese, emoji), varied enough to
    learn the full vocabulary."""
    subjects = [
        "The cat", "A small robot", "My neighbour", "The chart", "This receipt", "The old map", "Our team",
        "The train", "A young doctor", "The garden", "Every student", "The museum", "A quiet river", "The market",
    ]
    verbs = ["shows", "contains", "describes", "lists", "hides", "explains", "compares", "highlights", "ignores"]
    objects = [
        "three red apples", "the total price", "a table of numbers", "two people walking", "the weather forecast",
        "a handwritten note", "several blue bottles", "an empty parking lot", "the company logo", "a busy kitchen",
        "yellow flowers near the window", "the opening hours", "a mountain covered with snow", "the street signs",
    ]
    # Every seventh combination: varied sentences without thousands of lines.
    english = [f"{s} {v} {o}." for s, v, o in itertools.islice(itertools.product(subjects, verbs, objects), 0, None, 7)]
    english += [
        "January February March April May June July August September October November December",
        "Monday Tuesday Wednesday Thursday Friday Saturday Sunday, morning afternoon evening night",
        "zero one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand million",
        "red orange yellow green blue purple black white gray brown pink silver golden transparent",
        "kilogram gram meter centimeter kilometer liter minute second hour dollar euro yuan percent",
        "Please answer briefly and precisely; if you are not sure, say that you do not know.",
        "The assistant looked carefully at each photograph before writing a short answer.",
        "Weather: cloudy with occasional rain, temperature between 12 and 18 degrees Celsius.",
        "Ingredients: flour, sugar, butter, eggs, salt, baking powder, vanilla, chocolate chips.",
        "Chapter 3 discusses attention, experts, routing, tokens, images, and efficient inference.",
        "She bought vegetables, bicycles, umbrellas, notebooks, pencils, and a beautiful lamp yesterday.",
        "Important: keep the receipt, because returns require proof of purchase within thirty days.",
    ]

    questions = [
        "What is in the picture?", "Describe the image in detail.", "How many items are on the receipt?",
        "Compare the two images.", "Which image shows a dog?", "Read the text in the photo.",
        "What is the total amount?", "Summarize the table, please.", "Where was this photograph taken?",
        "Is there anything unusual about the scene?", "Translate the sign into English.",
    ]
    items = ["coffee", "bread", "milk", "tea", "rice", "apples", "batteries", "paper", "cheese", "tomatoes"]
    numbers = [
        f"{item.capitalize()} costs ${(i * 37 + j * 13) % 100 + (i * 7 + j) % 100 / 100:.2f}, quantity {i + j + 1}, total {(i + 1) * (j + 3) * 1.25:.2f}."
        for i, item in enumerate(items) for j in range(6)
    ]
    numbers += [
        f"Invoice #{1000 + 17 * k}: 2024-{k % 12 + 1:02d}-{k % 28 + 1:02d}, {k * 3.5:.1f}% off, tel. 555-{k * 123 % 10000:04d}"
        for k in range(40)
    ]

    zh_subjects = ["这张图片", "这张收据", "这个表格", "第一张图", "第二张图", "这份文件", "那个房间", "我们的报告"]
    zh_objects = [
        "三只猫", "一张桌子和两把椅子", "今天的天气", "总价是十二元五角", "很多数字", "一段手写的文字",
        "红色的汽车", "公司的标志", "美丽的山和河流", "学生们在教室里读书", "医生和护士", "新鲜的水果和蔬菜",
    ]
    chinese = [f"{s}里有{o}。" for s, o in itertools.product(zh_subjects, zh_objects)]
    chinese += [
        "你好世界！", "请描述这张图片。", "图片中有什么？", "谢谢你的帮助。", "我们明天去北京。", "价格是多少钱？",
        "春天来了，花园里开满了花。", "他每天早上喝一杯咖啡，然后去上班。", "请比较这两张图片的不同之处。",
        "这家商店的营业时间是上午九点到晚上十点。", "火车站离这里不远，走路大约十分钟。",
    ]

    emoji = ["I love it 🙂", "Great job 👍🎉", "Sunny day ☀️ 🌈", "Cats 🐱 and dogs 🐶", "Pizza 🍕 costs $9.99 😀", "你好 🙂 谢谢 🙏"]
    return english + questions + numbers + chinese + emoji


def build_tokenizer(out: Path, corpus: list[str] | None = None, vocab_size: int = LEARNED_VOCAB,
                    split_digits: bool = False, label_images: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE like Qwen's (every byte is a token, so any UTF-8 text round-trips) learned on
    `corpus` (default: the demo's mixed text), the Qwen special tokens and the chat template.
    split_digits: every digit its own token, as Qwen's own pre-tokenizer does.
    label_images: the chat template names each image ("image N: ", see chat_template)."""
    bpe = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus or _corpus(), trainer)
    bpe.add_special_tokens(list(SPECIAL_TOKENS))

    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,  # exact decode round trip
        chat_template=chat_template(label_images),
    )
    # Template inside tokenizer_config.json, where Qwen's checkpoints keep it and where a reader
    # using `tokenizers` + jinja2 without transformers looks for it.
    tok.save_pretrained(out, save_jinja_files=False)
    return tok


def model_config(tok: PreTrainedTokenizerFast, text: dict | None = None, vision: dict | None = None) -> Qwen3VLMoeConfig:
    """The tiny model's config; `text` / `vision` override its text and vision settings."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen3VLMoeConfig(
        text_config=dict(
            vocab_size=-(-len(tok) // 64) * 64,  # padded rows, as in the real checkpoint
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            hidden_act="silu",
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            attention_bias=False,
        ) | (text or {}),
        vision_config=dict(
            depth=4,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[1, 2],
        ) | (vision or {}),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _init_std(name: str) -> float:
    if name.endswith(".mlp.gate.weight"):
        return 0.5  # peaked routing: experts are used unevenly, as in a trained MoE
    if ".mlp.experts." in name:
        return 0.1  # large enough that expert choice visibly changes the output
    return 0.02


def _build_model(out: Path, config: Qwen3VLMoeConfig, seed: int) -> None:
    model = Qwen3VLMoeForConditionalGeneration(config)
    # Our own init of every parameter, independent of transformers' init order and defaults
    # and of the global RNG; the remaining buffers (rotary frequencies) are not random.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, _init_std(name), generator=gen)
    save_model(model, out)


def save_model(model: Qwen3VLMoeForConditionalGeneration, out: Path) -> None:
    """bf16 safetensors, generation config (stop on <|im_end|> or <|endoftext|>) and the image
    processor settings, as the real checkpoint has them."""
    text = model.config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.pad_token_id],  # <|im_end|>, <|endoftext|>
        pad_token_id=text.pad_token_id,
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n")


def _stamp(seed: int) -> dict:
    return {"recipe": RECIPE_VERSION, "seed": seed}


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    out = Path(out_dir)
    stamp = out / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == _stamp(seed) and all((out / f).exists() for f in OUTPUT_FILES):
        print(f"{out}: up to date")
        return out

    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # an interrupted rebuild must not look complete

    print(f"{out}: training tokenizer")
    tok = build_tokenizer(out)
    print(f"{out}: {len(tok)} tokens, building model (seed {seed})")
    _build_model(out, model_config(tok), seed)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = sorted(f.keys())
    print(f"{out}: {len(keys)} tensors, layer 0 MoE: {[k for k in keys if '.layers.0.mlp.' in k]}")

    stamp.write_text(json.dumps(_stamp(seed), indent=2) + "\n")
    print(f"{out}: done")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_tiny_checkpoint(args.out, args.seed)


if __name__ == "__main__":
    main()
