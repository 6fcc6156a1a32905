"""Everything a running server holds, built once at start-up (blocking: loads weights)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Callable

import attrs

from caldrix.config import FlagError, ServeConfig
from caldrix.kernels.q4 import UNPACK_FROM_ROWS
from caldrix.lanes import (GPU_LANES, architecture_of, device_facts, device_line, lane_refusal, sampler_name,
                           uses_device_pick)
from caldrix.sched.loop import Scheduler
from caldrix.telemetry import Telemetry


@attrs.define(eq=False)
class Runtime:
    cfg: ServeConfig
    served_name: str
    origin: str
    model_dir: Path
    lane: str
    dtype_name: str
    engine: object  # engine.Engine or host_engine.HostEngine: both have step(), context, vocab_size
    tokenizer: object  # tokenizer.Tokenizer
    scheduler: Scheduler
    # Speculation as resolved at start (None: off), and why auto left it off or changed it.
    speculation: object = None  # sched.speculate.SpecConfig | None
    notes: tuple[str, ...] = ()
    # The model's decider_config.json, read at load (caldrix.decider.Decider), or None.
    decider: object = None
    # The replay ring and the metrics (telemetry.py); fed by the scheduler's on_finish hook.
    telemetry: Telemetry = attrs.field(default=attrs.Factory(lambda rt: rt._new_telemetry(), takes_self=True))

    def __attrs_post_init__(self) -> None:
        if self.scheduler.on_finish is None:
            self.scheduler.on_finish = self.telemetry.on_finish

    def _new_telemetry(self) -> Telemetry:
        return Telemetry.create(self.served_name, self.cfg.replay_ring, lane=self.lane, dtype=self.dtype_name,
                                max_batch=self.cfg.max_batch, prefill_chunk=self.cfg.prefill_chunk,
                                context=getattr(self.engine, "context", None),
                                vocab_size=getattr(self.engine, "vocab_size", None),
                                # what picks, not what was asked: only an engine that makes the
                                # device pick (picks_on_device) records "device"
                                sampler=sampler_name(self.lane, self.cfg.max_batch, self.cfg.sampler)
                                if getattr(self.engine, "picks_on_device", False) else "cpu")

    @property
    def context(self) -> int:
        return self.engine.context

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def announce(self, say: Callable[[str], None]) -> None:
        """The start-up lines of cli.md, one fact each."""
        cfg = self.cfg
        say(f"caldrix: model {self.served_name} ({self.origin})")
        say(f"caldrix: lane {self.lane}")
        if self.lane in GPU_LANES:
            say(device_line(self.lane, *device_facts()))
        int4 = getattr(self.engine, "int4_layers", 0)
        if getattr(self.engine, "quantized", False):
            weights = f", {int4} layers rounded to 4-bit groups at load (--weights q4)"
        else:
            weights = f", {int4} projections kept as 4-bit GGUF blocks" if int4 else ""
        if getattr(self.engine, "int4_head", False):
            weights += ", the lm_head as Q8_0 blocks"
            if getattr(self.engine, "q8_embed", False):
                weights += " (the embedding read from them)"
        if getattr(self.engine, "scripted_rows", False):
            weights += "; decode layers scripted"
        if getattr(self.engine, "native_attend", False):
            weights += "; decode attention compiled"
        if getattr(self.engine, "int4_ours", False):
            weights += "; 4-bit matmuls compiled"
            if getattr(self.engine, "unpacks_prompts", False):
                weights += f", prompt chunks past {UNPACK_FROM_ROWS} rows unpacked for AMX"
        say(f"caldrix: dtype {self.dtype_name}{weights}")
        plan = getattr(self.engine, "weight_plan", None)
        if plan is not None:
            say(plan.line())
        say(f"caldrix: context {self.context} rows per sequence")
        if getattr(self.engine, "overlap_lanes", False):
            lanes = "beside decode steps, one core each"
        else:
            why = getattr(self.engine, "lanes_why", None)
            lanes = "between decode steps" + (f" ({why})" if why else "")
        say(f"caldrix: max-batch {cfg.max_batch}, queue-depth {cfg.queue_depth}, prefill chunks of {cfg.prefill_chunk} {lanes}")
        scratch = " and a scratch slot" if getattr(self.engine, "pad_decode", False) else ""
        slots = f"{cfg.max_batch} slot" + ("s" if cfg.max_batch > 1 else "")
        if self.lane == "host":  # transformers' own cache, grown per request: nothing held ahead
            say(f"caldrix: KV cache grown per request by transformers ({slots}, up to {self.context} rows each)")
        else:
            say(f"caldrix: KV cache {self.engine.kv_bytes / 2**20:.1f} MiB ({slots}{scratch}, {self.context} rows each)")
        if self.decider is not None:
            from caldrix.decider.config import startup_lines

            for line in startup_lines(self.decider.config):
                say(f"caldrix: {line}")
        for note in self.notes:
            say(f"caldrix: note: {note}")
        spec = self.speculation
        if spec is None:
            say("caldrix: speculation off")
        else:
            length = f"{spec.draft_tokens} guesses" if spec.draft_tokens else "guesses tuned live"
            how = f"draft {self.cfg.draft}" if spec.mode == "draft" else f"ngram {spec.min_n}:{spec.max_n}"
            say(f"caldrix: speculation {how}, {length}, for greedy requests")


# The torch device each lane's engine runs on: ROCm torch presents an AMD GPU as "cuda".
LANE_DEVICES = {"cpu": "cpu", "host": "cpu", "cuda": "cuda", "hip": "cuda"}


def _int4_source(cfg: ServeConfig, model_dir: Path, lane: str, dtype) -> Path | None:
    """--weights auto keeps a GGUF's 4-bit blocks when the engine can run them: the cpu lane,
    bfloat16, or float32 where caldrix::q4_mm_f32 is built. --weights dense always uses the
    dequantized weights."""
    from caldrix.kernels import q4
    from caldrix.weights.gguf import source_gguf

    if cfg.weights not in ("auto", "q4") or lane != "cpu" or not q4.runs_4bit(dtype, "cpu"):
        return None
    return source_gguf(model_dir)


# The architectures whose loader rounds dense weights to 4-bit groups (`--weights q4`).
QUANTIZES = ("llama", "qwen3", "qwen3_5", "qwen3_5_text")


def _quantize(cfg: ServeConfig, model_dir: Path, lane: str, dtype) -> bool:
    """--weights q4: whether the loader rounds the weights to 4-bit groups at load
    (kernels/q4_quantize.py). A model from a GGUF keeps its own blocks instead, as with auto.
    FlagError, before anything loads, where the model or the engine cannot."""
    from caldrix.kernels import q4_quantize
    from caldrix.weights.gguf import source_gguf

    if cfg.weights != "q4" or source_gguf(model_dir) is not None:
        return False
    arch = architecture_of(model_dir)
    if arch not in QUANTIZES:
        raise FlagError(f"--weights q4: rounding weights to 4 bits at load is for text models ({', '.join(QUANTIZES)}), "
                        f"not {arch}")
    if lane != "cpu" or not q4_quantize.usable(dtype, "cpu"):
        raise FlagError(f"--weights q4 needs the cpu lane and bfloat16 (torch's int4 kernel), not "
                        f"{str(dtype).removeprefix('torch.')} on the {lane} lane")
    return True


def memory_refusal(exc: BaseException, cfg: ServeConfig) -> str | None:
    """A one-line refusal naming --context and --max-batch when loading ran out of memory (the
    KV cache is the allocation that grows with them); None for any other error."""
    text = str(exc)
    if not isinstance(exc, MemoryError) and "allocate" not in text and "out of memory" not in text.lower():
        return None
    detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    context = cfg.context if cfg.context is not None else "(the model's)"
    return (f"--context {context} with --max-batch {cfg.max_batch}: the model and its KV cache do not fit in "
            f"memory ({detail}); lower --context or --max-batch")


def context_notes(engine) -> tuple[str, ...]:
    """A note when --context asks for more rows than the model's trained positions: allowed (as
    llama-server allows it), but a reply that runs past them may degrade."""
    trained = getattr(getattr(getattr(engine, "model", None), "cfg", None), "max_positions", None)
    if isinstance(trained, int) and engine.context > trained:
        return (f"--context {engine.context} is past the {trained} positions the model was trained for "
                "(max_position_embeddings); text past them may degrade",)
    return ()


def load_runtime(cfg: ServeConfig) -> Runtime:
    from caldrix.decider import config as dconfig
    from caldrix.decider.plan import Decider
    from caldrix.engine import Engine, resolve_dtype
    from caldrix.engine_probes import PREFILL_CHUNK
    from caldrix.weights.source import resolve
    from caldrix.sched.policy import Policy
    from caldrix.sched.slots import SlotTable
    from caldrix.tokenizer import Tokenizer

    src = resolve(cfg.model)
    # A decider_config.json beside the weights makes the model a decider. It is checked before
    # the weights load: a config that cannot be served stops the load, naming the file and the key.
    found = dconfig.find(src.path)
    decider_cfg = dconfig.load(found) if found is not None else None
    lane = pick_lane(cfg.backend)
    refused = lane_refusal(architecture_of(src.path), lane)
    if refused is not None:
        raise FlagError(refused)
    device = LANE_DEVICES[lane]
    dtype = resolve_dtype(cfg.dtype, device)
    quantize = _quantize(cfg, src.path, lane, dtype)  # refused here, before anything loads
    if cfg.weight_budget is not None:
        from caldrix.weight_budget import budget_refusal

        # before loading, from the files' headers: a budget no plan fits exits 2 at once
        refused = budget_refusal(cfg.weight_budget, src.path, dtype.itemsize)
        if refused is not None:
            raise FlagError(refused)
    try:
        if lane == "host":
            from caldrix.host_engine import HostEngine

            engine = HostEngine(src.path, dtype=dtype, max_batch=cfg.max_batch, context=cfg.context)
        else:
            engine = Engine.load(src.path, dtype=dtype, max_batch=cfg.max_batch, context=cfg.context, device=device,
                                 int4_from=_int4_source(cfg, src.path, lane, dtype), weight_budget=cfg.weight_budget,
                                 quantize=quantize)
    except (MemoryError, RuntimeError) as exc:
        refused = memory_refusal(exc, cfg)
        if refused is None:
            raise
        raise FlagError(refused) from None
    if lane != "host":
        # the AMD lane's batched pick (http-api.md "Sampling"); the telemetry names it from this
        engine.picks_on_device = uses_device_pick(lane, cfg.max_batch, cfg.sampler)
    if cfg.prefill_chunk is None:
        cfg = attrs.evolve(cfg, prefill_chunk=getattr(engine, "default_prefill_chunk", PREFILL_CHUNK))
    tokenizer = Tokenizer.load(src.path)
    identity: list[str] = []
    try:
        speculation, notes = resolve_speculation(
            cfg, lane, engine, lambda: identity.append(load_draft(cfg, lane, engine, tokenizer, src.path)))
    except DraftRefused as e:
        raise e.args[0] from None
    notes = (*kernel_notes(lane), *context_notes(engine), *notes)
    if tokenizer.vocab_size > engine.vocab_size:  # added tokens the embedding was never resized for
        notes = (*notes, f"the tokenizer has {tokenizer.vocab_size} tokens and the model embeds {engine.vocab_size}; "
                         "a prompt holding one of the others is refused (400)")
    # A step packs short prompts up to PREFILL_CHUNK tokens however long a chunk may be (a long
    # prompt's chunk still runs, alone): eight short prompts in one 512-token step waited for
    # each other, 8-stream TTFT p50 about 430 against 290 ms (bench/serve.py --quick, AMX Xeon).
    policy = Policy(SlotTable(cfg.max_batch, reuse_rows=getattr(engine, "reuses_rows", True)), chunk=cfg.prefill_chunk,
                    prefill_budget=min(cfg.prefill_chunk, PREFILL_CHUNK), speculation=speculation)
    if identity and cfg.speculation_memory:
        notes = (*notes, *speculation_memory(cfg, policy, identity[0]))
    decider = None if decider_cfg is None else Decider.from_config(decider_cfg, tokenizer, engine.vocab_size)
    rt = Runtime(
        cfg=cfg,
        served_name=cfg.served_name or src.served_name,
        origin=src.origin,
        model_dir=src.path,
        lane=lane,
        dtype_name=str(dtype).removeprefix("torch."),
        engine=engine,
        tokenizer=tokenizer,
        scheduler=Scheduler(engine, policy),
        decider=decider,
        speculation=speculation,
        notes=notes,
    )
    release_freed_heap()
    return rt


def speculation_memory(cfg: ServeConfig, policy, identity: str) -> tuple[str, ...]:
    """--speculation-memory under a draft model: the policy's tuner starts from the file's state
    (unless --draft-tokens fixes the length) and saves it back; notes for a foreign, corrupt or
    unreadable file (a fresh start) and for a path that cannot be written."""
    from caldrix.sched.spec_memory import SpeculationMemory

    memory = SpeculationMemory(Path(cfg.speculation_memory), identity)
    state, note = memory.load()
    if state is not None:
        policy.tuner.restore(state)
    policy.memory = memory
    # Written once now, so a path that cannot be written is said at start, not at the end.
    unwritable = memory.save(policy.tuner.state())
    return tuple(n for n in (note, unwritable) if n)


def pick_lane(backend: str) -> str:
    """--backend: auto is cuda (or hip) where torch sees a GPU, else cpu (lanes.py's rule, the one
    the CLI settled its defaults by)."""
    import caldrix.lanes

    return caldrix.lanes.resolve_lane(backend, caldrix.lanes.gpu_seen() if backend == "auto" else None)


def release_freed_heap() -> bool:
    """Give back to the OS the heap pages that loading freed; whether it could (glibc only).

    Loading's temporaries (the GGUF's blocks unpacked, the kernels' layouts built from them)
    are freed before serving starts, but glibc keeps their pages for later allocations: for
    SmolLM2's 4-bit load about 110 MiB of resident memory no step ever uses. Done once, after
    loading; serving's own allocations then come from the heap as before (a page given back
    faults in once, the first time a step reuses it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc's; musl has none
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def kernel_notes(lane: str) -> tuple[str, ...]:
    """A start-up note where the cpu lane runs without its compiled kernels (kernels/native.py):
    the server still answers the same, but decodes several times slower, which a log warning
    alone would hide."""
    from caldrix.kernels import native

    why = native.why_torch() if lane == "cpu" else None
    if why is None:
        return ()
    return (f"the compiled decode kernels are off ({why}): decode runs on plain torch ops, several times slower",)


