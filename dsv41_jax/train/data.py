"""Training data: text, JSONL and chat files -> tokenized documents -> packed fixed-length rows.

Each row carries, per position: the input token, its document-relative position, the target
(next token), a loss mask (0 for padding, document ends and chat prompts) and a validity mask
(0 for padding). Documents start at multiples of `align` (the compression ratios times the
candidate block, see `alignment`), so compression groups and candidate blocks in a packed row
are exactly the document-relative ones serving computes (docs/REFERENCE.md §7). Documents longer than a
row are cut into row-sized pieces, each its own document.

Batch i of a run is a pure function of (rows, seed, i): resume needs only the batch index.
"""
from __future__ import annotations

import hashlib
import json
import math
import pathlib
from dataclasses import dataclass

import numpy as np

from dsv41_jax.engram.hashing import EngramLayout, hash_ids
from dsv41_jax.engram.tokens import build_token_map
from dsv41_jax.text import pieces as P, special_tokens as st
from dsv41_jax.text.chat import encode_chat_ids
from dsv41_jax.text.tokenizer import byte_alphabet, check_encodable, load_tokenizer as load

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".c", ".h", ".json", ".toml", ".cfg"}


# ------------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """Byte-level fallback (no tokenizer.json needed): the chat specials, then the 256 bytes.

    Ids 0..2 are BOS, EOS, pad (as in the released tokenizer); the other role and reasoning
    markers follow, so chat data can be encoded; byte b is id N_SPECIAL + b.
    """

    SPECIALS = (st.BOS, st.EOS, st.PAD, st.SYSTEM, st.USER, st.ASSISTANT, st.THINK_START, st.THINK_END)
    IMAGE_ID = len(SPECIALS) + 256  # the image placeholder's id in `save_json(image_token=True)`

    def __init__(self):
        self.bos_id, self.eos_id, self.pad_id = 0, 1, 2
        self.n_special = len(self.SPECIALS)
        self._special_ids = {s: i for i, s in enumerate(self.SPECIALS)}
        self._pattern = P.control_pattern(self.SPECIALS)

    @property
    def vocab_size(self) -> int:
        return self.n_special + 256

    def encode(self, text: str, add_special: bool = False, *, split_special_tokens: bool = False) -> list[int]:
        """Ids for `text`, as `Tokenizer.encode` gives them on the file `save_json` writes: special-token
        text becomes its id unless `split_special_tokens` (then every character is bytes, as training
        documents are encoded); `add_special` puts BOS first, as the file's post-processor does."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        check_encodable(text)
        if split_special_tokens:
            ids = self._bytes(text)
        else:
            ids = P.encode_pieces([P.encoder(text)], self._special_ids, self._pattern, self._bytes)
        return [self.bos_id] + ids if add_special else ids

    def _bytes(self, text: str) -> list[int]:
        return [b + self.n_special for b in text.encode("utf-8")]

    def encode_pieces(self, pieces) -> list[int]:
        """A chat-encoder prompt (dsv41_jax.text.pieces): markers only where the encoder wrote them."""
        return P.encode_pieces(pieces, self._special_ids, self._pattern, self._bytes)

    @property
    def path(self) -> str:
        return "the byte-level fallback tokenizer"

    def added_tokens(self) -> dict[int, str]:
        return dict(enumerate(self.SPECIALS))

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def decode(self, ids, skip_special: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i >= self.n_special:
                buf.append(i - self.n_special)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special:
                out.append(self.SPECIALS[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_json(self, path, *, image_token: bool = False) -> pathlib.Path:
        """Write this tokenizer as a tokenizer.json the `tokenizers` library loads, with the same
        ids: a byte-level BPE with no merges (GPT-2's byte-to-character alphabet) and the specials
        as added tokens. Exported checkpoints carry it, so `dsv41 serve` needs no other step.
        `image_token` adds the image placeholder as id `IMAGE_ID` (after the bytes), the id
        `ModelConfig.tiny_vision` uses, so a small vision checkpoint and this tokenizer agree.

        The file's post-processor puts BOS before a text encoded with special tokens (the default of
        `tokenizers` and of Hugging Face's tokenizers), as DeepSeek's own tokenizer.json does: a client
        that tokenizes a completion prompt with this file gets the ids the server gives it (the
        server's completion prompts start with BOS), so evaluation harnesses that count context
        tokens themselves (lm-eval) line up with the server's echo logprobs."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        vocab = dict(self._special_ids)
        vocab.update({ch: self.n_special + b for b, ch in byte_alphabet().items()})
        tok = Tokenizer(models.BPE(vocab, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in self.SPECIALS])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{st.BOS} $A", pair=f"{st.BOS} $A $B:1", special_tokens=[(st.BOS, self.bos_id)])
        if image_token:
            tok.add_special_tokens([AddedToken(st.IMAGE, special=True, normalized=False)])
            if tok.token_to_id(st.IMAGE) != self.IMAGE_ID:
                raise RuntimeError(f"the image token got id {tok.token_to_id(st.IMAGE)}, not {self.IMAGE_ID}")
        path = pathlib.Path(path)
        path = path / "tokenizer.json" if path.is_dir() else path
        tok.save(str(path))
        return path

    def token_texts(self) -> list[str]:
        """Per-id text for the Engram token map (bytes that are not text get their own key)."""
        texts = list(self.SPECIALS)
        for b in range(256):
            texts.append(chr(b) if 32 <= b < 127 or b in (9, 10, 13) else f"<0x{b:02X}>")
        return texts


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer.json (file or folder), or the byte-level fallback when None."""
    if path is None:
        return ByteTokenizer()

    return load(path)


def engram_token_map(tokenizer) -> tuple[np.ndarray, int]:
    if isinstance(tokenizer, ByteTokenizer):
        return build_token_map(tokenizer.token_texts())
    return build_token_map(tokenizer)


# ------------------------------------------------------------------------------- documents
@dataclass
class Document:
    """Token ids [n] and which of them are trained on as targets (mask[i]: predict ids[i])."""

    ids: np.ndarray
    target_mask: np.ndarray


def text_document(tokenizer, text: str) -> Document:
    # Documents keep special-token text as characters: a corpus that quotes `<｜User｜>` must not teach turns.
    ids = [tokenizer.bos_id] + tokenizer.encode(text, split_special_tokens=True) + [tokenizer.eos_id]
    return Document(np.asarray(ids, np.int32), np.ones(len(ids), bool))


def chat_document(tokenizer, messages, thinking: bool = False) -> Document:
    """A conversation; by default only the assistant replies (through their EOS) are trained on.

    A message's `mask` (the per-message field DeepSeek's chat encoder carries without rendering it)
    overrides that: `"mask": true` masks the message out of the loss (an assistant reply kept as
    context only), `"mask": false` trains on it (a user, system or tool message too: its rendered
    tokens, the turn markers after it included). The prompt text never depends on it."""
    full = encode_chat_ids(tokenizer, messages, thinking=thinking)
    mask = np.zeros(len(full), bool)
    for i, msg in enumerate(messages):
        if msg.get("mask", msg.get("role") != "assistant"):  # masked out of the loss
            continue
        before = encode_chat_ids(tokenizer, messages[:i], thinking=thinking) if i else full[:1]  # BOS
        upto = encode_chat_ids(tokenizer, messages[: i + 1], thinking=thinking)
        if full[: len(upto)] != upto or upto[: len(before)] != before:
            raise ValueError(f"chat turn {i}: the tokenizer does not split the conversation at turn boundaries, "
                             "so the loss mask cannot be placed; use turn texts that end cleanly")
        mask[len(before): len(upto)] = True
    return Document(np.asarray(full, np.int32), mask)


def corpus_digest(docs) -> str:
    """SHA-256 of the tokenized corpus (ids and target masks, in order): what a resume compares."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(np.int64(doc.ids.size).tobytes())
        h.update(np.ascontiguousarray(doc.ids, np.int32).tobytes())
        h.update(np.packbits(doc.target_mask).tobytes())
    return h.hexdigest()


_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f")


def read_text_file(path: pathlib.Path) -> str:
    """The file as UTF-8 text; a ValueError naming the file when it is binary (NUL bytes,
    invalid UTF-8, or mostly control characters), which would otherwise train on junk."""
    raw = path.read_bytes()
    where = raw.find(b"\0")
    if where >= 0:
        raise ValueError(f"training data {path} is not text (a NUL byte at offset {where}); pass UTF-8 text, "
                         ".jsonl or chat files")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"training data {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start} "
                         f"does not decode); convert it to UTF-8 or leave it out") from None
    control = len(raw) - len(raw.translate(None, _CONTROL_BYTES))
    if control > 0.1 * len(raw):
        raise ValueError(f"training data {path} is not text ({control} of {len(raw)} bytes are control "
                         "characters); pass UTF-8 text, .jsonl or chat files")
    return text


def read_documents(paths, tokenizer, *, max_files: int | None = None) -> list[Document]:
    """Documents from files or folders: .jsonl lines ({"text"} or {"messages"[, "thinking"]}),
    anything else as one text document per file. Folders are walked in sorted order."""
    files: list[pathlib.Path] = []
    for p in paths:
        p = pathlib.Path(p)
        if p.is_dir():
            files.extend(f for f in sorted(p.rglob("*")) if f.is_file() and (f.suffix in TEXT_SUFFIXES or f.suffix == ".jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"training data {p} does not exist")
    if max_files is not None:
        files = files[:max_files]
    docs = []
    for f in files:
        if f.suffix == ".jsonl":
            for n, line in enumerate(read_text_file(f).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{n} is not valid JSON: {e}") from None
                if "messages" in rec:
                    docs.append(chat_document(tokenizer, rec["messages"], bool(rec.get("thinking", False))))
                elif "text" in rec:
                    docs.append(text_document(tokenizer, rec["text"]))
                else:
                    raise ValueError(f"{f}:{n}: a JSONL record needs a \"text\" or a \"messages\" field, got {sorted(rec)}")
        else:
            text = read_text_file(f)
            if text.strip():
                docs.append(text_document(tokenizer, text))
    if not docs:
        raise ValueError(f"no documents found in {list(map(str, paths))}")
    return docs


# ------------------------------------------------------------------------------- packing
def alignment(cfg) -> int:
    """Document starts must be multiples of every compression ratio and of the candidate
    block (in tokens), so groups and blocks never straddle a document start."""
    a = 1
    for s in cfg.kv_source_layers:
        a = math.lcm(a, cfg.compress_ratios[s])
    cs = cfg.candidate_source_layer
    if cs >= 0:
        a = math.lcm(a, cfg.compress_ratios[cs] * cfg.candidate_block_size)
    return a


def pack(docs: list[Document], seq_len: int, align: int, pad_id: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Greedy packing of (shuffled) documents into rows [N, seq_len]."""
    if seq_len % align:
        raise ValueError(f"seq_len {seq_len} must be a multiple of the document alignment {align}")
    order = np.random.default_rng(seed).permutation(len(docs))
    pieces = []
    for i in order:
        d = docs[i]
        inp, tgt, msk = d.ids[:-1], d.ids[1:], d.target_mask[1:]
        for s in range(0, len(inp), seq_len):
            pieces.append((inp[s:s + seq_len], tgt[s:s + seq_len], msk[s:s + seq_len]))
    rows, cur, fill = [], [], 0
    for piece in pieces:
        n = len(piece[0])
        start = -(-fill // align) * align
        if start + n > seq_len:
            rows.append(cur)
            cur, start = [], 0
        cur.append((start, piece))
        fill = start + n
    if cur:
        rows.append(cur)
    N = len(rows)
    out = {"tokens": np.full((N, seq_len), pad_id, np.int32), "targets": np.full((N, seq_len), pad_id, np.int32),
           "positions": np.zeros((N, seq_len), np.int32), "loss_mask": np.zeros((N, seq_len), np.float32),
           "valid": np.zeros((N, seq_len), np.float32)}
    for r, row in enumerate(rows):
        for start, (inp, tgt, msk) in row:
            n = len(inp)
            sl = slice(start, start + n)
            out["tokens"][r, sl], out["targets"][r, sl] = inp, tgt
            out["positions"][r, sl] = np.arange(n)
            out["loss_mask"][r, sl] = msk
            out["valid"][r, sl] = 1.0
    return out


def engram_ids(layout, token_map, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int32 [B, T, n_layers, cols] Engram rows, hashed per document (n-grams never reach
    back into the previous document of a packed row)."""
    B, T = tokens.shape
    out = np.zeros((B, T, len(layout.layer_ids), layout.n_hash_cols), np.int64)
    for b in range(B):
        starts = np.flatnonzero(positions[b] == 0).tolist() + [T]
        for s, e in zip(starts[:-1], starts[1:]):
            out[b, s:e] = hash_ids(layout, token_map, tokens[b:b + 1, s:e])[0]
    if out.max(initial=0) >= 2**31:
        raise ValueError("Engram row ids exceed int32; the table is too large for 32-bit indexing")
    return out.astype(np.int32)


class PackedData:
    """Batches of packed rows in a per-epoch shuffled order; `batch(i)` is deterministic."""

    def __init__(self, rows: dict[str, np.ndarray], batch_size: int, seed: int = 0, engram=None):
        n = rows["tokens"].shape[0]
        if n < batch_size:
            raise ValueError(f"the data packs into {n} rows of this length, fewer than one batch of {batch_size}; "
                             "add data, or lower --batch-size / --seq-len")
        self.rows, self.batch_size, self.seed, self.engram = rows, batch_size, seed, engram
        self.batches_per_epoch = n // batch_size
        self._order = (None, None)  # (epoch, permutation) of the last epoch used

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.rows["tokens"].shape[1]

    def batch(self, index: int, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """Batch `index`; rows=(lo, hi): only its rows lo..hi-1 (one process's part of the global
        batch when training across processes; the same rows the whole batch has there)."""
        epoch, j = divmod(int(index), self.batches_per_epoch)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.rows["tokens"].shape[0]))
        perm = self._order[1]
        pick = perm[j * self.batch_size:(j + 1) * self.batch_size]
        if rows is not None:
            pick = pick[rows[0]:rows[1]]
        out = {k: v[pick] for k, v in self.rows.items()}
        if self.engram is not None:
            layout, token_map = self.engram
            out["engram_ids"] = engram_ids(layout, token_map, out["tokens"], out["positions"])
        return out


def engram_setup(cfg, tokenizer):
    """(layout, token map) for configs with Engram layers, else None."""
    if not cfg.engram_layer_ids:
        return None

    token_map, size = engram_token_map(tokenizer)
    if size > cfg.engram_compressed_vocab_size:
        raise ValueError(f"the tokenizer's Engram token map has {size} compressed ids but the config's "
                         f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}")
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim,
                                cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id)
    return layout, token_map
