"""The zero-shot prompt: one user message per question, through the model's chat template with
thinking turned off.

Layout of the user message (the state first, so that every question of a request starts with
the same tokens and the scheduler's held-row reuse skips them; docs/systemone.md):

    State:
    <state>

    Question:
    <instructions>                       (left out when absent, null or "")

    Options:                             (choice; "Levels:" for score)
    A. <option name>: <description>      (": <description>" left out when null)
    ...

    Reply with the letter of the best option (A, B or C) and nothing else.

A noul question lists "Yes means: ..." and "No means: ..." for the criteria it was given, and
asks for Yes or No. A string is written as it is; an object or array as compact JSON
(jsonlex.compact). The message goes through the template with add_generation_prompt=True and
enable_thinking=False (Qwen3's switch; a template that does not read it renders as it is), and
is then tokenized without adding special tokens, since the template writes its own.
"""

from __future__ import annotations

from typing import Any, Sequence

from caldrix.systemone import jsonlex
from caldrix.systemone.jsonlex import Value
from caldrix.systemone.request import Question


def text_of(value: Value) -> str:
    """A value as the prompt writes it: a string as it is, anything else as compact JSON."""
    return value if isinstance(value, str) else jsonlex.compact(value)


def either(labels: Sequence[str]) -> str:
    """"A", "A or B", "A, B or C"."""
    if len(labels) == 1:
        return labels[0]
    return f"{', '.join(labels[:-1])} or {labels[-1]}"


def user_message(state: Value, q: Question, labels: Sequence[str]) -> str:
    """The question's user message (see the module docstring). `labels` are the question's
    labels in option order (A, B, ... or Yes, No)."""
    parts = [f"State:\n{text_of(state)}"]
    if q.instructions is not None and q.instructions != "":
        parts.append(f"Question:\n{text_of(q.instructions)}")
    if q.kind == "noul":
        lines = [f"{label} means: {text_of(o.text)}"
                 for label, o in zip(labels, _yes_first(q)) if o.text is not None and o.text != ""]
        if lines:
            parts.append("\n".join(lines))
        parts.append("Reply with Yes or No and nothing else.")
        return "\n\n".join(parts)
    rows = []
    for label, o in zip(labels, q.options):
        if q.kind == "score":
            rows.append(f"{label}. {text_of(o.text)}")
        elif o.text is None:
            rows.append(f"{label}. {o.name}")
        else:
            rows.append(f"{label}. {o.name}: {text_of(o.text)}")
    head, what = ("Options:", "the best option") if q.kind == "choice" else ("Levels:", "the level that fits best")
    parts.append(head + "\n" + "\n".join(rows))
    parts.append(f"Reply with the letter of {what} ({either(list(labels))}) and nothing else.")
    return "\n\n".join(parts)


def _yes_first(q: Question):
    """A noul question's options in label order: true (Yes), then false (No)."""
    by_name = {o.name: o for o in q.options}
    return by_name["true"], by_name["false"]


def render(hf_tokenizer: Any, message: str, parts: bool = False) -> str:
    """The prompt text: `message` as the one user turn, through the chat template, ending with
    the assistant's generation prompt, thinking off. `parts`: hand the template the message as
    one text part, as the chat route does on a vision model, whose template (Idefics3's) writes
    only content parts and would drop a plain string."""
    return hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": message}] if parts else message}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )


def encode(hf_tokenizer: Any, text: str) -> tuple[int, ...]:
    """The rendered prompt's ids; the template already wrote the special tokens."""
    return tuple(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
