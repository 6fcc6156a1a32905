"""Scheduling policy: pure and synchronous. It decides; loop.py awaits and emits.

Work comes in two kinds, one per lane of the loop (loop.py):
- decode: every running sequence that has finished its prompt decodes one token;
- prefill: prefilling sequences get prompt chunks within a per-step token budget.
A chunk always ends on a multiple of `chunk` positions or before the prompt's last token, which
runs alone last, and held rows are reused only in whole chunks (or all but that last token), so a
prompt is cut the same way whether it runs alone, beside others, or after a slot's held rows. A
read-only prompt's last chunk takes its last token too, and it reuses any held prefix.

Kept states (Submission.lease, the decider reading's state read once): a prompt with
`keep_state` is read from its start and cut so that a chunk ends exactly at the lease's length,
and that run keeps the slot's state there (Run.snapshot). A later prompt of the same lease is
admitted at that length and its first chunk restores the state (Run.restore), while `kept` says
the engine still has it unspoiled; otherwise it is read whole. Any other write into the slot
below a kept state's length forgets it here, as the engine spoils it there.

Invariant: when `has_running()` is true, `schedule_decode()` or `schedule_prefill()` returns a
Work, because every running sequence is either decoding or prefilling. The loop must not ask
for prefill work while an earlier prefill Work is still in flight (its sequences would be cut
twice).
"""

from __future__ import annotations

import attrs

from caldrix.batch import Batch, Run, StepOutput
from caldrix.protocol import FinishReason, TokenEvent
from caldrix.sched.sequence import Sequence, Status
from caldrix.sched.slots import SlotTable
from caldrix.sched.spec_memory import SpeculationMemory
from caldrix.sched.speculate import DraftTuner, NgramIndex, SpecConfig, accepted

SAVE_EVERY = 64  # verifies between saves of --speculation-memory, so a crash keeps most
DRAFT_PROBE_EVERY = 32  # draft mode, tuned to no guesses: one guess every this many plain steps


@attrs.frozen
class Work:
    batch: Batch
    seqs: tuple[Sequence, ...]  # seqs[i] owns batch.runs[i]


