"""qwenkit.engine.objectives.rollout: a completion is cut at its end token and decoded as evaluation decodes
replies (broken bytes as ``\\xNN``), so the rewards of valid text are the tokenizer's text's."""

from __future__ import annotations

from transformers.convert_slow_tokenizer import bytes_to_unicode

from qwenkit.engine.objectives import rewards
from qwenkit.engine.objectives.rollout import completion


def test_a_completion_is_decoded_as_evaluation_decodes_replies(family_processor):
    tok = family_processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    valid = tok.encode("<think>round</think><answer>red</answer>", add_special_tokens=False)
    tokens, text, truncated = completion(tok, [*valid, end, *valid], end)
    assert tokens == [*valid, end] and not truncated  # cut after the end token, which is trained on
    assert text == tok.decode(valid, skip_special_tokens=True)  # valid text: the tokenizer's own
    score = rewards.resolve(["exact", "format"], "pixels", ("think", "answer"))
    args = (score, [], [text, tok.decode(valid)], ["red", "red"], [{}, {}], ["row 0", "row 0"])
    per, _ = rewards.score(*args)
    assert per[0].tolist() == per[1].tolist() == [1.0, 1.0]  # the same rewards as the tokenizer's text
    byte_token = {b: tok.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    broken = [byte_token["é".encode()[0]], *tok.encode("red", add_special_tokens=False)]  # half a character
    tokens, text, truncated = completion(tok, broken, end)
    assert tokens == broken and truncated  # no end token: cut at max_new_tokens
    assert text == "\\xc3red" and "\ufffd" in tok.decode(broken)