def resolve_speculation(cfg: ServeConfig, lane: str, engine, load_draft=None) -> tuple[object, tuple[str, ...]]:
    """--speculate against the loaded engine: (SpecConfig or None, notes for the start-up).

    An explicit ngram or draft is refused (FlagError, exit 2) where the engine's probe finds
    that a verify pass does not compute each row exactly as a decode step (Engine.check_verify),
    or the server is batched or streams its weights; auto turns itself off there with a note.
    `load_draft()` loads --draft into the engine (load_draft below); under auto a draft that
    fails to load gives way to n-gram lookup with a note, but a draft whose vocabulary is not
    the target's refuses the start in either mode (DraftRefused)."""
    from caldrix.config import FlagError
    from caldrix.sched.speculate import SpecConfig

    notes: list[str] = []
    if cfg.speculate == "off":
        return None, ()
    why = None
    if cfg.weight_budget is not None:
        from caldrix.weight_budget import speculation_refusal

        why = speculation_refusal(cfg.weight_budget)
    elif cfg.max_batch > 1:
        why = f"the server is batched (--max-batch {cfg.max_batch}); speculation decodes single-stream"
    elif not hasattr(engine, "check_verify"):
        why = f"the {lane} lane runs the transformers reference, which has no verify pass"
    else:
        why = engine.check_verify()
    if why is not None:
        if cfg.speculate != "auto":
            raise FlagError(f"--speculate {cfg.speculate}: {why}")
        return None, (f"speculation off: {why}",)
    mode = "ngram"
    if cfg.speculate == "draft" or (cfg.speculate == "auto" and cfg.draft is not None):
        try:
            load_draft()
            mode = "draft"
        except DraftRefused:
            raise
        except Exception as e:  # noqa: BLE001 - any load failure: refused, or n-gram under auto
            if cfg.speculate == "draft":
                raise FlagError(f"--draft {cfg.draft}: did not load ({e})") from e
            notes.append(f"--draft {cfg.draft}: did not load ({e}); n-gram lookup instead"
                         + (", and --speculation-memory is neither read nor written" if cfg.speculation_memory else ""))
    elif cfg.speculation_memory:
        notes.append("--speculation-memory holds a draft model's state: neither read nor written under n-gram lookup")
    return (SpecConfig(min_n=cfg.ngram[0], max_n=cfg.ngram[1], draft_tokens=cfg.draft_tokens, mode=mode),
            tuple(notes))


