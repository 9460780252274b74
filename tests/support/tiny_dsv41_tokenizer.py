"""A tiny tokenizer.json built at test time: a word-level vocabulary plus the V4.1 specials.

Words split on \\w+ / punctuation runs (the `Whitespace` pre-tokenizer), so expected ids can
be worked out by hand. Special tokens sit at fixed ids: BOS/EOS/pad 0/1/2, <｜System｜> 128799,
<think>/</think> 128821/128822 and the image token 129264 follow docs/REFERENCE.md §9 and public engine
notes; <｜User｜>/<｜Assistant｜> use DeepSeek-V3's 128803/128804 (only their being single
added tokens matters here). Every sentinel id of docs/REFERENCE.md §9 gets a place-holder added token.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dsv41_jax.text import special_tokens as st

UNK_ID = 3
WORDS = [
    "hi", "hello", "there", "what", "is", "it", "sunny", "the", "weather", "in", "paris",
    "Reasoning", "Effort", ":", "(", "range", "1", "-", "100", ",", "higher", "value", "more",
    "thorough", "reasoning", ")", "50", "75", "42", "think", "answer", "ok", "<|", "|>", "deepseek_image",
]
WORD_IDS = {word: 10 + i for i, word in enumerate(WORDS)}
SPECIAL_IDS = {
    st.BOS: 0,
    st.EOS: 1,
    st.PAD: 2,
    st.SYSTEM: 128799,
    st.USER: 128803,
    st.ASSISTANT: 128804,
    st.THINK_START: 128821,
    st.THINK_END: 128822,
    st.IMAGE: st.IMAGE_TOKEN_ID,
}


def placeholder(token_id: int) -> str:
    return f"<\uff5cplace\u2581holder\u2581no\u2581{token_id}\uff5c>"


def build_tokenizer_json(
    folder: Path,
    *,
    sentinels: bool = True,
    specials: dict[str, int] | None = None,
    words: dict[str, int] | None = None,
) -> Path:
    """Write folder/tokenizer.json and return its path.

    specials: added special tokens by id (default SPECIAL_IDS, plus place-holders at every
    sentinel id of docs/REFERENCE.md §9 when `sentinels`); words: ordinary vocabulary entries (default WORD_IDS).
    """
    specials = dict(SPECIAL_IDS if specials is None else specials)
    if sentinels:
        taken = set(specials.values())
        specials.update({placeholder(i): i for i in st.spec_sentinel_ids() if i not in taken})
    words = dict(WORD_IDS if words is None else words)
    vocab = {"[UNK]": UNK_ID, **words, **specials}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # Specials already in the model vocabulary keep those ids when added.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def build_byte_tokenizer_json(folder: Path, *, specials: dict[str, int], plain: dict[str, int] = None) -> Path:
    """A lossless byte-level BPE (no merges: one token per byte, ids 10..265) plus added tokens.

    specials are added as special tokens, `plain` as non-special added tokens (files mark e.g.
    `<think>` that way). decode(encode(text)) == text for any text, so a test can compare ids
    with the exact prompt string.
    """
    plain = dict(plain or {})
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: 10 + i for i, ch in enumerate(sorted(alphabet))}
    vocab.update(specials)
    vocab.update(plain)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path
