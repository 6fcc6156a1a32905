"""The decider's prompts, assembled from token ids exactly as decider-ai 1.10.0 assembles them.

One prompt (a "row") per question, or per level of a score question when the config asks levels
one at a time. Every row is the same two pieces (shared/research/decider.md 1.1-1.8):

    state ids     encode("Context:\\n" + STATE)                        one encode call
    question ids  encode("\\n\\nQuestion: " + Q + "\\nOptions:" +
                         "\\n(A) " + O[0] + ... + "\\nAnswer: (")        one call, up to 10 options
              or  encode(head) + per option: encode("\\n(") + [label id] + encode(") " + O[j])
                  + encode("\\nAnswer: (")                              more than 10 options

`encode` adds nothing (no BOS, no template); text that spells a special token becomes that token,
as in decider's package. The state piece and the question piece are separate encodes, so the end
of the state is always a token boundary: the engine reads the state once, keeps the model's state
there, and reads each question from that point. The answer is read at the row's last token over
the row's label ids (A, B, ... from the label table).

JSON values arrive as the request parser gives them: str, bool, None, dicts (key order kept),
lists, and numbers as int or float, or as an int or float subclass, or as any object with a
`lexeme` attribute holding the request's spelling of the number. A number is written in
canonical form (http-api.md): an integer lexeme exactly, any other as Python's repr of the
64-bit float it reads as, which is what json.dumps writes for the int and float that Python's
json parser gives decider's package. Objects and arrays are written with a space after "," and
":", non-ASCII raw (json.dumps(..., ensure_ascii=False)).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

import attrs

Encode = Callable[[str], list[int]]

NARROW = 10  # up to this many options the letters are written as text (A..J)
LETTERS = "ABCDEFGHIJ"
MAX_LABELS = 255
INDEX_FROM = 8  # a list in the state this long or longer carries each element's _index
NOUL_WITHOUT_INSTRUCTIONS = "Which answer fits the context?"
ISOLATED = "{q}\nProposed answer: {level}\nDoes the proposed answer fit?"
_LEVEL_NUMBER = re.compile(r"^\s*-?\d+\s*:\s*")


class LabelError(ValueError):
    """The tokenizer cannot give a decider its labels; the model cannot be served as one."""


# ---------------------------------------------------------------------------------------------
# The tokenizer


def encoder(tokenizer: Any) -> Encode:
    """`text -> ids` without special tokens added, for a caldrix Tokenizer (its transformers
    tokenizer is used), a transformers tokenizer, or a `tokenizers.Tokenizer`."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if hasattr(hf, "backend_tokenizer") or hasattr(hf, "apply_chat_template"):
        return lambda text: list(hf.encode(text, add_special_tokens=False))
    return lambda text: list(hf.encode(text, add_special_tokens=False).ids)


@attrs.frozen
class Labels:
    """The label table: A..Z, then the two-letter labels that are one token each, 255 in all."""

    names: tuple[str, ...]
    ids: tuple[int, ...]
    open_ids: tuple[int, ...]  # the ids of "\n(", written before each label of a wide question


