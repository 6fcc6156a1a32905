"""decider_config.json: read once when the model loads, checked strictly.

A model directory with a decider_config.json beside its weights is a decider (http-api.md, "The
decider reading"). The file says how decider's own package reads the model's answers; caldrix
builds one of the forms it can name (the plain layout, one temperature, levels asked together or
one at a time) and refuses the rest by name rather than read a model in a form it was not trained
on. Keys fall in four groups:

- built: temperature (required), neutralize_none (required, false), isolated_levels,
  max_options, max_state_tokens, and the layout switches schema_first, layout, chat_template and
  images in their off form;
- read by decider's package only on paths caldrix does not have, so they never change an answer
  here, and accepted after a type check: version, release_date, base, schema_first_trained,
  vllm_attention, temperature_schema_first, temperature_schema_first_by_type;
- would change answers and are not built: temperature_by_type, temperature_by_options,
  second_reading, each refused by name whatever its value;
- anything else: an unknown key, refused.

Every error is a DeciderConfigError whose message starts with the file's path and names the key.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import attrs

FILE_NAME = "decider_config.json"
MAX_FILE_BYTES = 64 * 1024
MAX_LABELS = 255
DEFAULT_MAX_STATE_TOKENS = 32768

# Keys decider's package reads only for its schema cache, its vLLM server, its /v1/models listing
# or its response's model name: none of them can change an answer read in the plain layout.
_IGNORED = ("version", "release_date", "base", "schema_first_trained", "vllm_attention",
            "temperature_schema_first", "temperature_schema_first_by_type")
_NOT_BUILT = {
    "temperature_by_type": "a temperature per answer type",
    "temperature_by_options": "a temperature that depends on the number of options",
    "second_reading": "a second reading with the options reversed",
}
_BUILT = ("temperature", "neutralize_none", "isolated_levels", "max_options", "max_state_tokens",
          "schema_first", "layout", "chat_template", "images")
KNOWN_KEYS = _BUILT + _IGNORED + tuple(_NOT_BUILT)


class DeciderConfigError(ValueError):
    """decider_config.json cannot be served; the message names the file and the key."""


@attrs.frozen
class DeciderConfig:
    """The settings of a decider_config.json that change how caldrix reads answers."""

    path: Path
    temperature: float  # every answer: softmax(label logits / temperature)
    isolated_levels: bool = False  # score levels asked one per prompt, as yes/no questions
    max_options: int = MAX_LABELS  # a choice question's most options, at most 255
    max_state_tokens: int = DEFAULT_MAX_STATE_TOKENS  # "Context:\n" + state, in tokens
    version: str | None = None  # the file's own version string, shown at start-up only


def find(model_dir: str | os.PathLike[str]) -> Path | None:
    """The decider_config.json beside a model's weights, or None: the model is not a decider."""
    path = Path(model_dir) / FILE_NAME
    return path if path.is_file() else None


