"""Speculative decoding with a draft model (--speculate draft, and auto): greedy replies are
token for token the replies of plain decoding, whatever the draft guesses; a draft that does
not share the target's vocabulary refuses the start, naming what differs; auto gives way to
n-gram lookup when the draft does not load; --speculation-memory survives a restart."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import trio

from caldrix.protocol import FinishReason, SamplingParams, Submission
from caldrix.sched.loop import Scheduler
from caldrix.sched.policy import Policy
from caldrix.sched.slots import SlotTable
from caldrix.sched.speculate import SpecConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CONTEXT = 96


def tiny_llama(path, smollm2_dir, *, seed: int, like=None, noise: float = 0.0, layers: int = 2):
    """A tiny random llama with SmolLM2's vocabulary and tokenizer files; `like` copies another
    tiny model's weights (plus `noise`), so a draft agrees with its target most of the time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        # Sharper logits than init's: a tiny random model then picks by its weights, not by ties.
        model.model.embed_tokens.weight.mul_(40)
        if like is not None:
            model.load_state_dict(like.state_dict())
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p) * p.abs().mean())
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path, model


@pytest.fixture(scope="module")
def pair(tmp_path_factory, smollm2_dir):
    """(target dir, near draft dir, unrelated draft dir)."""
    base = tmp_path_factory.mktemp("draft-pair")
    (base / "target").mkdir(), (base / "near").mkdir(), (base / "far").mkdir()
    target, model = tiny_llama(base / "target", smollm2_dir, seed=3)
    near, _ = tiny_llama(base / "near", smollm2_dir, seed=4, like=model, noise=0.3)
    far, _ = tiny_llama(base / "far", smollm2_dir, seed=5)
    return target, near, far


def engine_with_draft(target, draft, *, draft_int4=None, target_int4=None, dtype=torch.bfloat16, context=CONTEXT):
    from caldrix.draft import DraftProposer
    from caldrix.engine import Engine

    eng = Engine.load(target, dtype=dtype, max_batch=1, context=context, int4_from=target_int4)
    assert eng.check_verify() is None, "the target must verify exactly on this machine"
    if draft is not None:
        eng.drafter = DraftProposer(Engine.load(draft, dtype=dtype, max_batch=1, context=context, int4_from=draft_int4))
    return eng


def replies(engine, spec, jobs):
    """Greedy replies of `jobs` ((prompt ids, max_tokens, stop ids), one after another on one
    scheduler): [(tokens, finish, speculative counts)]."""

    async def main():
        async def threaded(fn, batch):
            return await trio.to_thread.run_sync(fn, batch)

        sched = Scheduler(engine, Policy(SlotTable(1), chunk=32, prefill_budget=32, speculation=spec),
                          run_step=threaded)
        tx, rx = trio.open_memory_channel(1)
        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            for ids, n, stop in jobs:
                etx, erx = trio.open_memory_channel(n + 1)
                await tx.send(Submission("r", tuple(ids), n, SamplingParams(), frozenset(stop), etx))
                events = [e async for e in erx]
                got.append(([e.token_id for e in events if e.token_id is not None], events[-1].finish,
                            events[-1].speculative))
            await tx.aclose()
        return got, sched.policy

    return trio.run(main)


