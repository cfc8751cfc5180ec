from oled.model.tokenizer import Tokenizer


def test_round_trip(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    for text in ["What is the capital of France?", "héllo wörld 🙂\n  indented", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_special_ids_as_llada2(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    assert (tok.eos_id, tok.mask_id) == (1024 - 292, 1024 - 289)
    assert tok.stop_ids == {tok.eos_id, tok.role_end_id}


def test_chat_format(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    text = tok.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>Hi<|role_end|>"
        "<role>ASSISTANT</role>"
    )
    ids = tok.encode(text)
    assert ids.count(tok.role_end_id) == 2
    assert tok.decode(ids, skip_special=False) == text