def label_table(encode: Encode, vocab_size: int | None = None) -> Labels:
    """The labels of a tokenizer, as decider's package finds them: each candidate encoded alone
    (no space, no parenthesis) and kept when it is exactly one id. Raises LabelError when fewer
    than 255 candidates are one token, when two share an id, or when an id is not below
    `vocab_size` (the model's embedding rows)."""
    candidates = list(string.ascii_uppercase) + [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
    names: list[str] = []
    ids: list[int] = []
    for name in candidates:
        got = encode(name)
        if len(got) == 1:
            names.append(name)
            ids.append(got[0])
            if len(names) == MAX_LABELS:
                break
    if len(names) < MAX_LABELS:
        raise LabelError(
            f"the tokenizer makes only {len(names)} of the labels A..Z, AA..ZZ one token each; a decider needs {MAX_LABELS}"
        )
    if len(set(ids)) != len(ids):
        raise LabelError("the tokenizer gives two decider labels the same token")
    if vocab_size is not None:
        for name, i in zip(names, ids):
            if i >= vocab_size:
                raise LabelError(f"the label {name} is token {i}, outside the model's {vocab_size}-token vocabulary")
    return Labels(names=tuple(names), ids=tuple(ids), open_ids=tuple(encode("\n(")))


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token can stand for, for the state pre-check.

    A byte-level vocabulary (Qwen, SmolLM2) writes each byte as one character, so a token's
    length in characters is its length in bytes. Otherwise a token's UTF-8 length is used, which
    is never less than the bytes it stands for (SentencePiece's "\u2581" is 3 bytes for a space).
    Added tokens count their text's UTF-8 length."""
    from tokenizers import Tokenizer as Backend

    hf = getattr(tokenizer, "hf", tokenizer)
    backend = hf if isinstance(hf, Backend) else getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, Backend):  # a slow transformers tokenizer: its vocabulary as text
        return max((len(k.encode("utf-8")) for k in hf.get_vocab()), default=1)
    byte_level = type(backend.decoder).__name__ == "ByteLevel"
    vocab = backend.get_vocab(with_added_tokens=False)
    longest = max((len(k) if byte_level else len(k.encode("utf-8")) for k in vocab), default=1)
    for token in backend.get_added_tokens_decoder().values():
        longest = max(longest, len(token.content.encode("utf-8")))
    return max(longest, 1)


# ---------------------------------------------------------------------------------------------
# Text of JSON values


def _number(lexeme: str) -> str:
    """A number's canonical form from its spelling: an integer exactly, at any size (written
    from the text, since Python's int() refuses more than 4300 digits); any other number as
    json.dumps writes the 64-bit float it reads as."""
    if not any(c in lexeme for c in ".eE"):
        return "0" if lexeme == "-0" else lexeme
    return json.dumps(float(lexeme))


def _write(value: Any, out: list[str]) -> None:
    lexeme = getattr(value, "lexeme", None)
    if isinstance(lexeme, str):  # a number as the request spelled it: canonical from the spelling
        out.append(_number(lexeme))
    elif isinstance(value, (str, bool, int, float)) or value is None:
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, Mapping):
        out.append("{")
        for i, (k, v) in enumerate(value.items()):
            out.append(", " if i else "")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(": ")
            _write(v, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, v in enumerate(value):
            out.append(", " if i else "")
            _write(v, out)
        out.append("]")
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


def to_json(value: Any) -> str:
    """JSON with a space after "," and ":", keys in order, non-ASCII raw: what
    json.dumps(..., ensure_ascii=False) writes for the value decider's package parses, numbers
    in canonical form (module docstring)."""
    out: list[str] = []
    _write(value, out)
    return "".join(out)


def text_of(value: Any) -> str:
    """A string as itself; any other JSON value as JSON."""
    return value if isinstance(value, str) else to_json(value)


def annotate(value: Any) -> Any:
    """The state with each element of a list of 8 or more carrying its position: a dict element
    gets "_index" as its first key (its own "_index", if any, keeps that place but its value);
    any other element becomes {"_index": i, "value": element}. Applied at every depth."""
    if isinstance(value, Mapping):
        return {k: annotate(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) < INDEX_FROM:
            return [annotate(v) for v in value]
        out = []
        for i, v in enumerate(value):
            if isinstance(v, Mapping):
                item: dict[str, Any] = {"_index": i}
                item.update(annotate(v))
            else:
                item = {"_index": i, "value": annotate(v)}
            out.append(item)
        return out
    return value


def state_text(state: Any) -> str:
    """The text after "Context:\\n": a string state as it is, an object or array as JSON with
    _index written into its long lists."""
    return state if isinstance(state, str) else to_json(annotate(state))


# ---------------------------------------------------------------------------------------------
# Questions


def field(question: Any, name: str) -> Any:
    """A question's "type", "instructions" or "criteria": from a mapping (absent reads as None)
    or from a record's attribute of that name. Absent and null instructions mean the same to a
    decider, as do absent and null noul criteria."""
    if isinstance(question, Mapping):
        return question.get(name)
    return getattr(question, name, None)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "")


def strip_level_number(text: str) -> str:
    """A level's text without a leading number and colon ("2: somewhat" -> "somewhat")."""
    return _LEVEL_NUMBER.sub("", text, count=1)


@attrs.frozen
class QuestionText:
    """A question as the model reads it: its text and its options' text, in label order."""

    text: str
    options: tuple[str, ...]


def render(question: Any) -> QuestionText:
    """A checked question (type choice, score or noul, the decider limits met) as text.

    choice: each option "name", or "name: description" when the description is neither null nor
    "". score: each level "i: level". noul: "no" and "yes", each followed by ": description"
    when criteria describe false and true. A noul without instructions asks the fixed sentence
    "Which answer fits the context?"."""
    kind = field(question, "type")
    criteria = field(question, "criteria")
    instructions = field(question, "instructions")
    if kind == "noul" and _empty(instructions):
        text = NOUL_WITHOUT_INSTRUCTIONS
    else:
        text = text_of(instructions)
    if kind == "choice":
        options = tuple(n if _empty(d) else f"{n}: {text_of(d)}" for n, d in criteria.items())
    elif kind == "score":
        options = tuple(f"{i}: {text_of(level)}" for i, level in enumerate(criteria))
    elif kind == "noul":
        c = criteria if criteria is not None else {}
        no, yes = c.get("false"), c.get("true")
        options = ("no" if _empty(no) else f"no: {text_of(no)}", "yes" if _empty(yes) else f"yes: {text_of(yes)}")
    else:
        raise ValueError(f"not a decider question type: {kind!r}")
    return QuestionText(text=text, options=options)


def isolated_levels(question: Any) -> tuple[QuestionText, ...]:
    """A score question asked one level at a time: per level, a yes/no question about it."""
    instructions = text_of(field(question, "instructions"))
    return tuple(
        QuestionText(text=ISOLATED.format(q=instructions, level=strip_level_number(text_of(level))), options=("no", "yes"))
        for level in field(question, "criteria")
    )


def question_ids(encode: Encode, labels: Labels, q: QuestionText) -> list[int]:
    """The ids of one question piece, from "\\n\\nQuestion:" to the final "Answer: (" token."""
    head = f"\n\nQuestion: {q.text}\nOptions:"
    tail = "\nAnswer: ("
    if len(q.options) <= NARROW:
        return encode(head + "".join(f"\n({LETTERS[j]}) {o}" for j, o in enumerate(q.options)) + tail)
    ids = encode(head)
    for j, option in enumerate(q.options):
        ids += list(labels.open_ids)
        ids.append(labels.ids[j])
        ids += encode(f") {option}")
    return ids + encode(tail)


def state_ids(encode: Encode, text: str) -> list[int]:
    """The ids of the state piece: one encode of "Context:\\n" and the state text together."""
    return encode("Context:\n" + text)