@attrs.define
class Policy:
    slots: SlotTable
    chunk: int = 128  # prompt tokens per chunk
    prefill_budget: int = 128  # prompt tokens per prefill step, summed over chunks (at least one chunk runs)
    running: list[Sequence] = attrs.Factory(list)
    # Lease key -> (slot, length) of each state the engine keeps for a lease (Run.snapshot).
    kept: dict[int, tuple[int, int]] = attrs.Factory(dict)
    # --speculate ngram: greedy sequences propose their next tokens from their own n-grams and
    # a decode step verifies them (speculate.py). None: plain decoding.
    speculation: SpecConfig | None = None
    tuner: DraftTuner = attrs.field(default=attrs.Factory(
        lambda self: DraftTuner(fixed=self.speculation.draft_tokens if self.speculation else None), takes_self=True))
    # --speculation-memory (draft mode): the tuner's state is saved every SAVE_EVERY verifies
    # and when the scheduler stops (`stopped`). None: not kept.
    memory: SpeculationMemory | None = None
    _verifies: int = 0
    _plain: int = 0  # draft mode: plain steps since the tuner chose no guesses

    @property
    def can_admit(self) -> bool:
        return self.slots.num_free > 0

    def has_running(self) -> bool:
        return bool(self.running)

    def admit(self, seq: Sequence) -> None:
        """Give seq a slot. The caller checks `can_admit` first."""
        lease = seq.sub.lease
        # A prompt of a lease reads from its start or from the kept state, never from held rows.
        # Held rows are reused in whole chunks (SlotTable.try_acquire), so a reply never depends
        # on what ran before it; a read-only prompt (a /v1/systemone question) has no reply to
        # keep so and reuses any common prefix (systemone.md says how its reading may differ).
        got = self.slots.try_acquire(seq.prompt, reuse=seq.sub.reuse_prefix and lease is None, align=self.chunk,
                                     read_only=seq.sub.is_read_only)
        assert got is not None, "admit() without a free slot"
        seq.slot, seq.prefix_rows = got
        written_from = seq.prefix_rows
        kept = self.kept.get(lease.key) if lease is not None and not seq.sub.keep_state else None
        if kept is not None and kept[1] == lease.length < len(seq.prompt):
            seq.prefix_rows = lease.length
            seq.restore_key = lease.key
            # Restoring into its own slot keeps the rows below the length; another slot starts over.
            written_from = lease.length if kept[0] == seq.slot else 0
        self._spoil(seq.slot, written_from)
        seq.num_computed = seq.prefix_rows
        seq.speculating = self.speculates(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _spoil(self, slot: int, start: int) -> None:
        """A sequence will write `slot` from `start` on: kept states there that reach past it are gone."""
        for key, (s, length) in list(self.kept.items()):
            if s == slot and length > start:
                del self.kept[key]

    def forget(self, key: int) -> None:
        """The lease ended (the loop drops the engine's snapshot)."""
        self.kept.pop(key, None)

    def has_decoding(self) -> bool:
        return any(not seq.in_prefill for seq in self.running)

    def schedule_decode(self) -> Work | None:
        """One token for every sequence past its prompt, or a verify of its guesses for one
        that speculates and has some; None if no sequence is past its prompt."""
        seqs = tuple(seq for seq in self.running if not seq.in_prefill)
        runs = tuple(self._decode_run(seq) for seq in seqs)
        return Work(Batch(runs), seqs) if runs else None

    def speculates(self, seq: Sequence) -> bool:
        """Greedy requests with no penalty speculate: their picks are plain arg-maxes, which
        a verify reproduces exactly. Sampled and penalized ones decode plainly."""
        p = seq.sub.sampling
        return (self.speculation is not None and not seq.sub.is_read_only and p.is_greedy
                and p.repetition_penalty == 1.0)

    def _decode_run(self, seq: Sequence) -> Run:
        guesses: tuple[int, ...] = ()
        if seq.speculating and self.speculation.mode == "draft":
            # The engine's draft model guesses (Run.draft). With no guesses chosen, a plain
            # step now and then tries one, so the acceptance estimate keeps moving (n-gram
            # lookups do that for free: `shadow`).
            room = seq.sub.max_tokens - len(seq.output) - 1
            k = self.tuner.next_length()
            if k == 0:
                self._plain += 1
                k = 1 if self._plain % DRAFT_PROBE_EVERY == 0 else 0
            k = min(k, room)
            return Run(slot=seq.slot, start=seq.num_computed, token_ids=(seq.output[-1],), pick_at=(0,),
                       sampling=seq.sub.sampling, draw_index=len(seq.output), draft=max(k, 0))
        if seq.speculating:
            if seq.ngram is None:
                seq.ngram = NgramIndex(self.speculation.min_n, self.speculation.max_n)
                seq.ngram.extend(seq.tokens())
            # No guess past the reply's last token: the pick after the last guess is a token too.
            room = seq.sub.max_tokens - len(seq.output) - 1
            k = min(self.tuner.next_length(), room)
            guesses = seq.ngram.propose(k) if k > 0 else ()
            if k == 0 and room > 0:
                seq.shadow = next(iter(seq.ngram.propose(1)), None)
        return Run(
            slot=seq.slot,
            start=seq.num_computed,
            token_ids=(seq.output[-1],) + guesses,
            pick_at=tuple(range(1 + len(guesses))),
            sampling=seq.sub.sampling,
            draw_index=len(seq.output),
            verify=bool(guesses),
        )

    def timed(self, work: Work, seconds: float) -> None:
        """The loop reports how long a decode step took: the draft tuner weighs row counts by it."""
        if self.speculation is not None and len(work.seqs) == 1:
            self.tuner.timed(work.batch.num_tokens + work.batch.runs[0].draft, seconds)

    def stopped(self) -> str | None:
        """The scheduler stops: keep the tuner's state (--speculation-memory); a note if it
        could not be written."""
        return self.memory.save(self.tuner.state()) if self.memory is not None else None

    def schedule_prefill(self) -> Work | None:
        """Prompt chunks, oldest sequence first, within `prefill_budget` tokens (the first
        chunk always runs); None if no sequence is prefilling."""
        runs: list[Run] = []
        seqs: list[Sequence] = []
        budget = self.prefill_budget
        for seq in self.running:
            if not seq.in_prefill:
                continue
            run = self._chunk(seq, budget, first=not runs)
            if run is None:
                continue
            budget -= len(run.token_ids)
            runs.append(run)
            seqs.append(seq)
        return Work(Batch(tuple(runs)), tuple(seqs)) if runs else None

    def _chunk(self, seq: Sequence, budget: int, *, first: bool) -> Run | None:
        prompt = seq.prompt
        start = seq.num_computed
        # The prompt's last token always runs alone, after the chunks: a one-token run, which
        # the engine computes in the decode form. A prompt whose other rows a slot still held
        # (SlotTable's reuse) recomputes only that token, so it gets the same bits, and the
        # same reply, as the prompt run fresh. A read-only prompt (a /v1/systemone probe) has
        # no reply to keep identical, nor has an image request, which never reuses rows and
        # leaves none behind: its last row is read in its last chunk, which spares a whole
        # pass over the weights (per question; off an image request's first token).
        boundary = (start // self.chunk + 1) * self.chunk
        if seq.sub.is_read_only or not seq.sub.reuse_prefix:
            end = min(len(prompt), boundary)
        else:
            end = len(prompt) if start == len(prompt) - 1 else min(len(prompt) - 1, boundary)
        # A prompt that keeps its state for its lease has a chunk end exactly there.
        keep = seq.sub.lease.length if seq.sub.keep_state and seq.sub.lease is not None else 0
        if start < keep < end:
            end = keep
        if end - start > budget and not first:
            return None
        last = end == len(prompt)
        return Run(
            slot=seq.slot,
            start=start,
            token_ids=prompt[start:end],
            pick_at=(end - start - 1,) if last else (),
            sampling=seq.sub.sampling,
            draw_index=0,
            read_ids=seq.sub.read_ids if last else (),
            read_only=last and seq.sub.is_read_only,
            embeds=tuple(e for e in seq.sub.embeds if e.start < end and start < e.start + e.count),
            restore=seq.restore_key if seq.restore_key and start == seq.prefix_rows else 0,
            snapshot=seq.sub.lease.key if keep and end == keep else 0,
        )

    def postprocess(self, work: Work, out: StepOutput) -> list[tuple[Sequence, TokenEvent]]:
        """Apply a step's output; returns the events to emit, in order. Finished sequences
        leave `running` and free their slots here."""
        events: list[tuple[Sequence, TokenEvent]] = []
        size = len(work.seqs)
        for seq, run, res in zip(work.seqs, work.batch.runs, out.runs):
            seq.num_computed = run.end
            if run.snapshot:
                self.kept[run.snapshot] = (seq.slot, run.end)
            seq.batch_sizes.append(size)
            if not res.token_ids and not res.read:
                continue  # a middle prompt chunk
            if seq.sub.is_read_only:
                events.append((seq, self._finish(seq, FinishReason.STOP, None, read=res.read)))
                continue
            picks = res.token_ids
            verify = run.verify or bool(res.drafted)  # a draft run verifies what the draft model guessed
            if verify:
                guesses = res.drafted or run.token_ids[1:]
                kept = accepted(guesses, picks)
                self.tuner.record(len(guesses), kept)
                seq.proposed += len(guesses)
                seq.accepted += kept
                picks = picks[: kept + 1]  # the kept guesses, then the model's own pick
                self._verifies += 1
                if self.memory is not None and self._verifies % SAVE_EVERY == 0:
                    self.stopped()
            else:
                picks = picks[-1:]
                if seq.shadow is not None:
                    self.tuner.shadow(picks[0] == seq.shadow)
                    seq.shadow = None
            before = len(seq.output)
            for i, token in enumerate(picks):
                if verify:
                    # Valid rows: the last known token and the guesses kept before pick i. Rows
                    # past them hold rejected guesses, to be rewritten; a slot released here
                    # holds only the valid ones.
                    seq.num_computed = run.start + 1 + i
                event = self._take(seq, token)
                events.append((seq, event))
                if event.finish is not None:
                    break
            if seq.ngram is not None and not seq.is_finished:
                seq.ngram.extend(seq.output[before:])
        return events

    def _take(self, seq: Sequence, token: int) -> TokenEvent:
        """One picked token for seq: the end of it, or one more reply token."""
        if token in seq.sub.stop_token_ids:
            return self._finish(seq, FinishReason.STOP, None)
        seq.output.append(token)
        if len(seq.output) >= seq.sub.max_tokens:
            return self._finish(seq, FinishReason.LENGTH, token)
        return TokenEvent(token, speculative=self._spec_counts(seq))

    def _spec_counts(self, seq: Sequence) -> tuple[int, int] | None:
        # http-api.md: usage.speculative "when a request speculated": one that proposed no guess
        # (its lookup never found one, or it ended at its first token) did not.
        return (seq.proposed, seq.accepted) if seq.speculating and seq.proposed else None

    def _finish(self, seq: Sequence, reason: FinishReason, token: int | None, read=()) -> TokenEvent:
        self.release(seq, reason)
        return TokenEvent(token, finish=reason, prefix_rows=seq.prefix_rows, read=tuple(read),
                          speculative=self._spec_counts(seq))

    def release(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq (finished, aborted or failed) and free its slot, keeping its valid rows."""
        if seq.is_finished:
            return
        seq.status = Status.FINISHED
        seq.finish = reason
        self.running.remove(seq)
        held = seq.tokens()[: seq.num_computed] if seq.sub.reuse_prefix else ()
        self.slots.release(seq.slot, held)
