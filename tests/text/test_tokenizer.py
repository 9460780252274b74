"""tokenizer.json loading, special ids and the sampling sentinel set, on a tokenizer built here."""
import json
import re
import unicodedata

import pytest
from tests.support.tiny_dsv41_tokenizer import SPECIAL_IDS, WORD_IDS, build_tokenizer_json, placeholder

from dsv41_jax.text import special_tokens as st
from dsv41_jax.text.tokenizer import load_tokenizer, sentinel_ids


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer_json(folder)
    return folder


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_special_strings_use_fullwidth_bar_and_block_char():
    # Typed independently from the reference fixtures; the module spells them with escapes.
    assert st.BOS == "<｜begin▁of▁sentence｜>"
    assert st.EOS == "<｜end▁of▁sentence｜>"
    assert st.USER == "<｜User｜>" and st.ASSISTANT == "<｜Assistant｜>" and st.SYSTEM == "<｜System｜>"
    assert unicodedata.name(st.BOS[1]) == "FULLWIDTH VERTICAL LINE"
    assert unicodedata.name(st.BOS[7]) == "LOWER ONE EIGHTH BLOCK"


def test_loads_from_folder_or_file_with_ids_from_the_file(tok_dir, tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.path == tok_dir / "tokenizer.json"
    again = load_tokenizer(tok_dir / "tokenizer.json")
    assert again.encode("hi there") == tok.encode("hi there")


def test_special_ids_are_read_not_assumed(tmp_path):
    specials = dict(SPECIAL_IDS)
    specials[st.BOS], specials[st.EOS], specials[st.PAD] = 5, 6, 7
    build_tokenizer_json(tmp_path, specials=specials, sentinels=False)
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (5, 6, 7)


def test_encode_decode_and_lookups(tok):
    # encode() follows tokenizers' convention: the text of a special token becomes its id...
    template = "<｜User｜>hi there<｜Assistant｜>"
    assert tok.encode(template) == tok.backend_tokenizer.encode(template).ids == \
        [128803, WORD_IDS["hi"], WORD_IDS["there"], 128804]
    assert tok.encode(st.THINK_START + "hi") == [tok.token_to_id(st.THINK_START), WORD_IDS["hi"]]
    # ...and split_special_tokens keeps it characters ([UNK] in this word vocabulary)
    ids = tok.encode(template, split_special_tokens=True)
    assert WORD_IDS["hi"] in ids and not set(ids) & set(tok.added_tokens())
    assert not set(tok.encode(st.THINK_START + st.IMAGE, split_special_tokens=True)) & set(tok.added_tokens())
    assert tok.encode("hi", add_special=True) == [WORD_IDS["hi"]]  # this file has no post-processor
    assert tok.token_to_id(st.THINK_END) == 128822
    assert tok.id_to_token(128799) == st.SYSTEM
    assert tok.token_to_id("never-seen") is None
    assert tok.decode([0, 128803, WORD_IDS["hi"]]).split() == [st.BOS, st.USER, "hi"]
    assert tok.decode([0, WORD_IDS["hi"]], skip_special=True) == "hi"
    assert tok.added_tokens()[st.IMAGE_TOKEN_ID] == st.IMAGE
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"hi")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")


def test_malformed_json_is_a_clear_error(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"not valid JSON \(line 1"):
        load_tokenizer(path)
    path.write_text(json.dumps({"hello": 1}), encoding="utf-8")
    with pytest.raises(ValueError, match="not a tokenizers file"):
        load_tokenizer(path)


def test_missing_special_token_is_reported(tmp_path):
    specials = {k: v for k, v in SPECIAL_IDS.items() if k != st.BOS}
    build_tokenizer_json(tmp_path, specials=specials, sentinels=False)
    with pytest.raises(ValueError, match="no bos token"):
        load_tokenizer(tmp_path)
    loaded = load_tokenizer(tmp_path, bos_token=st.SYSTEM)
    assert loaded.bos_id == 128799


def test_sentinels_match_spec_when_the_file_declares_them(tok):
    ids = sentinel_ids(tok)
    expected = tuple(range(128847, 129271)) + (129279,)  # docs/REFERENCE.md §9, written out independently
    assert ids == expected
    assert len(ids) == 425
    assert 129264 in ids  # the image placeholder is input-only
    assert not {0, 1, 2, 128799, 128803, 128804, 128821, 128822} & set(ids)


def test_sentinels_absent_from_a_small_tokenizer_are_dropped(tmp_path):
    specials = {k: v for k, v in SPECIAL_IDS.items() if k != st.IMAGE}
    build_tokenizer_json(tmp_path, specials=specials, sentinels=False)
    assert sentinel_ids(load_tokenizer(tmp_path)) == ()


def test_partial_sentinel_coverage_keeps_only_declared_ids(tmp_path):
    build_tokenizer_json(tmp_path, sentinels=False)  # only the image token (129264) is declared
    assert sentinel_ids(load_tokenizer(tmp_path)) == (129264,)


def test_ordinary_token_at_a_sentinel_id_raises(tmp_path):
    words = dict(WORD_IDS)
    words["ordinary"] = 128900
    specials = dict(SPECIAL_IDS)
    build_tokenizer_json(tmp_path / "a", specials=specials, words=words, sentinels=False)
    with pytest.raises(ValueError, match="sentinel id 128900 is the ordinary vocabulary token 'ordinary'"):
        sentinel_ids(load_tokenizer(tmp_path / "a"))


def test_generated_token_inside_sentinel_range_raises(tmp_path):
    specials = dict(SPECIAL_IDS)
    specials[st.THINK_END] = 128900
    build_tokenizer_json(tmp_path, specials=specials, sentinels=False)
    with pytest.raises(ValueError, match="must be generatable"):
        sentinel_ids(load_tokenizer(tmp_path))


def test_placeholder_names_follow_the_deepseek_pattern():
    assert placeholder(128847) == "<｜place▁holder▁no▁128847｜>"


def test_a_lone_surrogate_is_refused_with_its_code_point_and_position(tmp_path):
    """JSON allows "\\ud800" without its pair; such text has no UTF-8 form. Both tokenizers (the file
    and the byte-level fallback) and the chat encoder say which code point and where, not the
    `tokenizers` library's "TextInputSequence must be str"."""
    from dsv41_jax.text.chat import encode_chat_ids
    from dsv41_jax.train.data import ByteTokenizer

    tok = load_tokenizer(ByteTokenizer().save_json(tmp_path / "tokenizer.json"))
    for encode in (tok.encode, ByteTokenizer().encode):
        for split in (False, True):
            with pytest.raises(ValueError, match=r"lone UTF-16 surrogate U\+D800 at character 2"):
                encode("ab\ud800c", split_special_tokens=split)
    with pytest.raises(ValueError, match=r"surrogate U\+DFFF at character 1"):
        encode_chat_ids(tok, [{"role": "user", "content": "x\udfff"}], thinking=False)
    assert tok.encode("a\U0001F600") == ByteTokenizer().encode("a\U0001F600")  # a paired character is fine
