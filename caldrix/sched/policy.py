"""Scheduling policy: pure and synchronous. It decides; loop.py awaits and emits.

Work comes in two kinds, one per lane of the loop (loop.py):
- decode: every running sequence that has finished its prompt decodes one token;
- prefill: prefilling sequences get prompt chunks within a per-step token budget.
A chunk always ends on a multiple of `chunk` positions (or at the prompt's end), so a prompt is
cut the same way whether it runs alone or beside others.

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

    @property
    def can_admit(self) -> bool:
        return self.slots.num_free > 0

    def has_running(self) -> bool:
        return bool(self.running)

    def admit(self, seq: Sequence) -> None:
        """Give seq a slot. The caller checks `can_admit` first."""
        got = self.slots.try_acquire(seq.prompt, reuse=seq.sub.reuse_prefix)
        assert got is not None, "admit() without a free slot"
        seq.slot, seq.prefix_rows = got
        seq.num_computed = seq.prefix_rows
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_decoding(self) -> bool:
        return any(not seq.in_prefill for seq in self.running)

    def schedule_decode(self) -> Work | None:
        """One token for every sequence past its prompt; None if there is none."""
        seqs = tuple(seq for seq in self.running if not seq.in_prefill)
        runs = tuple(
            Run(
                slot=seq.slot,
                start=seq.num_computed,
                token_ids=(seq.output[-1],),
                pick_at=(0,),
                sampling=seq.sub.sampling,
                draw_index=len(seq.output),
            )
            for seq in seqs
        )
        return Work(Batch(runs), seqs) if runs else None

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
        end = min(len(prompt), (start // self.chunk + 1) * self.chunk)
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
        )

    def postprocess(self, work: Work, out: StepOutput) -> list[tuple[Sequence, TokenEvent]]:
        """Apply a step's output; returns the events to emit, in order. Finished sequences
        leave `running` and free their slots here."""
        events: list[tuple[Sequence, TokenEvent]] = []
        size = len(work.seqs)
        for seq, run, res in zip(work.seqs, work.batch.runs, out.runs):
            seq.num_computed = run.end
            seq.batch_sizes.append(size)
            if not res.token_ids and not res.read:
                continue  # a middle prompt chunk
            if seq.sub.is_read_only:
                events.append((seq, self._finish(seq, FinishReason.STOP, None, read=res.read)))
                continue
            token = res.token_ids[-1]
            if token in seq.sub.stop_token_ids:
                events.append((seq, self._finish(seq, FinishReason.STOP, None)))
                continue
            seq.output.append(token)
            if len(seq.output) >= seq.sub.max_tokens:
                events.append((seq, self._finish(seq, FinishReason.LENGTH, token)))
            else:
                events.append((seq, TokenEvent(token)))
        return events

    def _finish(self, seq: Sequence, reason: FinishReason, token: int | None, read=()) -> TokenEvent:
        self.release(seq, reason)
        return TokenEvent(token, finish=reason, prefix_rows=seq.prefix_rows, read=tuple(read))

    def release(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq (finished, aborted or failed) and free its slot, keeping its valid rows."""
        if seq.is_finished:
            return
        seq.status = Status.FINISHED
        seq.finish = reason
        self.running.remove(seq)
        held = seq.tokens()[: seq.num_computed] if seq.sub.reuse_prefix else ()
        self.slots.release(seq.slot, held)
