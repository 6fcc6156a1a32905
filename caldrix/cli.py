"""The caldrix command line: serve, run, fetch, models, replay, bench. (`caldrix bench` runs the
benchmark against peers, bench/serve.py, from a source checkout: it needs the peers' own
packages; bench_command.py. `make bench` is the engine's benchmark, bench/decode.py.)

Exit status: 0 on success, 2 on bad arguments (argparse's own convention, and a bad flag value
names the flag), 1 on a model or engine failure. `caldrix run` exits 130 on Ctrl-C and 141 when
its reader goes away (a closed pipe), quietly, as shell tools do.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

# OpenMP's wait policy is left to the environment (see Engine.threads_for): its default (spin
# briefly, then sleep) measured fastest on a quiet machine; OMP_WAIT_POLICY=PASSIVE protects a
# machine shared with other busy processes, at some speed.

from caldrix import __version__
from caldrix.batch import MAX_DRAFT_TOKENS
from caldrix.config import DEFAULT_PORT, FlagError, ServeConfig
from caldrix.lanes import backend_refusal, settle_flags
from caldrix.protocol import SamplingParams


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        value = _int_at_least(lo)(text)
        if value > hi:
            raise argparse.ArgumentTypeError(f"must be {lo}..{hi}, got {value}")
        return value

    return parse


MAX_PORT = 65535
SEED_LIMIT = 2**64  # http-api.md: a seed is a non-negative integer below 2**64 (http.md)


def _seed(text: str) -> int:
    value = _int_at_least(-1)(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be -1 or an integer 0 <= seed < 2**64, got {value}")
    return value


def _origins(text: str) -> tuple[str, ...]:
    found = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in found:
        if o != "*" and not o.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"each origin is * or starts with http:// or https://, got {o!r}")
    return found


MAX_NGRAM = 16  # the longest suffix --ngram may look up


def _ngram(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX, two integers, got {text!r}") from None
    if not sep or not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    if b > MAX_NGRAM:
        # the lookup's index grows with MAX times the text's length, in the scheduler's task:
        # 2:512 over 1,000 tokens took 3 s and 800 MB, every stream waiting
        raise argparse.ArgumentTypeError(f"MAX must be at most {MAX_NGRAM}, got {text!r}")
    return a, b



def check_speculation(args: argparse.Namespace) -> str | None:
    """What is wrong with the speculation flags before any weight is loaded; None if nothing.
    What depends on the engine (whether it can verify exactly) is checked by runtime.py."""
    mode = args.speculate
    if mode == "draft" and args.draft is None:
        return "--speculate draft: needs --draft DIR|alias|GGUF, the draft model"
    if args.draft is not None and mode not in ("draft", "auto"):
        return "--draft: needs --speculate draft or auto"
    if args.speculation_memory is not None and mode not in ("draft", "auto"):
        return "--speculation-memory: keeps a draft model's tuner state; needs --speculate draft or auto"
    if mode in ("ngram", "draft") and args.max_batch > 1:
        return (f"--speculate {mode}: speculation decodes single-stream and this server is batched "
                f"(--max-batch {args.max_batch}); restart with --max-batch 1")
    if mode in ("ngram", "draft") and getattr(args, "weight_budget", None) is not None:
        return f"--speculate {mode}: refused with --weight-budget, which streams layers from host memory each pass"
    if mode == "off":
        for flag, value in (("--draft-tokens", args.draft_tokens), ("--ngram", args.ngram)):
            if value is not None:
                return f"{flag}: has no effect without --speculate" + (
                    " ngram or auto" if flag == "--ngram" else " ngram, draft or auto")
    if mode == "draft" and args.ngram is not None:
        return "--ngram: has no effect with --speculate draft (a draft model proposes, not the n-gram lookup)"
    return None


def _bytes(text: str) -> int:
    from caldrix.weight_budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _float_in(test, what: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--backend", choices=["auto", "cpu", "cuda", "hip", "host"], default="auto",
                   help="auto takes the GPU when torch sees one, else cpu; host runs the transformers reference")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="auto: bfloat16 on GPUs and CPUs with native bf16, else float32")
    g.add_argument("--weights", choices=["auto", "dense", "q4"], default="auto",
                   help="auto: a GGUF's Q4_1 blocks stay 4-bit on the cpu lane (bfloat16, or float32 on AVX2 CPUs); "
                        "dense: dequantized; q4: as auto, and a Hugging Face directory's weights rounded to 4-bit groups at load")
    g.add_argument("--context", type=_int_at_least(16), default=None,
                   help="KV rows per sequence (default: the model's maximum, capped at 8192)")
    g.add_argument("--max-batch", type=_int_at_least(1), default=None,
                   help="sequences per forward pass (default 1; 8 on the AMD lane, --backend hip)")
    g.add_argument("--sampler", choices=["device", "host"], default=None,
                   help="where sampled tokens are picked: device (the default on the GPU lanes; the AMD lane's "
                        "batched device pick) or host (the CPU pick of run.md)")
    g.add_argument("--weight-budget", type=_bytes, default=None, metavar="BYTES",
                   help="GPU lanes: bytes of weights kept on the device (e.g. 2GiB); the other layers stream "
                        "from pinned host memory each pass")
    g.add_argument("--prefill-chunk", type=_int_at_least(1), default=None,
                   help="prompt tokens per prefill chunk (default 512 where prompt chunks run beside decode steps, "
                        "else 128); a step packs chunks of several prompts up to 128 tokens, or this if less")
    g.add_argument("--served-name", default=None, help="the model name the server answers to")
    g.add_argument("--speculate", choices=["off", "ngram", "auto", "draft"], default="off",
                   help="speculative decoding, single-stream (--max-batch 1): ngram proposes from the request's own "
                        "tokens; draft has --draft's model guess; auto takes draft when --draft loads, else ngram, where the "
                        "server can verify")
    g.add_argument("--draft", default=None, metavar="DIR", help="draft model: a directory, alias or GGUF, as MODEL; it must share the model's vocabulary")
    g.add_argument("--draft-tokens", type=_int_in(1, MAX_DRAFT_TOKENS), default=None,
                   help=f"guesses per verify, 1..{MAX_DRAFT_TOKENS} (default: tuned live)")
    g.add_argument("--ngram", type=_ngram, default=None, metavar="MIN:MAX",
                   help="suffix lengths the n-gram lookup tries (default 2:4)")
    g.add_argument("--speculation-memory", default=None, metavar="FILE",
                   help="the draft tuner's state between runs (draft models only)")
    s = p.add_argument_group("sampling defaults (greedy unless set)")
    s.add_argument("--temperature", type=_float_in(lambda v: v >= 0, "a finite number >= 0"), default=0.0)
    s.add_argument("--top-k", type=_int_at_least(-1), default=0, help="0 or -1 keeps every token")
    s.add_argument("--top-p", type=_float_in(lambda v: 0 < v <= 1, "0 < p <= 1"), default=1.0)
    s.add_argument("--min-p", type=_float_in(lambda v: 0 <= v <= 1, "0 <= p <= 1"), default=0.0)
    s.add_argument("--repetition-penalty", type=_float_in(lambda v: v > 0, "a finite number > 0"), default=1.0)
    s.add_argument("--seed", type=_seed, default=None, help="default seed below 2**64; -1 or absent: fresh per request")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info", help="(default info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="caldrix", description="A local OpenAI-compatible server for small language models.")
    parser.add_argument("--version", action="version", version=f"caldrix {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve one model over the OpenAI API on http://localhost:8425")
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="a model directory, a .gguf file, a registry alias or a repo id (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_int_in(0, MAX_PORT), default=DEFAULT_PORT,
                       help=f"port (default {DEFAULT_PORT}; 0 takes a free one, and the start-up line names it)")
    serve.add_argument("--queue-depth", type=_int_at_least(0), default=64,
                       help="requests that may wait beyond those running; one more is a 429 (default 64)")
    serve.add_argument("--graceful-timeout", type=_float_in(lambda v: v >= 0, "a number of seconds >= 0"), default=30.0,
                       help="on SIGINT/SIGTERM, seconds running requests get to finish (default 30)")
    serve.add_argument("--replay-ring", type=_int_at_least(1), default=256, help="recent requests kept for /debug/requests (default 256)")
    serve.add_argument("--allowed-origins", type=_origins, default=(), metavar="ORIGINS",
                       help="browser origins allowed to call the API besides pages served from this machine: a comma list "
                            "such as https://app.example.com, or * for any (default: loopback pages only)")
    _engine_flags(serve)

    run = sub.add_parser("run", help="generate once and stream the text to stdout",
                         usage="caldrix run [MODEL] PROMPT [flags]")
    run.add_argument("args", nargs="+", metavar="[MODEL] PROMPT", help="PROMPT, or MODEL PROMPT; '-' reads the prompt from stdin")
    run.add_argument("--chat", action="store_true", help="render the prompt as one user message through the chat template")
    run.add_argument("--max-tokens", type=_int_at_least(1), default=None, help="cap on generated tokens")
    run.add_argument("--stop", action="append", default=[], help="a stop string (repeatable, up to 4)")
    run.add_argument("--ignore-eos", action="store_true")
    _engine_flags(run)

    fetch = sub.add_parser("fetch", help="download a registry model or a repo id into the Hugging Face cache",
                           description="Download a registry model or a repo id into the Hugging Face cache, where "
                                       "serve and run find it offline (docs/models.md).")
    fetch.add_argument("model", metavar="MODEL", help="a registry alias (caldrix models) or a repo id org/name")
    sub.add_parser("models", help="list the model registry",
                   description="List the model registry: each alias, its repo id, architecture and size, whether "
                               "it is on this machine, and notes.")

    sub.add_parser("bench", add_help=False,
                   help="the serving benchmark against llama.cpp and transformers, from a source checkout "
                        "(bench/serve.py; arguments pass through: caldrix bench --help)")
    replay = sub.add_parser("replay", help="replay a trace from the replay ring against a running server")
    replay.add_argument("trace", metavar="TRACE", help="a trace file (JSON lines, as GET /debug/trace exports)")
    replay.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the server (default %(default)s)")
    replay.add_argument("--concurrency", type=_int_at_least(1), default=None,
                        help="requests in flight at most (default: as the trace's arrivals come)")
    replay.add_argument("--speed", type=_float_in(lambda v: v > 0, "a number > 0"), default=1.0,
                        help="divide the arrival offsets by this (default 1)")
    replay.add_argument("--limit", type=_int_at_least(1), default=None, help="replay only the first N requests")
    replay.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


def config_from(args: argparse.Namespace, model: str | None) -> ServeConfig:
    if args.max_batch is None or args.sampler is None:  # not settled by main(): the lane's defaults
        settle_flags(args)
    seed = None if args.seed in (None, -1) else args.seed
    return ServeConfig(
        model=model,
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", DEFAULT_PORT),
        served_name=args.served_name,
        backend=args.backend,
        dtype=args.dtype,
        weights=args.weights,
        context=args.context,
        max_batch=args.max_batch,
        queue_depth=getattr(args, "queue_depth", 64),
        sampling=SamplingParams(
            temperature=args.temperature,
            top_k=max(args.top_k, 0),
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
        ),
        seed=seed,
        prefill_chunk=args.prefill_chunk,
        replay_ring=getattr(args, "replay_ring", 256),
        log_level=args.log_level,
        graceful_timeout=getattr(args, "graceful_timeout", 30.0),
        speculate=args.speculate,
        draft=args.draft,
        draft_tokens=args.draft_tokens,
        ngram=args.ngram or (2, 4),
        speculation_memory=args.speculation_memory,
        sampler=args.sampler,
        weight_budget=args.weight_budget,
        allowed_origins=getattr(args, "allowed_origins", ()),
    )


MAX_STOPS = 4
MAX_STOP_BYTES = 256  # as http-api.md's stop field: 1 to 256 bytes each


def stop_refusal(stops: list[str]) -> str | None:
    if len(stops) > MAX_STOPS:
        return f"--stop: at most {MAX_STOPS} stop strings, got {len(stops)}"
    for s in stops:
        if not 1 <= len(s.encode("utf-8")) <= MAX_STOP_BYTES:
            return f"--stop: each stop string is 1 to {MAX_STOP_BYTES} bytes, got {len(s.encode('utf-8'))}"
    return None


def _quietly(generate) -> int:
    """`caldrix run`'s generation, or `caldrix serve` (a Ctrl-C while its model loads), ended
    quietly by Ctrl-C (130) or by a reader that went away (141, as a shell tool killed by
    SIGPIPE): trio hands either back inside an exception group."""
    try:
        try:
            return generate()
        except BaseExceptionGroup as group:
            pipe, rest = group.split(BrokenPipeError)
            if pipe is not None and rest is None:
                raise BrokenPipeError from None
            interrupt, rest = group.split(KeyboardInterrupt)
            if interrupt is not None and rest is None:
                raise KeyboardInterrupt from None
            raise
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python would report the pipe again while flushing stdout at exit: point it at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def stdin_prompt(text: str, chat: bool) -> str:
    """The prompt `caldrix run -` read: exactly as sent, or for --chat less one final line end
    (echo's and a heredoc's are no part of a message typed as an argument)."""
    if chat and text.endswith("\n"):
        return text[:-2] if text.endswith("\r\n") else text[:-1]
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every argument is the benchmark's own, --help included
        from caldrix.bench_command import bench

        return bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from caldrix.weights.source import ModelNotFound

    if args.command in ("serve", "run"):
        wrong = settle_flags(args) or backend_refusal(args.backend) or check_speculation(args)
        if wrong:
            parser.error(wrong)
    try:
        if args.command == "serve":
            import trio

            from caldrix.server import serve

            # Ctrl-C while the model loads (server._load) ends it as it ends `caldrix run`: 130, quietly.
            return _quietly(lambda: trio.run(serve, config_from(args, args.model)) or 0)
        if args.command == "run":
            if len(args.args) > 2:
                parser.error("run takes [MODEL] PROMPT")
            model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
            wrong = stop_refusal(args.stop)
            if wrong:
                parser.error(wrong)
            from caldrix.run import run_once

            if prompt == "-":
                prompt = stdin_prompt(sys.stdin.read(), args.chat)
            if not prompt:
                parser.error("PROMPT: the prompt is empty")
            return _quietly(lambda: run_once(config_from(args, model), prompt, chat=args.chat,
                                             max_tokens=args.max_tokens, stops=tuple(args.stop),
                                             ignore_eos=args.ignore_eos))
        if args.command == "fetch":
            from caldrix.weights.commands import fetch

            return fetch(args.model)
        if args.command == "models":
            from caldrix.weights.commands import list_models

            return list_models()
        if args.command == "replay":
            from caldrix.replay import main as replay_main

            return replay_main(args.trace, args.url, concurrency=args.concurrency, speed=args.speed,
                               limit=args.limit, as_json=args.json)
    except KeyboardInterrupt:  # Ctrl-C before trio runs: importing torch takes seconds
        print(file=sys.stderr)
        return 130
    except ModelNotFound as exc:
        print(f"caldrix: {exc}", file=sys.stderr)
        return 1
    except FlagError as exc:  # a flag the loaded engine cannot honour
        print(f"caldrix: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # e.g. an unsupported architecture or a bad model directory
        print(f"caldrix: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
