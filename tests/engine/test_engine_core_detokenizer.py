"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (no model)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from slotserve.engine.core.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld! 日本語のテキスト and emoji 🎉 done. The END is near; stop here."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def stream(tokenizer, text, stop=(), prompt="Say:"):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), stop=list(stop))
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = []
    for i, token_id in enumerate(ids):
        delta = detok.add_tokens([token_id], final=i == len(ids) - 1)
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, True
    return deltas, False


def test_deltas_rebuild_the_text_including_multibyte_characters(tokenizer):
    deltas, stopped = stream(tokenizer, TEXT)
    assert "".join(deltas) == TEXT and not stopped
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_stop_string_cut_and_nothing_after_it(tokenizer):
    deltas, stopped = stream(tokenizer, TEXT, stop=["END"])
    assert stopped and "".join(deltas) == "Héllo wörld! 日本語のテキスト and emoji 🎉 done. The "


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["STOP!"])
    emitted = ""
    for token_id in tokenizer.encode("go go ST", add_special_tokens=False):
        emitted += detok.add_tokens([token_id]).text
    assert emitted == "go go "  # "ST" might begin "STOP!"
    delta = detok.add_tokens(tokenizer.encode("ay", add_special_tokens=False))
    assert delta.text == "STay" and not delta.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, stopped = stream(tokenizer, TEXT, stop=["near", "wörld"])
    assert stopped and "".join(deltas) == "Héllo "


def test_final_flushes_held_back_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["xyz"])
    ids = tokenizer.encode("abc x", add_special_tokens=False)
    text = "".join(detok.add_tokens([t]).text for t in ids[:-1])
    text += detok.add_tokens([ids[-1]], final=True).text
    assert text == "abc x"
