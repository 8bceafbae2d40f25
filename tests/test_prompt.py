"""The preprocess prompt equals transformers' chat template + tokenisation."""
from transformers import AutoTokenizer

from zipmoe.prompt import ChatPrompt


def test_prompt_ids_match_transformers(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    chat = ChatPrompt(tiny_checkpoint)
    for question, images in [("What is the total?", 0), ("比较这两张图片 🙂", 2)]:
        content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
        want = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
        assert chat.encode(question, images) == list(want)
        assert chat.encode(question, images).count(tok.convert_tokens_to_ids("<|image_pad|>")) == images


def test_labelled_images_template_matches_transformers(tmp_path):
    """The notes checkpoint's template names each image ("image N: "), rendered alike by both."""
    from zipmoe.build.tiny_checkpoint import build_tokenizer
    build_tokenizer(tmp_path, ["image 1: what is the price in image 2?"], 300, split_digits=True, label_images=True)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    chat = ChatPrompt(tmp_path)
    content = [{"type": "image"}] * 3 + [{"type": "text", "text": "what is the price in image 2?"}]
    want = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)
    assert chat.encode("what is the price in image 2?", 3) == list(want)
    text = chat.render("what is the price in image 2?", 3)
    assert text.count("image 2: <|vision_start|>") == 1 and "image 3: <|vision_start|>" in text
