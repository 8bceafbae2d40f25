"""`zipmoe demo` (what `make demo` runs): the committed trained checkpoint answers its question right."""
from __future__ import annotations

import pytest

from zipmoe import cli


def test_demo_example_is_multi_image_and_needs_reading():
    example = cli.demo_example()
    assert len(example.images) == 5 and example.task == "read_total" and example.answer == "58"
    assert sorted(example.kinds) == ["dense", "dense", "plain", "plain", "plain"]


def test_own_images_need_own_question(tmp_path, capsys):
    image = tmp_path / "note.png"
    image.write_bytes(b"not even an image")  # refused before any server starts
    assert cli.main(["demo", "--image", str(image)]) == 2
    assert "your own question" in capsys.readouterr().err


@pytest.mark.integration
def test_demo_answers_right(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "Q (5 notes: plain, plain, dense, plain, dense): what is the total on the receipt?" in out
    assert "expected: 58 -> right" in out
    assert "visual tokens kept per image: [" in out and "TTFT" in out
