"""`dsv41 generate`: chat-encode a prompt, run a checkpoint, stream the reply to stdout.

Cheap checks come first (folder, tokenizer.json, messages, effort, prompt length), so a bad
input fails in a second with a clear message and exit code 2, before any weights are read.
Logs and the loading progress bar go to stderr; with --json stdout carries one JSON object.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from dsv41_jax.cli.argtypes import effort_table, non_negative_int, positive_int
from dsv41_jax.cli.model_args import InputError, add_mesh_args, load_on, mesh_of


def parse_effort(text: str | None):
    """'low' / 'high' / 'max' / '1'..'100' -> the value chat.resolve_effort takes."""
    if text is None:
        return None
    return int(text) if text.strip().lstrip("+-").isdigit() else text.strip()


def _effort(args) -> int:
    """The budget --effort means under --effort-table (checked before any weights are read)."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.text.chat import resolve_effort

    try:
        return resolve_effort(parse_effort(args.effort), getattr(args, "effort_table", None))
    except ValueError as e:
        raise InputError(f"--effort: {e}") from None


def read_messages(path: str) -> tuple[list, list | None]:
    """(messages, tools) from a JSON file: a list of messages, or {"messages": [...], "tools": [...]}."""
    p = pathlib.Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"--messages {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--messages {p}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"--messages {p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if isinstance(data, dict) and "messages" in data:
        return data["messages"], data.get("tools")
    if isinstance(data, list):
        return data, None
    raise InputError(f"--messages {p}: expected a JSON list of messages or an object with a \"messages\" list, "
                     f"got {type(data).__name__}")


def _messages(args) -> tuple[list, list | None]:
    """The chat to continue: --messages, or one user message of the --image files (in order) then --prompt."""
    if args.messages is not None:
        if args.image:
            raise InputError("--image adds images to --prompt's message; with --messages put image_url parts in the "
                             "messages instead (data URLs or absolute file paths)")
        return read_messages(args.messages)
    if not args.image:
        return [{"role": "user", "content": args.prompt}], None
    parts = []
    for path in args.image:
        p = pathlib.Path(path).expanduser()
        if not p.is_file():
            raise InputError(f"--image {path}: no such file")
        parts.append({"type": "image_url", "image_url": {"url": str(p.resolve())}})
    return [{"role": "user", "content": parts + [{"type": "text", "text": args.prompt}]}], None


def _image_options():
    """`dsv41 generate` reads the files its user names: any local path; the server's other limits."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.serving.http.images import ImageOptions
    from dsv41_jax.vision.sources import ImageLimits

    return ImageOptions(ImageLimits(media_dir="/"))


def _prompt_ids(args, tokenizer, cfg=None) -> list[int]:
    """The chat-encoded prompt. With images (cfg needed): each image's span expanded, as it is prefilled."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.serving.http.images import has_images, image_prompt
    from dsv41_jax.text.chat import encode_chat_ids

    messages, tools = _messages(args)
    chat = dict(thinking=args.thinking, effort=_effort(args), tools=tools)
    try:
        if has_images(messages):
            return image_prompt(tokenizer, messages, cfg, _image_options(), **chat)[0]
        return encode_chat_ids(tokenizer, messages, **chat)
    except (ValueError, TypeError, KeyError) as e:
        raise InputError(str(e)) from None


def _run(args) -> int:
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.text.tokenizer import load_tokenizer

    folder = pathlib.Path(args.checkpoint)
    if not folder.is_dir():
        raise InputError(f"--checkpoint {folder}: no such folder")
    if not (folder / "tokenizer.json").is_file():
        raise InputError(f"--checkpoint {folder}: no tokenizer.json; copy the tokenizer.json that ships with the weights into it")
    tokenizer = load_tokenizer(folder)
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.checkpoint import checkpoint_format
    from dsv41_jax.checkpoint.hf_loader import read_config
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving.generate import Generator, TextStream
    from dsv41_jax.serving.http.images import has_images
    from dsv41_jax.serving.sampling import SamplingParams

    images = has_images(_messages(args)[0])
    if images and args.speculative:
        raise InputError("--speculative with --image is not supported yet: the drafter's prefill does not take image "
                         "spans; drop one of them")
    overrides = {"max_batch_size": 1}
    if args.max_seq_len is not None:
        overrides["max_seq_len"] = args.max_seq_len
    cfg = None
    if images:  # the spans' lengths come from the config (no weights read)
        checkpoint_format(folder)
        cfg = read_config(folder, overrides)
        if args.language_model_only:
            cfg = cfg.language_model_only()
    prompt = _prompt_ids(args, tokenizer, cfg)
    if args.print_prompt_ids:
        print(json.dumps(prompt))
        return 0
    checkpoint_format(folder)
    cfg = read_config(folder, overrides)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if len(prompt) >= cfg.max_seq_len:
        raise InputError(f"the prompt is {len(prompt)} tokens but the cache holds max_seq_len={cfg.max_seq_len}, "
                         "which leaves no room for a reply; shorten the prompt or pass a larger --max-seq-len")
    mesh = mesh_of(args)
    cfg, model, report = load_on(folder, mesh, args.preset, args.engram, progress=not args.quiet,
                                 config_overrides=overrides, check_values=not args.no_value_check,
                                 language_model_only=args.language_model_only)
    if not args.quiet:
        print(report.summary(), file=sys.stderr)
    runtime = Runtime(mode="fast", impl=args.impl, check_finite=args.check_finite)
    stream = TextStream(tokenizer, skip_ids=[tokenizer.eos_id])

    def show(tok: int) -> None:
        if not args.json:
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()

    spec = None
    # --speculative dspark: the engine drafts a whole block per step (serving/speculation.py); it
    # refuses a model without the drafter, naming the missing mtp.* tensors, before compiling
    K = cfg.dspark_block_size if args.speculative == "dspark" else 0
    gen = Generator(cfg, model, tokenizer, runtime=runtime, mesh=mesh, preset=args.preset, speculative=K,
                    engram_host=args.engram == "host")
    spans = _spans(args, gen, tokenizer, prompt) if images else None
    result = gen.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, on_token=show, spans=spans)
    if K:
        # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
        from dsv41_jax.serving.speculation import summary

        spec = summary(gen.engine.spec_stats)
    if args.json:
        text = tokenizer.decode([t for t in result.tokens if t != tokenizer.eos_id])
        doc = {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
               "tokens": result.tokens, "text": text, "finish_reason": result.finish_reason}
        if spec is not None:
            doc["speculative"] = spec
        print(json.dumps(doc))
    else:
        sys.stdout.write("\n")
        if result.finish_reason == "cache_full":
            print(f"stopped: the cache is full (max_seq_len={cfg.max_seq_len})", file=sys.stderr)
    return 0


