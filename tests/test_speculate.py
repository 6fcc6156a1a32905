"""Speculative decoding by n-gram lookup: the pure proposer and tuner, the policy's verify
accounting with a fake engine, and on the embedded SmolLM2 the one promise that matters:
greedy replies are the tokens plain decoding gives."""

from __future__ import annotations

import random
import time

import pytest
import torch
import trio

from caldrix.batch import Batch, Run, RunOutput, StepOutput
from caldrix.protocol import FinishReason, SamplingParams, Submission
from caldrix.sched.loop import Scheduler
from caldrix.sched.policy import Policy
from caldrix.sched.sequence import Sequence
from caldrix.sched.slots import SlotTable
from caldrix.sched.speculate import DraftTuner, NgramIndex, SpecConfig, accepted

# -- the proposer ------------------------------------------------------------------------------


def brute_propose(tokens: list[int], k: int, lo: int, hi: int) -> tuple[int, ...]:
    """The definition: the longest suffix of lo..hi tokens with an earlier occurrence followed
    by a token; the tokens after its most recent such occurrence."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tuple(tokens[end : end + k])
    return ()


def test_ngram_prefers_the_longest_suffix_and_the_latest_occurrence():
    idx = NgramIndex(2, 4)
    idx.extend([1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3])
    # "1 2 3" occurred at 0..2 followed by 9; "2 3" more recently at 5..6 followed by 8: the
    # longer suffix wins.
    assert idx.propose(3) == (9, 7, 2)
    idx.extend([4])  # "3 4" never occurred, nor "2 3 4"
    assert idx.propose(3) == ()


def test_ngram_index_fed_piecewise_equals_the_definition():
    rng = random.Random(7)
    for trial in range(200):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        toks = [rng.randint(0, 4) for _ in range(rng.randint(0, 60))]
        idx = NgramIndex(lo, hi)
        pos = 0
        while pos < len(toks):
            step = rng.randint(1, 4)
            idx.extend(toks[pos : pos + step])
            pos += step
            k = rng.randint(1, 8)
            assert idx.propose(k) == brute_propose(toks[:pos], k, lo, hi), (trial, toks[:pos], lo, hi, k)


def test_accepted_counts_the_confirmed_prefix():
    assert accepted((5, 6, 7), (5, 6, 7, 8)) == 3
    assert accepted((5, 6, 7), (5, 9, 7, 8)) == 1
    assert accepted((5,), (4, 5)) == 0


def test_spec_config_bounds():
    with pytest.raises(ValueError):
        SpecConfig(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        SpecConfig(draft_tokens=9)


def test_tuner_follows_acceptance_and_measured_pass_times():
    assert DraftTuner(fixed=5).next_length() == 5
    flat = DraftTuner()
    assert flat.next_length() == 1  # nothing measured yet
    for rows in range(1, 10):
        flat.timed(rows, 0.010)  # passes cost the same whatever their rows
    for _ in range(30):
        flat.record(4, 4)
    assert flat.next_length() == 8
    steep = DraftTuner()
    steep.timed(1, 0.010)
    for rows in range(2, 10):
        steep.timed(rows, 0.010 * rows)  # each row costs a whole step: guessing never pays much
    for _ in range(30):
        steep.record(4, 1)
    assert steep.next_length() == 0  # a verify never yields more per second than a plain step
    assert (steep.proposed, steep.accepted) == (120, 30)
    # Measured costs (a 2-row pass 1.27 steps): failing guesses stop guessing, and checks of
    # the unverified guesses against plain picks start it again; totals count verified guesses.
    real = DraftTuner()
    for rows, ms in ((1, 28.5), (2, 36.2), (3, 41.7), (4, 48.0), (5, 70.6)):
        real.timed(rows, ms / 1000)
    for _ in range(20):
        real.record(1, 0)
    assert real.next_length() == 0
    for _ in range(20):
        real.shadow(True)
    assert real.next_length() >= 1 and (real.proposed, real.accepted) == (20, 0)


# -- the policy with a fake engine ---------------------------------------------------------------


class CycleEngine:
    """A fake model whose greedy pick after token t is NEXT[t]: a cycle, so replies repeat and
    the n-gram lookup has guesses to offer. Verify runs get a pick at every offset, computed
    from the run's own tokens, as a real verify pass does."""

    NEXT = {i: (i * 7 + 3) % 11 for i in range(11)}

    def __init__(self):
        self.batches: list[Batch] = []

    def step(self, batch: Batch) -> StepOutput:
        self.batches.append(batch)
        return StepOutput(tuple(RunOutput(tuple(self.NEXT[r.token_ids[o]] for o in r.pick_at)) for r in batch.runs))