def load(path: str | os.PathLike[str]) -> DeciderConfig:
    """Read and check `path`. Raises DeciderConfigError naming the file and what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DeciderConfigError(
                f"{path}: {size} bytes; a {FILE_NAME} may be at most {MAX_FILE_BYTES} bytes (64 KiB)"
            )
        raw = path.read_bytes()
    except OSError as e:
        raise DeciderConfigError(f"{path}: cannot be read: {e.strerror or e}") from e
    if len(raw) > MAX_FILE_BYTES:  # grew between the stat and the read
        raise DeciderConfigError(
            f"{path}: {len(raw)} bytes; a {FILE_NAME} may be at most {MAX_FILE_BYTES} bytes (64 KiB)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DeciderConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    return parse(text, path)


def parse(text: str, path: Path) -> DeciderConfig:
    """Check the text of a decider_config.json; `path` only names the file in errors."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise DeciderConfigError(f'{path}: the key "{key}" appears twice')
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise DeciderConfigError(f"{path}: {name} is not a JSON number")

    try:
        cfg = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_int=_whole)
    except json.JSONDecodeError as e:
        raise DeciderConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(cfg, dict):
        raise DeciderConfigError(f"{path}: must hold a JSON object, got {_kind(cfg)}")
    for key in cfg:
        if key in _NOT_BUILT:
            raise DeciderConfigError(
                f'{path}: "{key}" ({_NOT_BUILT[key]}) is not built in this release; '
                'caldrix reads every answer at the one "temperature"'
            )
        if key not in KNOWN_KEYS:
            raise DeciderConfigError(f'{path}: unknown key "{key}"; the keys read are {", ".join(KNOWN_KEYS)}')
    for key in ("temperature", "neutralize_none"):
        if key not in cfg:
            raise DeciderConfigError(f'{path}: "{key}" is required')

    temperature = _positive(cfg["temperature"], "temperature", path)
    if _bool(cfg["neutralize_none"], "neutralize_none", path):
        raise DeciderConfigError(
            f'{path}: "neutralize_none": true is not built in this release '
            "(caldrix writes every option as the request gives it); set it to false"
        )
    isolated = _bool(cfg.get("isolated_levels", False), "isolated_levels", path)
    max_options = _int(cfg.get("max_options", MAX_LABELS), "max_options", 2, MAX_LABELS, path)
    max_state = _int(cfg.get("max_state_tokens", DEFAULT_MAX_STATE_TOKENS), "max_state_tokens", 1, None, path)
    if _bool(cfg.get("schema_first", False), "schema_first", path):
        raise DeciderConfigError(
            f'{path}: "schema_first": true (the questions-first layout) is not built in this release; '
            "caldrix builds the plain state-first layout"
        )
    layout = cfg.get("layout", "plain")
    if layout == "chat":
        raise DeciderConfigError(
            f'{path}: "layout": "chat" is not built in this release; caldrix builds the plain layout'
        )
    if layout != "plain":
        raise DeciderConfigError(f'{path}: "layout" must be "plain" or "chat", got {_show(layout)}')
    if _bool(cfg.get("chat_template", False), "chat_template", path):
        raise DeciderConfigError(
            f'{path}: "chat_template": true (the chat layout) is not built in this release; '
            "caldrix builds the plain layout"
        )
    if _bool(cfg.get("images", False), "images", path):
        raise DeciderConfigError(f'{path}: "images": true is not built in this release; deciders read text only')
    for key in ("schema_first_trained",):
        if key in cfg:
            _bool(cfg[key], key, path)
    if "temperature_schema_first" in cfg:
        _positive(cfg["temperature_schema_first"], "temperature_schema_first", path)
    for key in ("release_date", "base", "vllm_attention"):
        if key in cfg and not isinstance(cfg[key], str):
            raise DeciderConfigError(f'{path}: "{key}" must be a string, got {_kind(cfg[key])}')
    by_type = cfg.get("temperature_schema_first_by_type")
    if by_type is not None and not isinstance(by_type, dict):
        raise DeciderConfigError(f'{path}: "temperature_schema_first_by_type" must be an object, got {_kind(by_type)}')
    version = cfg.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int, float, _Huge))):
        raise DeciderConfigError(f'{path}: "version" must be a string or a number, got {_kind(version)}')
    return DeciderConfig(
        path=path,
        temperature=temperature,
        isolated_levels=isolated,
        max_options=max_options,
        max_state_tokens=max_state,
        version=None if version is None else version.text if isinstance(version, _Huge) else str(version),
    )


def startup_lines(cfg: DeciderConfig) -> list[str]:
    """What start-up says about a decider, one fact a line, without the "caldrix: " lead."""
    version = f" {cfg.version}" if cfg.version else ""
    levels = "one yes/no prompt per level" if cfg.isolated_levels else "all levels in one prompt"
    return [
        f"a decider{version} ({cfg.path.name}): /v1/systemone reads it in its own trained format",
        f"decider temperature {cfg.temperature:g}, up to {cfg.max_options} options a choice, "
        f"score levels: {levels}, states up to {cfg.max_state_tokens} tokens",
    ]


@attrs.frozen
class _Huge:
    """An integer too long for Python's int() (over 4300 digits): kept as its text, so a check
    refuses it by name instead of the parser raising."""

    text: str


def _whole(text: str) -> int | _Huge:
    try:
        return int(text)
    except ValueError:
        return _Huge(text)


def _positive(value: Any, key: str, path: Path) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)  # an int past float's range overflows here
        except OverflowError:
            pass
    if number is None or not math.isfinite(number) or number <= 0:
        raise DeciderConfigError(f'{path}: "{key}" must be a finite number > 0, got {_show(value)}')
    return number


def _bool(value: Any, key: str, path: Path) -> bool:
    if not isinstance(value, bool):
        raise DeciderConfigError(f'{path}: "{key}" must be true or false, got {_show(value)}')
    return value


def _int(value: Any, key: str, lo: int, hi: int | None, path: Path) -> int:
    bounds = f"from {lo} to {hi}" if hi is not None else f"{lo} or more"
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise DeciderConfigError(f'{path}: "{key}" must be a whole number {bounds}, got {_show(value)}')
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float, _Huge)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: Any) -> str:
    text = value.text if isinstance(value, _Huge) else json.dumps(value, ensure_ascii=False, default=lambda h: h.text)
    return text if len(text) <= 60 else text[:57] + "..."