def _spans(args, gen, tokenizer, prompt):
    """The prompt's image spans: the vision tower and aligner over each image, on the loaded weights."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.serving.http.images import ImagePrompter

    messages, tools = _messages(args)
    made = ImagePrompter(gen.engine, _image_options()).build(tokenizer, messages, thinking=args.thinking,
                                                             effort=_effort(args), tools=tools)
    if made.tokens != prompt:  # both from the same files: only a file changed in between could do this
        raise InputError("an --image file changed while the model was loading; run again")
    return made.spans


def _cmd_generate(args) -> int:
    try:
        return _run(args)
    # InputError, CheckpointError, ConfigError, WeightError and the sampler's/tokenizer's checks
    # are all ValueErrors that carry a message meant for the user
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv41 generate: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the model's output, not the input, is at fault
        print(f"dsv41 generate: {e}", file=sys.stderr)
        return 1


def register(subparsers) -> None:
    s = subparsers.add_parser("generate", help="generate a reply from a checkpoint (streams to stdout)",
                              description="Chat-encode a prompt, run the checkpoint and stream the reply. Bad inputs exit with code 2.")
    s.add_argument("--checkpoint", required=True, metavar="DIR", help="HF or orbax checkpoint folder with tokenizer.json")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one user message")
    src.add_argument("--messages", metavar="FILE", help="JSON list of chat messages (or {\"messages\": [...], \"tools\": [...]}); "
                     "image_url parts take data URLs or absolute file paths")
    s.add_argument("--image", action="append", metavar="PATH", default=[],
                   help="an image file (PNG, JPEG, WebP, GIF) before the --prompt text; repeatable, in order. Needs a "
                        "checkpoint with a vision tower (docs/VISION.md)")
    s.add_argument("--effort", metavar="low|high|max|N", help="reasoning effort for thinking mode: a name from "
                   "--effort-table (default low/high/max = 50/75/100) or 1-100")
    s.add_argument("--effort-table", type=effort_table, default=None, metavar="NAME|name=N,...",
                   help="what --effort names mean: deepseek-api (the default) or v41-encoder (low/high/xhigh/max = "
                        "25/50/75/100, as vLLM's and SGLang's V4.1 encoders), or pairs like low=25,high=50,max=100")
    s.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="thinking mode (<think>) or chat mode (</think>, the default)")
    s.add_argument("--max-new-tokens", type=positive_int, default=256)
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0, the recommended setting)")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument("--max-seq-len", type=positive_int, default=None, help="cache length (default: the config's)")
    add_mesh_args(s)
    s.add_argument("--impl", choices=("xla", "pallas", "auto"), default="xla", help="attention/MoE implementation")
    s.add_argument("--speculative", choices=("dspark",), default=None,
                   help="speculative decoding with the checkpoint's DSpark drafter (mtp.* tensors), a block of drafts "
                        "per engine step; --json adds the steps / drafted / accepted counts and the mean acceptance length")
    s.add_argument("--json", action="store_true", help="print one JSON object (tokens, text, finish_reason) instead of streaming")
    s.add_argument("--quiet", action="store_true", help="no progress bar or load summary on stderr")
    s.add_argument("--print-prompt-ids", action="store_true",
                   help="print the chat-encoded prompt's token ids (a JSON list) and exit without loading weights")
    s.add_argument("--check-finite", action="store_true",
                   help="runtime NaN/inf guard: NaN attention rows are not zeroed as if masked, and non-finite logits stop "
                        "generation with an error (exit 1)")
    s.add_argument("--no-value-check", action="store_true",
                   help="skip the load-time NaN/inf check of the weights (saves one pass over a huge checkpoint)")
    s.add_argument("--language-model-only", action="store_true",
                   help="skip the vision tower, aligner and bias_vl tensors (text prompts only; docs/VISION.md)")
    s.set_defaults(func=_cmd_generate)
