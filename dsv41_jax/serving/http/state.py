"""What every handler of one server reads: the worker, the tokenizer, the settings and what is
derived from them once, in one object on `app.state.serving` (the handlers are module-level
functions; nothing is shared through closures)."""
from __future__ import annotations

import dataclasses
import threading

from fastapi import Request as HTTPRequest

from dsv41_jax.serving.constraints import Grammars
from dsv41_jax.serving.http.token_text import TokenText
from dsv41_jax.serving.http.worker import EngineWorker
from dsv41_jax.text import special_tokens as st


@dataclasses.dataclass
class ServerConfig:
    """What the HTTP layer needs to know besides the worker."""

    model_name: str
    max_model_len: int
    api_key: str | None = None
    has_vision: bool = False
    max_request_bytes: int = 32 << 20  # request bodies beyond this get a 413 before they are read whole
    test_hooks: bool = False  # accept the `dsv41_test` request field (forced tokens, faults); tests only
    conversations: object = None  # a ConversationStore, or None for no conversation caches
    images: object = None  # an images.ImagePrompter when the checkpoint has a vision tower, else None
    effort_table: object = None  # reasoning_effort names -> budgets (--effort-table); None: DEFAULT_EFFORT_TABLE
    processes: object = None  # serving across processes: callable() -> [{"process", "alive", ...}] (/health)


def reply_control_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ids that end a reply, ids dropped from its text). A sampled turn marker (EOS, BOS, User,
    Assistant, System) ends the reply with finish_reason "stop": the model has started another turn.
    Every other special token but the reasoning markers (which the reply parser reads) is dropped
    from the text, so control tokens never reach `content` (docs/SERVING.md "Control tokens")."""
    ends = {tokenizer.eos_id}
    for text in (st.BOS, st.USER, st.ASSISTANT, st.SYSTEM):
        i = tokenizer.token_to_id(text)
        if i is not None:
            ends.add(i)
    keep = {tokenizer.token_to_id(st.THINK_START), tokenizer.token_to_id(st.THINK_END)}
    specials = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    dropped = {i for i, t in specials.items() if t.special and i not in keep and st.DSML not in t.content}
    return tuple(sorted(ends)), tuple(sorted(dropped | ends))


def max_token_bytes(tokenizer) -> int:
    """Bytes of text one token can stand for, at most. No vocabulary entry is longer than this many
    bytes (byte-level entries are longer than the bytes they decode to), so a text of more than
    max_model_len * this many bytes is over the limit for sure: refused before it is tokenized (a
    50 MB prompt costs nothing). The factor 2 leaves room for a normalizer that shortens text before
    it is split."""
    longest = max((len(t.encode("utf-8")) for t in tokenizer.backend_tokenizer.get_vocab(True)), default=1)
    return 2 * max(longest, 4)  # byte-level pieces can decode to a whole UTF-8 character


@dataclasses.dataclass
class ServingState:
    """One server's handlers' shared state. The grammar compiler is built on the first constrained
    request (llguidance reads the tokenizer file) under a lock, as requests run in worker threads."""

    worker: EngineWorker
    tokenizer: object
    cfg: ServerConfig
    end_ids: tuple[int, ...]  # reply_control_ids
    skip_ids: tuple[int, ...]
    max_token_bytes: int
    extra_fields: frozenset  # request fields accepted besides OpenAI's: `dsv41_test` with test hooks
    token_text: TokenText  # how logprobs show tokens
    _grammars: Grammars | None = None
    _grammars_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def create(cls, worker: EngineWorker, tokenizer, cfg: ServerConfig) -> "ServingState":
        end_ids, skip_ids = reply_control_ids(tokenizer)
        extra = frozenset({"dsv41_test"}) if cfg.test_hooks else frozenset()
        return cls(worker, tokenizer, cfg, end_ids, skip_ids, max_token_bytes(tokenizer), extra, TokenText(tokenizer))

    @property
    def metrics(self):
        return self.worker.metrics

    @property
    def vocab_size(self) -> int:
        return self.worker.engine.cfg.vocab_size

    def grammars(self) -> Grammars:
        """The `constraints.Grammars` of this tokenizer, built once."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size)
            return self._grammars


def serving_state(request: HTTPRequest) -> ServingState:
    return request.app.state.serving