def run_policy(policy: Policy, engine, prompt, max_tokens, stop=frozenset()) -> tuple[list, Sequence]:
    async def main():
        async def inline(fn, batch):
            await trio.lowlevel.checkpoint()
            return fn(batch)

        sched = Scheduler(engine, policy, run_step=inline)
        tx, rx = trio.open_memory_channel(1)
        etx, erx = trio.open_memory_channel(max_tokens + 1)
        sub = Submission("r", tuple(prompt), max_tokens, SamplingParams(), stop, etx)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            tx.send_nowait(sub)
            events = [e async for e in erx]
            await tx.aclose()
        return events

    return trio.run(main)


def plain_reply(prompt, max_tokens, stop=frozenset()):
    out, last = [], prompt[-1]
    for _ in range(max_tokens):
        last = CycleEngine.NEXT[last]
        if last in stop:
            return out, FinishReason.STOP
        out.append(last)
    return out, FinishReason.LENGTH


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 30])
@pytest.mark.parametrize("stop", [frozenset(), frozenset({4})])
@pytest.mark.parametrize("draft_tokens", [None, 1, 3, 8])
def test_verify_replies_equal_plain_replies(max_tokens, stop, draft_tokens):
    prompt = (5, 2, 6, 1, 10, 7, 8, 4, 9, 0, 3, 2)  # the cycle has come round once: guesses from the start
    slots = SlotTable(1)
    policy = Policy(slots, chunk=4, prefill_budget=4, speculation=SpecConfig(draft_tokens=draft_tokens))
    engine = CycleEngine()
    events = run_policy(policy, engine, prompt, max_tokens, stop)
    want, finish = plain_reply(prompt, max_tokens, stop)
    assert [e.token_id for e in events if e.token_id is not None] == want
    assert events[-1].finish is finish
    proposed, kept = events[-1].speculative or (0, 0)  # none when no guess was proposed
    verifies = [r for b in engine.batches for r in b.runs if r.verify]
    assert (events[-1].speculative is None) == (not verifies)
    assert proposed == sum(len(r.token_ids) - 1 for r in verifies)
    # The cycle repeats: every guess is right, so some were kept (the stop token 4 comes 6th,
    # so a stop lands inside a verify).
    if max_tokens >= 7:
        assert kept > 0 and verifies
    for r in verifies:
        assert r.pick_at == tuple(range(len(r.token_ids)))
        assert r.end <= len(prompt) + max_tokens  # never a guess past the reply's last token
    # The slot keeps only rows that hold the reply's tokens: no rejected guess.
    held = slots.held[0]
    assert held == (prompt + tuple(want))[: len(held)]
    assert len(held) >= len(prompt) + len(want) - 1


class _TimesFixed(DraftTuner):
    """The fake engine's microsecond steps would otherwise be the measured pass times."""

    def timed(self, rows, seconds):
        pass


