"""The engine: owns the model, the KV cache and the sampler; one synchronous `step(Batch)`.

Why one file of a little over 400 lines: the step and the per-slot bookkeeping (snapshots,
embeddings, draft runs) read and write the same private state (`_rows`, `_snapshots`, the state
tensors), which this class alone keeps consistent; what does not touch that state lives
elsewhere. The two start-up probes, and what their answers decide (the default prefill chunk
included), are in engine_probes.py (through the public decode passes, `decode_hidden` and
`decode_logits`; check_lanes and check_verify here keep the answers and empty the probe's
slot), the device pick's batching in device_pick.pick_runs, the layer streaming in
weight_budget.stream_layers.

Contract: `step` blocks for one forward pass and must be called from one thread at a time (the
scheduler runs it in a worker thread through a limiter of one). It never touches trio, routes or
sequences: it sees slots, positions and token ids only.

Numerics: a reply must not depend on its batch mates. The dense matmuls can give a row a
different result with a different row count, so a dense engine pads every decode step to
`max_batch` rows; the 4-bit kernel gives each row the same result whatever the row count, so a
4-bit engine runs only the active rows (both guarded by tests/test_engine.py and
tests/test_int4.py batch-invariance tests). Attention runs per slot over exactly that slot's rows, and each prefill chunk is its own
forward pass. Where a call may take either the 4-bit or the dense kernel (torch's int4 kernel
keeps dense weights for prefill chunks; caldrix's unpacks its blocks for long chunks on CPUs
with AMX, kernels/q4.py), the choice depends on its row count against fixed numbers and on the
CPU, never on how many requests are running.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import attrs
import torch

from caldrix import engine_probes, memory
from caldrix.batch import MAX_DRAFT_TOKENS, Batch, Run, RunOutput, StepOutput
from caldrix.models import loader
from caldrix.models.base import Attend, Loaded, Snapshot
from caldrix.device_pick import pick_runs
from caldrix.sampler import greedy_batch, pick_run, plain_greedy
from caldrix.weight_budget import stream_layers

log = logging.getLogger("caldrix")

PARALLEL_PREFILL_TOKENS = 256  # prompt tokens in a step from which every core is used


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """--dtype: auto is bfloat16 on GPUs and on CPUs with native bf16, else float32."""
    if name == "auto":
        return torch.bfloat16 if device != "cpu" or cpu_has_native_bf16() else torch.float32
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
            "float16": torch.float16, "fp16": torch.float16}[name]


class Engine:
    """Runs Batches on a model (models/base.py's contract) with `max_batch` slots of `context`
    rows; the llama family's Decoder is today's, loaded by Engine.load."""

    def __init__(self, model, *, max_batch: int, context: int, device: str = "cpu", pad_decode: bool = True):
        self.model = model
        self.max_batch = max_batch
        self.context = context
        self.device = device
        self.dtype = model.dtype
        self.vocab_size = model.cfg.vocab_size
        # Whether a slot's held rows may be reused up to any common prefix (attention-only
        # models), or only whole / from a snapshot (a recurrent state): the slot table asks.
        self.reuses_rows = bool(getattr(type(model), "reuses_rows", True))
        # The dense matmuls give a row a different result with a different row count (the
        # 4-bit kernel does not): a dense engine pads every decode step to max_batch rows,
        # and the padding rows write into one extra, scratch slot.
        self.pad_decode = pad_decode and max_batch > 1
        self.state = type(model).new_state(model.cfg, max_batch + self.pad_decode, context, self.dtype, device)
        if hasattr(model, "setup"):
            model.setup(context)
        self.int4_layers = 0  # projections kept as 4-bit GGUF blocks, or rounded to them at load
        self.quantized = False  # rounded at load (--weights q4, kernels/q4_quantize.py)
        self.int4_head = False  # the lm_head kept as the GGUF's Q8_0 blocks (kernels/q4.py)
        self.q8_embed = False  # and the tied embedding read from them (llama_load.embed_from_head)
        self.int4_ours = False  # the 4-bit matmuls run caldrix's kernel (q4mm.cpp, q4mm_f32.cpp), not torch's
        # Long prompt chunks unpack the 4-bit blocks for oneDNN's AMX matmul (kernels/q4.py).
        self.unpacks_prompts = any(getattr(m, "unpack_rows", None) is not None for m in model.modules())
        self.can_verify = False  # set by check_verify(), which speculation runs once at start
        # Why a decode step and a prefill chunk may not run at once (None: they may), set by
        # check_lanes(), which Engine.load runs; an engine built otherwise runs one step at a time.
        self.lanes_why: str | None = "not checked"
        self.lanes_chunk = engine_probes.PREFILL_CHUNK  # the default prefill chunk check_lanes() found
        self.scripted_rows = False  # decode-form layers run as one TorchScript call (kernels/scripted.py)
        self.scripted_pass = False  # and the embedding, head and arg-max with them (scripted.decode_logits)
        # Decode-form attention through the compiled kernel (kernels/native.py), for every decode
        # pass or none: its bits are not SDPA's, and a reply must not depend on the step.
        self.native_attend = bool(model.uses_native(device)) if hasattr(model, "uses_native") else False
        self.max_threads = torch.get_num_threads()
        self.passive_omp = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
        # Mirror of the token ids in each slot's rows: the repetition penalty reads it.
        self._rows: list[list[int]] = [[] for _ in range(max_batch)]
        # Input embeddings that runs name by key (Run.embeds): put before the request is
        # submitted, dropped by the scheduler when it ends (drop_embeddings).
        self.embeddings: dict[int, torch.Tensor] = {}
        # Snapshots by key (Run.snapshot, Run.restore): the state's own, and the slot's token ids then.
        self._snapshots: dict[int, tuple[Snapshot | None, tuple[int, ...]]] = {}  # None: spoiled
        # --speculate draft: the draft model's proposer (draft.py), set by the runtime.
        self.drafter = None
        # --weight-budget: the plan of which layers stream (weight_budget.WeightPlan), or None
        self.weight_plan = None
        # Sampled tokens through the device pick (device_pick.py: the AMD lane batched, with
        # --sampler device), all of a step's in one call; else the CPU pick. Set by the runtime
        # where lanes.uses_device_pick says so; greedy rows take the arg-max either way.
        self.picks_on_device = False

    @property
    def kv(self):
        """The per-slot state (a KVCache for the llama family)."""
        return self.state

    @classmethod
    def load(cls, path: Path, *, dtype: torch.dtype, max_batch: int, context: int | None, device: str = "cpu",
             int4_from: Path | None = None, weight_budget: int | None = None, quantize: bool = False) -> "Engine":
        """Load a Hugging Face directory through its architecture's loader (models/__init__.py).
        `int4_from`: the GGUF the directory was converted from; its Q4_1 projections then stay
        4-bit (the CPU only: bfloat16, or float32 where caldrix::q4_mm_f32 is built).
        `weight_budget`: at most that many bytes of weights on `device`, the other decoder
        layers streamed from host memory each pass (weight_budget.stream_layers; the model is
        loaded on the CPU unpacked first); BudgetError if the budget cannot hold a plan.
        `quantize` (`--weights q4`): the loader rounds the weights to 4-bit groups (ValueError
        where the architecture or dtype cannot)."""
        stream = weight_budget is not None
        # Up to a verify pass's rows, whatever --speculate says, so a prompt of a few tokens
        # takes the same kernels with speculation or without.
        got: Loaded = loader(path)(path, dtype=dtype, device="cpu" if stream else device, int4_from=int4_from,
                                   max_batch=max_batch, int4_rows=max(max_batch, 1 + MAX_DRAFT_TOKENS),
                                   pack=not stream, quantize=quantize)
        model = got.model
        weight_plan = stream_layers(model, weight_budget, device) if stream else None
        ctx = min(getattr(model.cfg, "max_positions", 8192), 8192) if context is None else context
        if device == "cpu":
            memory.check_state_fits(model, max_batch + (got.row_count_dependent and max_batch > 1), ctx)
        engine = cls(model, max_batch=max_batch, context=ctx, device=device, pad_decode=got.row_count_dependent)
        engine.int4_layers, engine.int4_head, engine.q8_embed = got.int4_layers, got.int4_head, got.q8_embed
        engine.int4_ours, engine.scripted_rows, engine.scripted_pass = got.int4_ours, got.scripted_rows, got.scripted_pass
        engine.weight_plan = weight_plan
        engine.quantized = quantize
        engine.check_lanes()
        return engine

    def threads_for(self, prefill_tokens: int) -> int:
        """Threads for a step. Long prefill chunks are compute-bound and use every core. For
        decode it depends on how idle OpenMP threads wait. Measured on 2 cores, SmolLM2 4-bit,
        ms per decode step at 1 / 8 streams:
          default policy (spin briefly, then sleep): 1 thread 14.5 / 38.9, 2 threads 13.6 / 30.4
          OMP_WAIT_POLICY=PASSIVE (sleep at once):   1 thread 15.4 / 39.4, 2 threads 23.7 / 58.5
        so under PASSIVE (a machine shared with busy processes, and the test suite) decode
        steps and small chunks take one thread, where each wake-up would cost more than the
        small operation it helps with."""
        if prefill_tokens >= PARALLEL_PREFILL_TOKENS or not self.passive_omp:
            return self.max_threads
        return 1

    @property
    def default_prefill_chunk(self) -> int:
        """--prefill-chunk when the flag is not given (engine_probes.PREFILL_CHUNK_LANES says why
        two values): the chunk size check_lanes() found, where the lanes overlap."""
        return self.lanes_chunk if self.overlap_lanes else engine_probes.PREFILL_CHUNK

    @property
    def overlap_lanes(self) -> bool:
        """Whether a decode step and a prefill step may run at once, on one core each, in two
        threads (they touch disjoint slots; `_rows` and the KV cache are per slot): only where
        check_lanes() found a step's bits the same on one thread as on all of them."""
        return self.lanes_why is None

    @torch.inference_mode()
    def check_lanes(self) -> str | None:
        """Whether this engine's steps give the same bits on one thread as on `max_threads`:
        None if they do, else why not. The answer is kept in `lanes_why`, and the chunk size
        that passed in `lanes_chunk`.

        Overlapped lanes run a decode step and a prefill chunk on one core each, and either
        alone on every core, so a reply would otherwise depend on whether another prompt was
        arriving. Measured, not assumed (engine_probes.lanes says how); it runs before the
        scheduler has admitted anything and leaves slot 0 empty."""
        try:
            why, chunk = engine_probes.lanes(self)
        finally:
            self._rows[0] = []
        self.lanes_why, self.lanes_chunk = why, chunk
        return why

    @property
    def kv_bytes(self) -> int:
        return self.state.nbytes

    @torch.inference_mode()
    def check_verify(self) -> str | None:
        """Whether a speculative verify pass gives each of its rows exactly what a one-row
        decode step at that position gives: None if it does, else why not
        (engine_probes.verify_differs says how it is measured). The answer is cached in
        `can_verify`; until this runs, the engine refuses verify runs."""
        if self.pad_decode:
            why = "a batched dense engine pads its decode steps, so its rows are not a one-row step's"
        elif not self.reuses_rows:
            why = "the model keeps a recurrent state, which cannot take back a rejected guess"
        else:
            try:
                why = engine_probes.verify_differs(self)
            finally:
                self._rows[0] = []
        self.can_verify = why is None
        return why

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        if any(r.draft for r in batch.runs):
            return self._step_drafted(batch)
        decode = [r for r in batch.runs if len(r.token_ids) == 1 or r.verify]
        prefill = [r for r in batch.runs if len(r.token_ids) > 1 and not r.verify]
        # Set per step, in whichever worker thread runs it (OpenMP's count is per thread).
        torch.set_num_threads(batch.threads or self.threads_for(sum(len(r.token_ids) for r in prefill)))
        assert len({r.slot for r in batch.runs}) == len(batch.runs), "one run per slot per step"
        assert self.can_verify or not any(r.verify for r in batch.runs), "this engine cannot verify"
        for r in batch.runs:
            assert r.end <= self.context, f"run past the context: {r.end} > {self.context}"
            if r.restore:
                self.restore(r.restore, r.slot, at=r.start)
            if self._snapshots:
                self._spoil(r.slot, r.start)
            rows = self._rows[r.slot]
            del rows[r.start :]
            rows.extend(r.token_ids)

        picked: dict[int, list[int]] = {}  # id(run) -> tokens
        reads: dict[int, list[float]] = {}
        sampled: list[tuple[Run, torch.Tensor]] = []  # runs not picked yet, with their rows' logits
        if decode:
            logits, top = self.decode_logits(decode)  # [rows, V]: the runs' rows in order, then padding
            first = [0]  # first[i]: decode[i]'s first row
            for r in decode:
                first.append(first[-1] + len(r.token_ids))
            # Plain greedy rows share one arg-max call (exact, so it cannot depend on batch mates);
            # at 8 rows that is about 0.4 ms a step less than one call per row. The scripted pass
            # made that call already (`top`, every row's arg-max).
            plain = [i for i, r in enumerate(decode) if r.pick_at and plain_greedy(r)]
            rows = [first[i] + o for i in plain for o in decode[i].pick_at]
            shared = top is not None or len(rows) > 1
            if shared:
                tokens = iter([top[j] for j in rows] if top is not None else greedy_batch(logits[rows]))
            for i in plain if shared else ():
                r = decode[i]
                picked[id(r)] = [next(tokens) for _ in r.pick_at]
                last = first[i] + r.pick_at[-1]
                reads[id(r)] = logits[last, list(r.read_ids)].tolist() if r.read_ids else []
            for i, r in enumerate(decode):
                if r.pick_at and id(r) not in picked:
                    sampled.append((r, logits[[first[i] + o for o in r.pick_at]]))
        for r in prefill:
            embeds, embed_rows = self._embeds([r])
            rows = torch.arange(r.start, r.end, device=self.device)
            at = Attend("prefill", (r.slot,), rows, rows, embeds=embeds, embed_rows=embed_rows, start=r.start)
            hidden = self.model(torch.tensor(r.token_ids, device=self.device), at, self.state)
            # A probe's few label logits, not the whole head (248k rows for Qwen3.5), where the
            # model can give them (read_logits; None where it keeps no plain head rows).
            reader = getattr(self.model, "read_logits", None) if r.read_only and r.read_ids else None
            got = reader(hidden[list(r.pick_at[-1:])], r.read_ids) if reader is not None else None
            if got is not None:
                picked[id(r)], reads[id(r)] = [], got.tolist()
            elif r.pick_at:
                sampled.append((r, self.model.logits(hidden[list(r.pick_at)])))
        self._pick(sampled, picked, reads)
        for r in batch.runs:
            if r.snapshot:
                assert not r.verify, "a verify run's rows past its kept guesses are thrown away: no snapshot"
                self.snapshot(r.slot, r.end, r.snapshot)
        return StepOutput(
            tuple(RunOutput(tuple(picked.get(id(r), ())), tuple(reads.get(id(r), ()))) for r in batch.runs)
        )

    def _pick(self, sampled: list[tuple[Run, torch.Tensor]], picked: dict, reads: dict) -> None:
        """The tokens of `sampled` runs (each with its rows' fp32 logits [len(pick_at), V]) into
        `picked` and their read logits into `reads`, by id(run): the CPU pick (sampler.pick_run)
        run by run, on host copies of the logits; or, with picks_on_device, every sampled row of
        the step in one device pick (device_pick.pick_runs), plain greedy runs still by arg-max
        (the two picks agree there)."""
        batched = []
        for r, logits in sampled:
            if self.picks_on_device and not plain_greedy(r):
                batched.append((r, logits, self._rows[r.slot]))
            else:
                picked[id(r)], reads[id(r)] = pick_run(r, logits.cpu(), self._rows[r.slot])
        for (r, _, _), (tokens, read) in zip(batched, pick_runs(batched) if batched else ()):
            picked[id(r)], reads[id(r)] = tokens, read

    def _step_drafted(self, batch: Batch) -> StepOutput:
        """A step with draft runs: the draft model proposes each one's guesses, then the step
        verifies them as the verify runs they become (Run.draft)."""
        assert self.drafter is not None, "a draft run without a draft model"
        runs, drafted = [], []
        for r in batch.runs:
            guesses = ()
            if r.draft:
                assert len(r.token_ids) == 1 and not r.restore, "a draft run is one decode token"
                known = self._rows[r.slot][: r.start] + list(r.token_ids)
                guesses = self.drafter.propose(known, min(r.draft, self.context - r.end), batch.threads)
                r = attrs.evolve(r, token_ids=r.token_ids + guesses, pick_at=tuple(range(1 + len(guesses))),
                                 verify=bool(guesses), draft=0)
            runs.append(r)
            drafted.append(guesses)
        out = self.step(attrs.evolve(batch, runs=tuple(runs)))
        return StepOutput(tuple(attrs.evolve(o, drafted=g) for o, g in zip(out.runs, drafted)))

    def _decode_inputs(self, runs: list[Run]) -> tuple[torch.Tensor, Attend]:
        """Decode rows' token ids [rows] and their Attend: one row per run, or one per token of
        a verify run, each attending over exactly the keys up to its own position, as a
        one-row step does."""
        pad = self.max_batch - len(runs) if self.pad_decode else 0
        positions = [p for r in runs for p in range(r.start, r.end)]
        slots = tuple(r.slot for r in runs for _ in r.token_ids) + (self.max_batch,) * pad  # padding rows: the scratch slot
        lengths = tuple(p + 1 for p in positions) + (0,) * pad
        pos = torch.tensor(positions + [0] * pad, device=self.device)
        embeds, embed_rows = self._embeds(runs) if any(r.embeds for r in runs) else (None, None)
        at = Attend("decode", slots, pos, pos, lengths, torch.tensor(slots, device=self.device), self.native_attend,
                    embeds, embed_rows)
        return torch.tensor([t for r in runs for t in r.token_ids] + [0] * pad, device=self.device), at

    def _embeds(self, runs: list[Run]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The input embeddings `runs` name (Run.embeds), packed as a pass packs the runs' rows
        (one after another): (rows [N, D], their row in the pass [N]), or (None, None)."""
        parts, where, base = [], [], 0
        for r in runs:
            for e in r.embeds:
                lo, hi = max(e.start, r.start), min(e.start + e.count, r.end)
                if lo < hi:
                    parts.append(self.embeddings[e.key][lo - e.start : hi - e.start])
                    where.append(torch.arange(base + lo - r.start, base + hi - r.start, device=self.device))
            base += len(r.token_ids)
        if not parts:
            return None, None
        return torch.cat(parts), torch.cat(where)

    def put_embeddings(self, key: int, rows: torch.Tensor) -> None:
        """Hold input embeddings [N, D] for runs to name by `key` (Run.embeds, EmbedSpan.key)."""
        assert rows.dim() == 2 and key, "rows [N, D] under a nonzero key"
        self.embeddings[key] = rows.to(device=self.device, dtype=self.dtype)

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision tower (embed_images works)."""
        return hasattr(self.model, "image_features")

    @property
    def pixel_dtype(self) -> torch.dtype:
        """The dtype embed_images takes its pixels in: a bfloat16 tower's own (it would cast
        float32 pixels to it first: bfloat16 ones spare that copy), float32 otherwise."""
        return torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32

    @torch.inference_mode()
    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image tiles [N, 3, S, S] -> the model's input rows for their <image> positions [N * seq, D]
        (a vision model's `image_features`). Safe to call from a worker thread beside `step`: it
        reads the weights and touches no slot state. AttributeError for a text-only model."""
        return self.model.image_features(pixels)

    def drop_embeddings(self, keys) -> None:
        """Forget input embeddings once no run will name them (the scheduler, at a request's end)."""
        for key in keys:
            self.embeddings.pop(key, None)

    def snapshot(self, slot: int, length: int, key: int) -> None:
        """Keep `slot`'s state at `length` (at most what it has computed) under `key`, replacing
        any snapshot of that key. Attention-only state keeps the rows in place: a later write
        into the slot below `length` spoils the snapshot, and restoring a spoiled one raises."""
        assert key and 0 <= length <= len(self._rows[slot]), f"slot {slot} has no state at {length}"
        self._snapshots[key] = (self.state.snapshot(slot, length), tuple(self._rows[slot][:length]))

    def restore(self, key: int, slot: int, *, at: int | None = None) -> None:
        """Restore the snapshot `key` into `slot` (its own or another), which then holds exactly
        the snapshot's tokens; `at`, where given, must be the snapshot's length. The snapshot stays
        for further restores until dropped. KeyError for an unknown key, ValueError for a spoiled
        or misplaced one."""
        snap, tokens = self._snapshots[key]
        if snap is None:
            raise ValueError(f"snapshot {key} was spoiled: its slot's rows below {len(tokens)} were rewritten")
        if at is not None and at != snap.length:
            raise ValueError(f"snapshot {key} holds {snap.length} positions; the run starts at {at}")
        if slot != snap.slot:
            self._spoil(slot, 0)
        self.state.restore(snap, slot)
        self._rows[slot] = list(tokens)

    def drop_snapshot(self, key: int) -> None:
        self._snapshots.pop(key, None)

    def _spoil(self, slot: int, start: int) -> None:
        """A write into `slot` from `start` on: in-place snapshots of it that reach past start are gone."""
        for key, (snap, tokens) in self._snapshots.items():
            if snap is not None and snap.slot == slot and snap.in_place and snap.length > start:
                self._snapshots[key] = (None, tokens)

    def decode_hidden(self, runs: list[Run]) -> torch.Tensor:
        """Decode rows -> hidden [rows, D] (see _decode_inputs)."""
        ids, at = self._decode_inputs(runs)
        return self.model(ids, at, self.state)

    def decode_logits(self, runs: list[Run]) -> tuple[torch.Tensor, list[int] | None]:
        """Decode rows -> (fp32 logits [rows, V], every row's arg-max or None): one scripted call
        where the model has it (its decode_logits), else the layers, then the head."""
        ids, at = self._decode_inputs(runs)
        fused = getattr(self.model, "decode_logits", None)
        got = fused(ids, at, self.state) if fused is not None else None
        if got is not None:
            return got[0], got[1].tolist()
        return self.model.logits(self.model(ids, at, self.state)), None
