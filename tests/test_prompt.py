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