def test_a_tuner_that_stopped_guessing_resumes_on_repeating_text():
    tuner = _TimesFixed()
    DraftTuner.timed(tuner, 1, 0.0285)
    DraftTuner.timed(tuner, 2, 0.0362)
    for _ in range(20):
        tuner.record(1, 0)
    assert tuner.next_length() == 0
    prompt = (5, 2, 6, 1, 10, 7, 8, 4, 9, 0, 3, 2)
    policy = Policy(SlotTable(1), chunk=4, prefill_budget=4, speculation=SpecConfig(), tuner=tuner)
    engine = CycleEngine()
    events = run_policy(policy, engine, prompt, 40)
    assert [e.token_id for e in events if e.token_id is not None] == plain_reply(prompt, 40)[0]
    runs = [r for b in engine.batches for r in b.runs if r.start >= len(prompt)]
    assert not runs[0].verify  # a plain step first: the guesses had failed
    assert any(r.verify for r in runs)  # the cycle's guess held in the shadow check: guessing resumed
    proposed, kept = events[-1].speculative
    assert proposed == sum(len(r.token_ids) - 1 for r in runs if r.verify) and kept > 0


def test_wrong_guesses_are_rewritten_in_place():
    """A verify whose guesses are all wrong yields the model's own pick; the next run starts
    right after the last valid row, over the rejected ones."""
    policy = Policy(SlotTable(1), chunk=8, prefill_budget=8, speculation=SpecConfig(draft_tokens=2))
    sub, _ = Submission("r", (1, 2, 3, 1, 2), 10, SamplingParams(), frozenset(), trio.open_memory_channel(11)[0]), None
    seq = Sequence(sub)
    policy.admit(seq)
    for picked in ((), (3,)):  # the prompt but its last token, then that token alone: reply so far 3
        policy.postprocess(policy.schedule_prefill(), StepOutput((RunOutput(picked),)))
    work = policy.schedule_decode()
    (run,) = work.batch.runs
    assert run.verify and run.token_ids == (3, 1, 2) and run.start == 5  # "2 3" was followed by "1 2"
    events = policy.postprocess(work, StepOutput((RunOutput((9, 9, 9)),)))
    assert [e.token_id for _, e in events] == [9] and seq.output == [3, 9]
    assert seq.num_computed == 6 and (seq.proposed, seq.accepted) == (2, 0)
    work = policy.schedule_decode()
    assert work.batch.runs[0].start == 6 and work.batch.runs[0].token_ids[0] == 9


def test_sampled_and_penalized_requests_do_not_speculate():
    policy = Policy(SlotTable(3), chunk=8, prefill_budget=8, speculation=SpecConfig())
    for params in (SamplingParams(temperature=0.7, seed=1), SamplingParams(repetition_penalty=1.2)):
        seq = Sequence(Submission("r", (1, 2, 1, 2), 5, params, frozenset(), trio.open_memory_channel(6)[0]))
        policy.admit(seq)
        assert not seq.speculating
    greedy = Sequence(Submission("g", (1, 2, 1, 2), 5, SamplingParams(), frozenset(), trio.open_memory_channel(6)[0]))
    policy.admit(greedy)
    assert greedy.speculating
    off = Policy(SlotTable(1))
    plain = Sequence(Submission("p", (1, 2), 5, SamplingParams(), frozenset(), trio.open_memory_channel(6)[0]))
    off.admit(plain)
    assert not plain.speculating


# -- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_engine(smollm2_dir):
    from caldrix.engine import Engine
    from caldrix.kernels import q4
    from caldrix.weights.gguf import source_gguf

    if not q4.available():
        pytest.skip("this torch has no int4 CPU matmul")
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=512,
                         int4_from=source_gguf(smollm2_dir))
    assert not engine.can_verify  # until the probe has run
    assert engine.check_verify() is None and engine.can_verify
    return engine


