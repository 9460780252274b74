"""Images through `dsv41 serve`: the real uvicorn server and engine on a tiny vision checkpoint whose tokenizer
(the byte-level one with the image placeholder) agrees with its config, spoken to with the real `openai` client.

- a chat request with two images is prefilled with their spans: its first-token logprobs equal the log-softmax of
  `model.forward` on the same prompt and spans (computed here from the images with the vision modules, not the
  server's code), and the images change the answer (text alone, or another image, gives other logits);
- hostile inputs (non-image bytes, too many images, URLs and files the server may not read) are 400s naming the
  problem, and the server keeps answering;
- the same text with another image never resumes the first request's conversation cache; the same image
  does (conversation caches match image positions on the processed pixels), and the resumed request, whose
  replayed window holds image positions, answers as `model.forward` on the whole prompt.
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
from PIL import Image  # noqa: E402

from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.serving.http.images import ImageOptions  # noqa: E402
from dsv41_jax.serving.engine import EngineSettings  # noqa: E402
from dsv41_jax.serving.http.server import BackgroundServer, ServeOptions, banned_ids, build  # noqa: E402
from dsv41_jax.text.tokenizer import load_tokenizer  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from dsv41_jax.vision.sources import ImageLimits  # noqa: E402

MAX_LEN = 512


def vision_config() -> ModelConfig:
    return ModelConfig.tiny_vision(n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                                   candidate_source_layer=-1, engram_layer_ids=(), n_routed_experts=4,
                                   max_seq_len=MAX_LEN, max_batch_size=2)


def png(color, size=(12, 9)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def image_part(data: bytes, mime="image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


RED, BLUE = png((220, 20, 20)), png((20, 20, 220), size=(9, 14))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_images")
    tokenizer = load_tokenizer(ByteTokenizer().save_json(folder / "tokenizer.json", image_token=True))
    cfg = vision_config()
    assert tokenizer.token_to_id("<\uff5cdeepseek_image\uff5c>") == cfg.image_token_id
    model = synthetic_model(cfg, seed=3)
    opts = ServeOptions(model_name="tiny-vl", engine=EngineSettings(slots=2, max_seq_len=MAX_LEN, min_capacity=MAX_LEN,
                                                                    prefill_chunk=64, exact_prefill=True),
                        cache_dir=str(folder / "conv"), cache_bytes=1 << 22,
                        images=ImageOptions(ImageLimits(max_images=2)))
    app, worker = build(model, tokenizer, opts)
    srv = BackgroundServer(app, worker).start()
    srv.conv_dir = folder / "conv"
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)
    yield srv, client, model, tokenizer
    srv.close()


def ask(client, content, max_tokens=1, **kw):
    return client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=5, **kw)


def forward_first_logprobs(model, tokenizer, content, thinking=False) -> np.ndarray:
    """The oracle: the prompt and spans built from the images with the vision modules, then model.forward."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.model.transformer import make_step
    from dsv41_jax.serving import buckets
    from dsv41_jax.text.chat import encode_chat_ids
    from dsv41_jax.vision.merge import make_image_encoder, span_rows
    from dsv41_jax.vision.processor import decode_image, expand_prompt

    messages = content if content and "role" in content[0] else [{"role": "user", "content": content}]
    ids = encode_chat_ids(tokenizer, messages, thinking=thinking, images=True)
    pictures = [decode_image(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))
                for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url"]
    tokens, types, inputs = expand_prompt(ids, pictures, model.cfg)
    gd, params = nnx.split(model)
    encode = make_image_encoder(gd)
    embeds = [np.asarray(encode(params, im.patches, im.n_vit_h, im.n_vit_w)[1]) for im in inputs]
    rows = span_rows(model, np.asarray(types), inputs, embeds)
    spans = (jnp.asarray(rows[None]), jnp.asarray(np.asarray(types)[None], jnp.int32))
    cache = buckets.empty_cache(model.cfg, 1, MAX_LEN)
    logits, _, _ = make_step(gd)(params, jnp.asarray([tokens], jnp.int32), cache, None, None, None, spans)
    row = np.array(logits[0, -1], np.float32)
    row[banned_ids(model.cfg, tokenizer)] = -np.inf  # the server's logprobs leave out ids it never samples
    return np.asarray(jax.nn.log_softmax(jnp.asarray(row)))


def top(choice) -> list[float]:
    """The top logprobs, best first (tokens as text can collide: bytes that are not UTF-8 all print as U+FFFD)."""
    return sorted((t.logprob for t in choice.logprobs.content[0].top_logprobs), reverse=True)


def test_two_images_are_prefilled_with_their_spans(served):
    srv, client, model, tokenizer = served
    content = [{"type": "text", "text": "compare"}, image_part(RED), {"type": "text", "text": "with"},
               image_part(BLUE)]
    r = ask(client, content)
    want = forward_first_logprobs(model, tokenizer, content)
    got = top(r.choices[0])
    assert r.choices[0].logprobs.content[0].bytes == list(tokenizer.decode([int(np.argmax(want))]).encode())
    np.testing.assert_allclose(got, np.sort(want)[::-1][:len(got)], atol=2e-3)
    import httpx

    counted = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}).json()
    assert counted["count"] == r.usage.prompt_tokens  # /tokenize counts the span positions the request prefilled
    text_only = top(ask(client, "compare with").choices[0])
    other = top(ask(client, [content[0], image_part(BLUE), content[2], image_part(RED)]).choices[0])
    assert got != text_only and got != other  # the images, and their order, reach the model


