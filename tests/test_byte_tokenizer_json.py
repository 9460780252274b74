"""The byte-level fallback tokenizer written as tokenizer.json (what `dsv41 train --export` and
`dsv41 demo` put next to the weights): the `tokenizers` library loads it and it gives the same
ids, text and Engram token map as the in-process `ByteTokenizer` the model was trained with."""
import numpy as np

from dsv41_jax.engram.tokens import build_token_map
from dsv41_jax.text import special_tokens as st
from dsv41_jax.text.tokenizer import load_tokenizer
from dsv41_jax.train.data import ByteTokenizer, engram_token_map


def test_byte_tokenizer_json_matches_the_fallback(tmp_path):
    fallback = ByteTokenizer()
    tok = load_tokenizer(fallback.save_json(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    texts = ["h\u00e9llo w\u00f6rld\n\t \u65e5\u672c  \uff5cDSML\uff5c calls", bytes(range(32, 127)).decode(),
             "".join(chr(int(c)) for c in rng.integers(1, 0x3000, 200))]
    for text in texts:
        assert tok.encode(text) == fallback.encode(text) and tok.decode(tok.encode(text)) == text
    # special-token text: its id by default in both, characters (bytes) with split_special_tokens
    template = st.BOS + st.USER + "hi" + st.ASSISTANT + st.THINK_START
    assert tok.encode(template) == fallback.encode(template) == [0, 4, 8 + ord("h"), 8 + ord("i"), 5, 6]
    split = fallback.encode(template, split_special_tokens=True)
    assert tok.encode(template, split_special_tokens=True) == split == [8 + b for b in template.encode()]
    assert tok.decode(split) == fallback.decode(split) == template
    for i, special in enumerate(ByteTokenizer.SPECIALS):
        assert tok.token_to_id(special) == i
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2) and tok.token_to_id(st.THINK_END) == 7
    assert tok.vocab_size == fallback.vocab_size
    ours, n_ours = build_token_map(tok)
    theirs, n_theirs = engram_token_map(fallback)
    assert n_ours == n_theirs and np.array_equal(ours, theirs)