def test_verify_rows_are_one_row_decode_steps(int4_engine):
    """Every row of a verify pass picks, and reads, exactly what a one-row decode step at its
    position picks: the guesses here are arbitrary tokens, so most rows follow a rejected one."""
    eng = int4_engine
    prompt = tuple(range(300, 340))
    greedy = SamplingParams()
    guesses = (17, 4242, 911, 5, 30000, 77, 1234, 8)
    read = (10, 20, 30)
    eng.step(Batch((Run(0, 0, prompt, (len(prompt) - 1,), greedy),)))
    one_by_one = []
    for i, tok in enumerate((99,) + guesses):
        out = eng.step(Batch((Run(0, len(prompt) + i, (tok,), (0,), greedy, read_ids=read),)))
        one_by_one.append((out.runs[0].token_ids[0], out.runs[0].read))
    for k in (1, 3, 8):
        run = Run(0, len(prompt), (99,) + guesses[:k], tuple(range(k + 1)), greedy, read_ids=read, verify=True)
        out = eng.step(Batch((run,))).runs[0]
        assert list(out.token_ids) == [t for t, _ in one_by_one[: k + 1]], k
        assert out.read == one_by_one[k][1]  # reads come from the last offset


def test_greedy_replies_with_speculation_equal_plain_decoding(int4_engine, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [tuple(tok.encode(p)) for p in ("Explain how a bicycle works to a child.",
                                              "List some facts about the planet Mars.")]

    async def reply(policy, ids, n):
        async def threaded(fn, batch):
            return await trio.to_thread.run_sync(fn, batch)

        sched = Scheduler(int4_engine, policy, run_step=threaded)
        tx, rx = trio.open_memory_channel(1)
        etx, erx = trio.open_memory_channel(n + 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            tx.send_nowait(Submission("r", ids, n, SamplingParams(), frozenset(), etx))
            events = [e async for e in erx]
            await tx.aclose()
        return [e.token_id for e in events if e.token_id is not None], events[-1].speculative

    kept = []
    for ids in prompts:
        plain, none = trio.run(reply, Policy(SlotTable(1), chunk=64, prefill_budget=64), ids, 96)
        spec_policy = Policy(SlotTable(1), chunk=64, prefill_budget=64, speculation=SpecConfig())
        fast, counts = trio.run(reply, spec_policy, ids, 96)
        assert none is None and (counts or (0, 0)) == (spec_policy.tuner.proposed, spec_policy.tuner.accepted)
        assert fast == plain, tok.decode(ids)
        kept.append(counts[1])
    # The bicycle reply repeats itself ("It's a marvel of human ingenuity."): guesses were kept.
    assert kept[0] > 0


# -- the command line and the HTTP API -------------------------------------------------------------


def caldrix(*args: str, timeout: float = 300):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "caldrix", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, flag, says", [
    (["serve", "--speculate", "draft"], "--speculate", "needs --draft"),
    (["serve", "--speculate", "ngram", "--max-batch", "2"], "--speculate", "restart with --max-batch 1"),
    (["serve", "--speculate", "ngram", "--draft", "some/dir"], "--draft", "--speculate draft or auto"),
    (["serve", "--speculate", "ngram", "--speculation-memory", "m.json"], "--speculation-memory", "draft"),
    (["serve", "--draft-tokens", "3"], "--draft-tokens", "no effect without --speculate"),
    (["serve", "--speculate", "ngram", "--draft-tokens", "9"], "--draft-tokens", "1..8"),
    (["serve", "--speculate", "ngram", "--ngram", "4:2"], "--ngram", "MIN <= MAX"),
    (["run", "--speculate", "ngram", "--ngram", "x", "hi"], "--ngram", "MIN:MAX"),
    (["serve", "--speculate", "ngram", "--ngram", "2:512"], "--ngram", "MAX must be at most 16"),
    (["serve", "--speculate", "draft", "--draft", "d", "--ngram", "2:4"], "--ngram", "no effect with --speculate draft"),
])
def test_speculation_flags_refused_before_loading(args, flag, says):
    out = caldrix(*args)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr and says in out.stderr, out.stderr