@pytest.mark.parametrize(("content", "needle"), [
    ([image_part(b"not an image at all")], "cannot be decoded"),
    ([image_part(RED)] * 3, "--max-images-per-request"),
    ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], "--allow-image-urls"),
    ([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}], "--allowed-media-dir"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "huge"}}], "detail"),
    ([image_part(RED), {"type": "text", "text": "and <\uff5cdeepseek_image\uff5c>"}], "image placeholder"),
    ([image_part(png((1, 2, 3))[:40])], "cannot be decoded"),  # truncated
])
def test_hostile_images_are_400_and_the_server_keeps_serving(served, content, needle):
    _, client, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, content)
    assert needle in str(e.value)
    assert ask(client, [image_part(RED), {"type": "text", "text": "ok"}]).choices[0].finish_reason == "length"


@pytest.mark.slow  # the default suite's follow-up test below asks with another image too, and is not resumed
def test_another_image_never_resumes_a_conversation_cache(served):
    srv, client, model, tokenizer = served
    first = [image_part(RED), {"type": "text", "text": "describe"}]
    second = [image_part(BLUE), {"type": "text", "text": "describe"}]
    a = ask(client, first, max_tokens=3)
    b = ask(client, second)
    assert b.usage.prompt_tokens_details is None or not b.usage.prompt_tokens_details.cached_tokens
    want = forward_first_logprobs(model, tokenizer, second)
    np.testing.assert_allclose(top(b.choices[0]), np.sort(want)[::-1][:5], atol=2e-3)
    assert a.choices[0].logprobs.content[0].token is not None


def test_a_follow_up_turn_with_the_same_image_resumes_its_conversation_cache(served):
    """In thinking mode a finished request stores its prompt without the final <think>, which the next
    turn extends; the follow-up resumes from it: the engine replays the stored window, which holds image
    positions (their span rows from the resent image), then prefills the new turn. Resending the same
    turn resumes too; the same turn with another image does not."""
    import pathlib

    from dsv41_jax.serving import prefix_cache

    srv, client, model, tokenizer = served
    content = [{"type": "text", "text": "a"}, image_part(RED), {"type": "text", "text": "b"}]
    thinking = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    first = ask(client, content, max_tokens=2, **thinking)
    assert model.cfg.window_size > 4  # the replayed window reaches back into the image's span
    turns = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "more"}]
    follow = client.chat.completions.create(model="tiny-vl", messages=turns, max_tokens=1, temperature=0,
                                            logprobs=True, top_logprobs=5, **thinking)
    assert follow.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    want = forward_first_logprobs(model, tokenizer, turns, thinking=True)
    np.testing.assert_allclose(top(follow.choices[0]), np.sort(want)[::-1][:5], atol=2e-3)
    again = ask(client, content, **thinking)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert top(again.choices[0]) == top(first.choices[0])
    other = ask(client, [content[0], image_part(BLUE), content[2]], **thinking)
    assert not (other.usage.prompt_tokens_details and other.usage.prompt_tokens_details.cached_tokens)
    keys = [prefix_cache.read_tokens(f, "match_key") for f in pathlib.Path(srv.conv_dir).glob("*.dsv41")]
    assert any(k.min() < 0 for k in keys)  # image positions keyed by their pixels, stored in the file


def test_dsv41_generate_with_images(tmp_path, capsys):
    """`dsv41 generate --image` (repeatable): the prompt's spans through the same engine; its greedy first token
    is model.forward's on the same prompt and spans; the prompt ids count the spans; bad inputs exit 2."""
    from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint
    from dsv41_jax.cli.main import main

    tok = ByteTokenizer().save_json(tmp_path / "tokenizer.json", image_token=True)
    model = synthetic_model(vision_config(), seed=3)
    save_hf_checkpoint(model, tmp_path / "ckpt", tokenizer=tok)
    (tmp_path / "red.png").write_bytes(RED)
    (tmp_path / "blue.png").write_bytes(BLUE)
    base = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "compare", "--image",
            str(tmp_path / "red.png"), "--image", str(tmp_path / "blue.png"), "--quiet"]
    assert main(base + ["--temperature", "0", "--max-new-tokens", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tokenizer = load_tokenizer(tok)
    content = [image_part(RED), image_part(BLUE), {"type": "text", "text": "compare"}]
    want = forward_first_logprobs(model, tokenizer, content)
    assert doc["tokens"][0] == int(np.argmax(want))
    assert main(base + ["--print-prompt-ids"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert len(ids) == doc["prompt_tokens"] and ids.count(model.cfg.image_token_id) > 2  # the spans, expanded
    for extra, needle in ((["--language-model-only"], "vision tower"), (["--speculative", "dspark"], "--speculative"),
                          (["--image", str(tmp_path / "nope.png")], "no such file")):
        assert main(base + extra) == 2, extra
        assert needle in capsys.readouterr().err, extra
