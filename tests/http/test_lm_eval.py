"""lm-eval, unmodified and with its defaults, against the real server: `local-completions` on local
JSONL tasks (a log-likelihood task and a multiple-choice task, no downloads) sends tokenized requests
(`prompt` a list of token-id lists, `echo`, `logprobs` 1, `max_tokens` 1) and reads the prompt
logprobs back; every score it reports equals, bit for bit, the sum of the server's own echo logprobs
for the same tokens. `local-chat-completions` runs a generation task, each answer the server's own
greedy reply to the same chat. The tokenizer lm-eval loads is the checkpoint folder's tokenizer.json
(with the tokenizer_config.json an export writes), as a user would point it there.

Slow: lm-eval starts its own event loops and compiles nothing, but the server compiles its programs.
"""
from __future__ import annotations

import json

import httpx
import pytest

from dsv41_jax.checkpoint.hf_writer import tokenizer_config
from dsv41_jax.serving.http.server import BackgroundServer
from test_serve_warmup import tiny_app

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

MAX_LEN = 256
DOCS = [{"q": "import o", "a": "s", "choices": ["s", "x", "sys"], "gold": 0},
        {"q": "def f(x):\n    return", "a": " x", "choices": [" x", " 1", " None"], "gold": 1},
        {"q": "2 + 2 =", "a": " 4", "choices": [" 4", " 5", " four"], "gold": 0}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lmeval")
    app, worker = tiny_app(folder, MAX_LEN, seed=3)
    (folder / "tokenizer_config.json").write_text(
        tokenizer_config(folder / "tokenizer.json", worker.engine.cfg), encoding="utf-8")
    srv = BackgroundServer(app, worker).start()
    srv.folder = folder
    yield srv
    srv.close()


def _tasks(folder) -> list[str]:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "ll_local.yaml").write_text(
        "task: ll_local\n" + common + "output_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: perplexity\n", encoding="utf-8")
    (folder / "mc_local.yaml").write_text(
        "task: mc_local\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        encoding="utf-8")
    (folder / "gen_local.yaml").write_text(
        "task: gen_local\n" + common + "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n", encoding="utf-8")
    return ["ll_local", "mc_local", "gen_local"]


def _echo_score(server, context: list[int], continuation: list[int]) -> float:
    """The server's own log-likelihood of `continuation` after `context`: its echo logprobs."""
    r = httpx.post(server.url + "/v1/completions", timeout=600, json={
        "model": "tiny", "prompt": context + continuation, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    return sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(context):])


def test_lm_eval_local_completions_scores_equal_the_server_s_echo_logprobs(served):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tasks = _tasks(served.folder)
    out = simple_evaluate(
        model="local-completions", tasks=tasks[:2], task_manager=TaskManager(include_path=str(served.folder)),
        model_args={"base_url": served.url + "/v1/completions", "model": "tiny", "tokenizer": str(served.folder),
                    "max_length": MAX_LEN},
        log_samples=True)
    tok = AutoTokenizer.from_pretrained(str(served.folder))  # what lm-eval tokenized with
    checked = 0
    for task in tasks[:2]:
        for sample in out["samples"][task]:
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
                ctx = tok(context, add_special_tokens=False).input_ids
                whole = tok(context + continuation, add_special_tokens=False).input_ids
                assert whole[: len(ctx)] == ctx
                assert resp[0][0] == _echo_score(served, ctx, whole[len(ctx):]), (task, context, continuation)
                checked += 1
    assert checked == len(DOCS) + sum(len(d["choices"]) for d in DOCS)
    assert set(out["results"]["mc_local"]) >= {"acc,none", "acc_norm,none"}


def test_lm_eval_local_chat_completions_runs_a_generation_task(served):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = _tasks(served.folder)
    out = simple_evaluate(
        model="local-chat-completions", tasks=[tasks[2]], task_manager=TaskManager(include_path=str(served.folder)),
        model_args={"base_url": served.url + "/v1/chat/completions", "model": "tiny"},
        apply_chat_template=True, log_samples=True)
    samples = out["samples"]["gen_local"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        messages = [{"role": "user", "content": sample["doc"]["q"]}]
        r = httpx.post(served.url + "/v1/chat/completions", timeout=600, json={
            "model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "stop": ["\n\n"], "seed": 1234})
        assert r.status_code == 200, r.text
        assert sample["resps"][0][0] == r.json()["choices"][0]["message"]["content"]