class _RowCountNoise(torch.nn.Module):
    """A norm whose output depends on how many rows share the call: what a matmul kernel that
    sums a k-row product in another order than a 1-row one does, made large and certain."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x) + 1e-2 * (x.shape[0] - 1)


def test_the_probe_finds_rows_that_depend_on_the_pass(smollm2_dir):
    from caldrix.config import FlagError, ServeConfig
    from caldrix.engine import Engine
    from caldrix.runtime import resolve_speculation

    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=64)
    engine.model.norm = _RowCountNoise(engine.model.norm)
    why = engine.check_verify()
    assert why is not None and "row 0" in why and not engine.can_verify, why
    with pytest.raises(AssertionError, match="cannot verify"):
        engine.step(Batch((Run(0, 0, (5, 6, 7), (0, 1, 2), verify=True),)))
    with pytest.raises(FlagError, match="--speculate ngram: a verify pass of 9 rows"):
        resolve_speculation(ServeConfig(speculate="ngram"), "cpu", engine)
    spec, notes = resolve_speculation(ServeConfig(speculate="auto"), "cpu", engine)
    assert spec is None and notes[-1].startswith("speculation off: a verify pass")
    # The probe leaves slot 0 empty for the scheduler.
    assert engine._rows[0] == []


def test_a_dense_engine_speculates_where_its_probe_passes(smollm2_dir):
    """Dense bf16 weights: whether the kernel keeps rows apart is the machine's to say. Where
    the probe says it does, a verify pass must pick what one-row steps pick."""
    from caldrix.engine import Engine

    eng = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=1, context=128)
    if eng.check_verify() is not None:
        pytest.skip("this CPU's dense bf16 kernel sums a verify pass's rows differently")
    prompt, guesses = tuple(range(400, 420)), (11, 12, 13, 14)
    eng.step(Batch((Run(0, 0, prompt, (len(prompt) - 1,)),)))
    one = [eng.step(Batch((Run(0, len(prompt) + i, (t,), (0,)),))).runs[0].token_ids[0]
           for i, t in enumerate((99,) + guesses)]
    run = Run(0, len(prompt), (99,) + guesses, tuple(range(5)), verify=True)
    assert list(eng.step(Batch((run,))).runs[0].token_ids) == one


def test_ngram_refused_on_the_host_lane(smollm2_dir):
    out = caldrix("run", str(smollm2_dir), "hi", "--speculate", "ngram", "--backend", "host", "--max-tokens", "2")
    assert out.returncode == 2, out.stderr
    assert "--speculate ngram: the host lane" in out.stderr and "Traceback" not in out.stderr


def test_run_says_what_auto_turned_off(smollm2_dir):
    """serve's start-up notes, auto's fallbacks among them, are run's too (on stderr)."""
    out = caldrix("run", str(smollm2_dir), "hi", "--speculate", "auto", "--max-batch", "2", "--max-tokens", "1",
                  "--context", "256")
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("caldrix: note: ") and "speculation" in line for line in out.stderr.splitlines()), out.stderr


def test_run_prints_the_plain_reply_and_the_guesses_kept(smollm2_dir):
    args = ("run", str(smollm2_dir), "Explain how a bicycle works to a child.", "--chat", "--max-tokens", "48",
            "--context", "256")
    plain, fast = caldrix(*args), caldrix(*args, "--speculate", "ngram")
    assert plain.returncode == fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and len(plain.stdout) > 40
    assert "guesses kept" not in plain.stderr
    kept = fast.stderr.strip().splitlines()[-1]
    assert kept.startswith("caldrix: speculative: ") and kept.endswith(" guesses kept"), fast.stderr


