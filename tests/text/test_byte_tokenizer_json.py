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


def test_a_client_with_the_exported_tokenizer_counts_completion_prompts_as_the_server_does(tmp_path):
    """The convention vLLM and SGLang follow for DeepSeek checkpoints: a completion prompt is what the
    checkpoint's tokenizer.json gives with its post-processor (BOS first). A client that tokenizes with
    the file (lm-eval counting its context tokens, a `tokenizers` user) gets the server's prompt ids, so
    its context length and the server's echo logprobs line up; the exported tokenizer_config.json lets
    Hugging Face's AutoTokenizer load the same file."""
    import json

    import tokenizers

    from dsv41_jax.checkpoint.hf_writer import write_hf_folder
    from dsv41_jax.config import ModelConfig

    fallback = ByteTokenizer()
    file = fallback.save_json(tmp_path / "tokenizer.json")
    client = tokenizers.Tokenizer.from_file(str(file))  # what any client reads, with its defaults
    server = load_tokenizer(file)
    for text in ["import o", "import os", "h\u00e9llo " + st.USER + " x", " "]:
        assert client.encode(text).ids == [server.bos_id] + server.encode(text) == fallback.encode(text, True)
        assert client.encode(text, add_special_tokens=False).ids == server.encode(text)
    # the continuation "s" after the context "import o": its one token is the last of the joined prompt
    ctx, whole = client.encode("import o").ids, client.encode("import os").ids
    assert whole[: len(ctx)] == ctx and len(whole) == len(ctx) + 1

    cfg = ModelConfig.tiny()
    write_hf_folder(tmp_path / "export", cfg, [], tokenizer=file)
    conf = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast" and conf["bos_token"] == st.BOS
    assert conf["model_max_length"] == cfg.max_seq_len
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == file.read_bytes()