def jobs_for(seed: int, count: int, context: int = CONTEXT):
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        length = rng.choice([1, 2, 5, 17, 40, context - 12, context - 3, context - 2])
        prompt = [rng.randrange(3, 2000) for _ in range(length)]
        if i % 3 == 0 and length > 4:
            prompt[length // 2:] = prompt[: length - length // 2]  # a repeat: n-gram lookup has guesses
        jobs.append((prompt, min(rng.choice([1, 2, 9, 30]), context - length), ()))
    return jobs


@pytest.mark.parametrize("draft_tokens", [None, 1, 4, 8])
def test_draft_replies_equal_plain_decoding(pair, draft_tokens):
    """Many prompts and lengths, up to the context's end, after one another in one slot (so the
    draft's rows follow one sequence, then the next's common prefix): the same tokens as plain
    decoding, with a near draft (most guesses kept) and an unrelated one (most rejected)."""
    target, near, far = pair
    jobs = jobs_for(11, 14)
    plain_engine = engine_with_draft(target, None)
    want, _ = replies(plain_engine, None, jobs)
    # Stops inside an accepted run: a token of each plain reply's middle becomes a stop id.
    stops = [(p, n, (toks[len(toks) // 2],) if len(toks) > 3 else ()) for (p, n, _), (toks, _, _) in zip(jobs, want)]
    want_stopped, _ = replies(plain_engine, None, stops)
    for draft in (near, far):
        eng = engine_with_draft(target, draft)
        spec = SpecConfig(draft_tokens=draft_tokens, mode="draft")
        got, policy = replies(eng, spec, jobs + stops)
        assert [g[:2] for g in got] == [w[:2] for w in want + want_stopped]
        assert sum(g[2][0] for g in got if g[2]) == policy.tuner.proposed > 0
        if draft == near:
            assert policy.tuner.accepted > 0
        assert any(f is FinishReason.STOP for _, f, _ in got[len(jobs):])


def test_ngram_and_draft_agree_on_the_tiny_target(pair):
    target, near, _ = pair
    jobs = jobs_for(12, 8)
    want, _ = replies(engine_with_draft(target, None), None, jobs)
    got, policy = replies(engine_with_draft(target, None), SpecConfig(), jobs)
    assert [g[:2] for g in got] == [w[:2] for w in want]


def test_the_draft_follows_the_sequence_with_one_correction(pair):
    """After a verify, the draft feeds only what it does not hold: the correction (or the last
    guess and the correction when all were kept), never the accepted tokens again."""
    from caldrix.draft import DraftProposer

    target, near, _ = pair
    eng = engine_with_draft(target, near)
    fed = []
    inner = eng.drafter.engine
    step = inner.step
    inner.step = lambda batch: (fed.append([len(r.token_ids) for r in batch.runs]), step(batch))[1]
    assert isinstance(eng.drafter, DraftProposer)
    jobs = [([5, 6, 7, 8, 9, 10, 11, 12], 40, ())]
    (toks, _, counts), = replies(eng, SpecConfig(draft_tokens=4, mode="draft"), jobs)[0]
    assert fed[0] == [9]  # the prompt and the first reply token (picked by the prompt pass), once
    later = [f[0] for f in fed[1:]]
    assert max(later) <= 2, later  # a correction, or the last guess and the correction
    # The draft's rows: the sequence, then at most the last proposal's 3 fed guesses.
    rows, seq = inner._rows[0], [5, 6, 7, 8, 9, 10, 11, 12, *toks]
    assert len(rows) > 8 + len(toks) - 8 and rows[: len(rows) - 3] == seq[: len(rows) - 3]


def test_the_embedded_model_drafts_for_itself_loaded_another_way(smollm2_dir):
    """SmolLM2 served dense bfloat16 (which verifies exactly here; dense float32 does not on
    this CPU: its probe refuses) with its own 4-bit GGUF form as the draft: the plain replies,
    most guesses kept."""
    from caldrix.kernels import q4
    from caldrix.weights.gguf import source_gguf

    if not q4.available():
        pytest.skip("this torch has no int4 CPU matmul")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = ["Rewrite this with one change: the cat sat on the mat."]
    jobs = [(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False), 32, ())
            for p in prompts]
    want, _ = replies(engine_with_draft(smollm2_dir, None, context=256), None, jobs)
    eng = engine_with_draft(smollm2_dir, smollm2_dir, draft_int4=source_gguf(smollm2_dir), context=256)
    got, policy = replies(eng, SpecConfig(draft_tokens=4, mode="draft"), jobs)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert policy.tuner.accepted > policy.tuner.proposed // 2, (policy.tuner.proposed, policy.tuner.accepted)


# -- refusals and notes --------------------------------------------------------------------------


def load_with_draft(target, draft, **flags):
    from caldrix.config import ServeConfig
    from caldrix.runtime import load_runtime

    return load_runtime(ServeConfig(model=str(target), draft=str(draft), context=CONTEXT, dtype="bfloat16", **flags))


def test_a_draft_with_another_vocabulary_refuses_the_start(pair, tmp_path, smollm2_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from caldrix.config import FlagError

    target, near, _ = pair
    small = tmp_path / "small"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(small)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, small / name)
    for mode in ("draft", "auto"):
        with pytest.raises(FlagError, match=r"--draft .*small: cannot draft for this model: vocab size: the target "
                                            r"has 49152 rows, the draft 512"):
            load_with_draft(target, small, speculate=mode)
    # Same sizes and strings, two tokens' ids swapped.
    other = tmp_path / "other"
    shutil.copytree(near, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(FlagError, match=r"token ids: 2 tokens have another id \(e\.g\. "):
        load_with_draft(target, other, speculate="draft")
    # Another eos id.
    eos = tmp_path / "eos"
    shutil.copytree(near, eos)
    gc = json.loads((eos / "generation_config.json").read_text())
    gc["eos_token_id"] = [2, 7]
    (eos / "generation_config.json").write_text(json.dumps(gc))
    with pytest.raises(FlagError, match=r"eos ids: the target stops on \[2\], the draft on \[2, 7\]"):
        load_with_draft(target, eos, speculate="draft")


def test_auto_gives_way_to_ngram_when_the_draft_does_not_load(pair, tmp_path):
    target, _, _ = pair
    rt = load_with_draft(target, tmp_path / "missing", speculate="auto",
                         speculation_memory=str(tmp_path / "m.json"))
    assert rt.speculation.mode == "ngram"
    note = [n for n in rt.notes if "--draft" in n][0]
    assert "did not load" in note and "n-gram lookup instead" in note and "neither read nor written" in note
    assert rt.scheduler.policy.memory is None and not (tmp_path / "m.json").exists()
    from caldrix.config import FlagError

    with pytest.raises(FlagError, match="--draft .*missing: did not load"):
        load_with_draft(target, tmp_path / "missing", speculate="draft")


def test_auto_takes_the_draft_and_explicit_modes_refuse_a_batched_server(pair):
    from caldrix.config import FlagError

    target, near, _ = pair
    rt = load_with_draft(target, near, speculate="auto")
    assert rt.speculation.mode == "draft" and rt.engine.drafter is not None
    lines = []
    rt.announce(lines.append)
    assert f"caldrix: speculation draft {near}, guesses tuned live, for greedy requests" in lines
    rt = load_with_draft(target, near, speculate="auto", max_batch=2)
    assert rt.speculation is None and "batched (--max-batch 2)" in rt.notes[-1]
    with pytest.raises(FlagError, match=r"--speculate draft: the server is batched"):
        load_with_draft(target, near, speculate="draft", max_batch=2)


@pytest.mark.parametrize("args, says", [
    (["--speculate", "draft"], "--speculate draft: needs --draft"),
    (["--speculate", "draft", "--draft", "d", "--max-batch", "2"], "restart with --max-batch 1"),
    (["--speculate", "ngram", "--draft", "d"], "--draft: needs --speculate draft or auto"),
])
def test_draft_flags_refused_before_loading(args, says):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "caldrix", "serve", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and says in out.stderr, out.stderr


def test_speculation_memory_round_trip_through_a_restart(pair, tmp_path):
    """Served with a draft, greedy replies as plain; the tuner's state is in the file after the
    server stops, and a restart reads it with no note. A foreign file is a note and a fresh
    start (then replaced); a path that cannot be written is a note."""
    import httpx

    from server_harness import ServerProcess

    target, near, _ = pair
    mem = tmp_path / "spec.json"
    flags = ("--context", str(CONTEXT), "--dtype", "bfloat16", "--speculate", "draft", "--draft", str(near),
             "--speculation-memory", str(mem))
    body = {"prompt": "one two three one two three one two", "max_tokens": 24, "temperature": 0}
    with ServerProcess.start(target, "--context", str(CONTEXT), "--dtype", "bfloat16") as plain:
        body["model"] = httpx.get(plain.url + "/v1/models").json()["data"][0]["id"]
        want = httpx.post(plain.url + "/v1/completions", json=body, timeout=120).json()
    with ServerProcess.start(target, *flags) as srv:
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        spec = got["usage"]["speculative"]
        assert spec["proposed"] > 0
        from openai import OpenAI

        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["choices"][0]["text"]
        streamed = chunks[-1].usage.model_extra["speculative"]
        assert streamed["proposed"] > 0
        recs = httpx.get(srv.url + "/debug/requests").json()["data"]
        assert [r["speculative"] for r in recs[-2:]] == [spec, streamed]
        metrics = httpx.get(srv.url + "/metrics").text.splitlines()
        drafts = [x for x in metrics if x.startswith("caldrix:spec_decode_num_draft_tokens_total")]
        assert float(drafts[0].split()[-1]) == spec["proposed"] + streamed["proposed"]
        assert "--speculation-memory" not in srv.stderr
    saved = json.loads(mem.read_text())
    assert saved["identity"].startswith("target=") and " draft=" in saved["identity"]
    assert saved["tuner"]["seconds"]  # pass times were measured and kept
    # The restart (load_runtime is what `caldrix serve` runs at start): read, no note.
    mem_flags = dict(speculate="draft", speculation_memory=str(mem))
    rt = load_with_draft(target, near, **mem_flags)
    assert not [n for n in rt.notes if "--speculation-memory" in n], rt.notes
    kept = rt.scheduler.policy.tuner.state().to_json()
    assert kept == saved["tuner"]
    saved["identity"] = "target=0 draft=0"
    mem.write_text(json.dumps(saved))
    rt = load_with_draft(target, near, **mem_flags)
    assert any("written for another pair of models" in n for n in rt.notes), rt.notes
    assert json.loads(mem.read_text())["identity"] != "target=0 draft=0"
    mem.write_text('{"format": "caldrix-speculation-memory/1", "ident')  # torn
    rt = load_with_draft(target, near, **mem_flags)
    assert any("unreadable" in n and "starting fresh" in n for n in rt.notes), rt.notes


def test_speculation_memory_on_a_path_that_cannot_be_written_is_a_note(pair, tmp_path):
    target, near, _ = pair
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    rt = load_with_draft(target, near, speculate="draft", speculation_memory=str(blocker / "m.json"))
    assert any("cannot be written" in n and "not kept" in n for n in rt.notes), rt.notes
    assert rt.speculation.mode == "draft"  # a note, never a failed start