def test_auto_turns_itself_off_with_a_note():
    import attrs

    from caldrix.config import ServeConfig
    from caldrix.runtime import resolve_speculation

    class Verifies:
        def check_verify(self):
            return None

    spec, notes = resolve_speculation(ServeConfig(speculate="auto", max_batch=4), "cpu", Verifies())
    assert spec is None and "batched (--max-batch 4)" in notes[-1]
    spec, notes = resolve_speculation(ServeConfig(speculate="auto"), "host", object())
    assert spec is None and notes[-1].startswith("speculation off: the host lane")
    cfg = ServeConfig(speculate="auto", draft="d", speculation_memory="m", ngram=(1, 3), draft_tokens=2)
    spec, notes = resolve_speculation(cfg, "cpu", Verifies())
    assert attrs.astuple(spec) == ("ngram", 1, 3, 2)
    assert "did not load" in notes[0] and "n-gram lookup instead" in notes[0] and "neither read nor written" in notes[0]


def test_http_speculative_usage_records_and_metrics(smollm2_dir):
    """A --speculate ngram server answers greedy requests with the plain server's text and
    usage.speculative; sampled requests carry none. The replay ring and /metrics count the
    guesses."""
    import httpx
    from openai import OpenAI

    from server_harness import ServerProcess

    body = {"prompt": "Explain how a bicycle works to a child.", "max_tokens": 64, "temperature": 0}
    with ServerProcess.start(smollm2_dir, "--context", "512") as plain:
        body["model"] = httpx.get(plain.url + "/v1/models").json()["data"][0]["id"]
        want = httpx.post(plain.url + "/v1/completions", json=body, timeout=120).json()
        assert "speculation off" in plain.stderr
    assert "speculative" not in want["usage"]
    # A fixed draft length: the tuner picks lengths from measured pass times, and on a busy
    # machine could stop proposing (its own tests are in test_speculate's tuner tests).
    with ServerProcess.start(smollm2_dir, "--context", "512", "--speculate", "ngram", "--draft-tokens", "2") as srv:
        assert "caldrix: speculation ngram 2:4, 2 guesses, for greedy requests" in srv.stderr
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        spec = got["usage"]["speculative"]
        assert 0 < spec["accepted"] <= spec["proposed"]

        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["choices"][0]["text"]
        streamed = chunks[-1].usage.model_extra["speculative"]
        assert 0 < streamed["accepted"] <= streamed["proposed"]

        sampled = httpx.post(srv.url + "/v1/completions", json={**body, "temperature": 0.8, "seed": 3}, timeout=120).json()
        assert "speculative" not in sampled["usage"]
        # greedy, but over before any guess is made (the one token comes from the prompt's pass)
        one = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=120).json()
        assert one["usage"]["completion_tokens"] == 1 and "speculative" not in one["usage"]

        records = httpx.get(srv.url + "/debug/requests").json()
        recs = records["data"]
        assert [r["speculative"] for r in recs[-4:]] == [spec, streamed, None, None]
        metrics = httpx.get(srv.url + "/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("caldrix:spec_decode_num_draft_tokens_total")]
        kept = [line for line in metrics.splitlines() if line.startswith("caldrix:spec_decode_num_accepted_tokens_total")]
        assert float(drafts[0].split()[-1]) == spec["proposed"] + streamed["proposed"]
        assert float(kept[0].split()[-1]) == spec["accepted"] + streamed["accepted"]

        # A stop string that ends the reply inside a verify pass: the route stops listening, and
        # the pass's later events for the request must not end it again (each was counted).
        def e2e_count() -> float:
            for line in httpx.get(srv.url + "/metrics").text.splitlines():
                if line.startswith("caldrix:e2e_request_latency_seconds_count"):
                    return float(line.split()[-1])
            raise AssertionError("no e2e count")

        para = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again. "
        for stop in ([" lazy", "again"], ["fox"]):
            before = e2e_count()
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": body["model"], "prompt": para * 3, "max_tokens": 40, "temperature": 0, "stop": stop})
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            deadline = time.monotonic() + 10
            while e2e_count() == before and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # a second count, if any, lands within a step
            assert e2e_count() == before + 1
