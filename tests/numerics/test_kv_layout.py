"""The cache containers' two forms: bytes (`WindowKV`, `CompressedKV`, `IndexKeys`) and the TPU kernels'
32-bit word view (`words_of`), which a cache may store (`model.cache.init_cache(words=True)`).

Oracle: the byte containers themselves (the word view must give back every byte, bit for bit) and a
word layout written out here with numpy from the section comment of kv_layout ("kernel views")."""
import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.cache import cache_form, init_cache, scatter_container
from dsv41_jax.numerics import kv_layout

X = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 128), jnp.float32) * 3  # scales fill whole words, as at the released widths


def _bytes(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


@jax.jit
def _forms(x):
    """Per kind: (bytes, words, words given back as bytes, dequantized from bytes, from words), one program."""
    out = []
    for quantize, dequant in ((kv_layout.quantize_window, kv_layout.dequantize_window),
                              (kv_layout.quantize_compressed, kv_layout.dequantize_compressed),
                              (kv_layout.quantize_index_keys, kv_layout.dequantize_index_keys)):
        c = quantize(x)
        w = kv_layout.words_of(c)
        out.append((c, w, kv_layout.bytes_of(w), dequant(c), dequant(w)))
    return out


def test_words_hold_the_bytes_and_give_them_back():
    for c, w, back, deq_c, deq_w in _forms(X):
        assert kv_layout.is_words(w) and not kv_layout.is_words(c)
        assert kv_layout.row_bytes(w) == kv_layout.row_bytes(c) and kv_layout.dim_of(w) == kv_layout.dim_of(c) == 128
        assert type(back) is type(c) and kv_layout.words_of(w) is w and kv_layout.bytes_of(c) is c
        for a, b in zip(back, c):
            assert a.dtype == b.dtype and np.array_equal(_bytes(a), _bytes(b))
        assert np.array_equal(np.asarray(deq_w), np.asarray(deq_c))
        assert type(kv_layout.like(w, c)) is type(w) and type(kv_layout.like(c, w)) is type(c)


def test_window_words_order():
    """Element 8j + n of a row: byte n of low word j (n < 4), byte n - 4 of high word j (numpy, low byte first)."""
    c, w = _forms(X)[0][:2]
    values = _bytes(c.values).reshape(2, 5, 16, 8).astype(np.uint32)
    shifts = np.array([0, 8, 16, 24], np.uint32)
    assert np.array_equal(np.asarray(w.low), (values[..., :4] << shifts).sum(-1, dtype=np.uint32))
    assert np.array_equal(np.asarray(w.high), (values[..., 4:] << shifts).sum(-1, dtype=np.uint32))


def test_a_word_cache_is_the_byte_cache():
    cfg = ModelConfig.tiny(max_seq_len=64, n_layers=2, compress_ratios=(0, 4), kv_source_layers=(1,),
                           index_source_layers=(1,), candidate_source_layer=1, engram_layer_ids=())
    words, plain = (jax.eval_shape(lambda w=w: init_cache(cfg, 2, words=w)) for w in (True, False))
    assert all(kv_layout.is_words(c) for c in [*words["window"], *words["compressed"].values(),
                                                 *words["index_keys"].values()])
    back = jax.eval_shape(lambda: cache_form(init_cache(cfg, 2, words=True), False))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), back) == jax.tree.map(lambda a: (a.shape, a.dtype), plain)


@jax.jit
def _written(c, new, idx):
    got = scatter_container(kv_layout.words_of(c), new, idx)
    return got, kv_layout.bytes_of(got), scatter_container(c, new, idx)


def test_rows_written_into_words_arrive_as_words():
    c = kv_layout.quantize_compressed(X)
    got, back, ref = _written(c, kv_layout.quantize_compressed(X[:, :2] * 2), jnp.array([[3, -1], [0, 4]]))
    assert type(got) is kv_layout.CompressedWords
    for a, b in zip(back, ref):
        assert np.array_equal(_bytes(a), _bytes(b))