class DraftRefused(Exception):
    """A draft that loaded but cannot serve the target (another vocabulary): the start fails."""


def load_draft(cfg: ServeConfig, lane: str, engine, tokenizer, model_dir: Path) -> str:
    """Load --draft as MODEL is loaded, in its own one-slot Engine on the same lane, and give
    the target engine its proposer (engine.drafter). The draft keeps 4-bit GGUF blocks where
    the lane runs them, whatever --weights says (it is there to be fast; the target verifies).
    Returns the pair's identity for --speculation-memory. DraftRefused where the vocabularies
    differ or the draft cannot take back rows; any other exception: the draft did not load."""
    from caldrix.config import FlagError
    from caldrix.draft import DraftProposer, model_identity, vocab_mismatch
    from caldrix.engine import Engine
    from caldrix.tokenizer import Tokenizer
    from caldrix.weights.source import resolve

    src = resolve(cfg.draft, progress=False)
    draft_tok = Tokenizer.load(src.path)
    dtype = engine.dtype
    draft = Engine.load(src.path, dtype=dtype, max_batch=1, context=engine.context, device=engine.device,
                        int4_from=_int4_source(attrs.evolve(cfg, weights="auto"), src.path, lane, dtype))
    differs = vocab_mismatch(model_dir, src.path, tokenizer, draft_tok, engine.vocab_size, draft.vocab_size)
    if differs is None and not draft.reuses_rows:
        differs = "the draft keeps a recurrent state, which cannot take back a rejected guess"
    if differs is not None:
        raise DraftRefused(FlagError(f"--draft {cfg.draft}: cannot draft for this model: {differs}"))
    engine.drafter = DraftProposer(draft)
    return f"target={model_identity(model_dir)} draft={model_identity(src.path)}"
