"""decider_config.json: what loads, and every refusal with its exact wording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from caldrix.decider import config as dc
from caldrix.decider.config import DeciderConfig, DeciderConfigError

DECIDER_0_8B_LIKE = {  # the keys third-party pins show for decider-0.8b, plus the spec's two required ones
    "version": "0.8b-v1", "temperature": 1.03, "neutralize_none": False, "base": "Qwen/Qwen3.5-0.8B-Base",
    "max_options": 255, "isolated_levels": True, "max_state_tokens": 32768, "schema_first": False,
    "schema_first_trained": False, "temperature_schema_first": 1.18,
}


def write(tmp_path: Path, body) -> Path:
    path = tmp_path / "decider_config.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body), encoding="utf-8")
    return path


def error(tmp_path: Path, body) -> str:
    path = write(tmp_path, body)
    with pytest.raises(DeciderConfigError) as e:
        dc.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ")
    return message[len(f"{path}: "):]


def test_a_full_config_loads_with_its_settings(tmp_path):
    path = write(tmp_path, {**DECIDER_0_8B_LIKE, "layout": "plain", "chat_template": False, "images": False,
                            "release_date": "2026-09-17", "vllm_attention": "FLASH_ATTN",
                            "temperature_schema_first_by_type": {"choice": 1.2}})
    assert dc.load(path) == DeciderConfig(path=path, temperature=1.03, isolated_levels=True, max_options=255,
                                          max_state_tokens=32768, version="0.8b-v1")
    assert dc.find(tmp_path) == path and dc.find(tmp_path / "elsewhere") is None


def test_defaults_and_the_start_up_lines(tmp_path):
    cfg = dc.load(write(tmp_path, {"temperature": 2, "neutralize_none": False}))
    assert cfg == DeciderConfig(path=cfg.path, temperature=2.0)
    assert type(cfg.temperature) is float
    assert dc.startup_lines(cfg) == [
        "a decider (decider_config.json): /v1/systemone reads it in its own trained format",
        "decider temperature 2, up to 255 options a choice, score levels: all levels in one prompt, "
        "states up to 32768 tokens",
    ]
    cfg = dc.load(write(tmp_path, DECIDER_0_8B_LIKE))
    assert dc.startup_lines(cfg) == [
        "a decider 0.8b-v1 (decider_config.json): /v1/systemone reads it in its own trained format",
        "decider temperature 1.03, up to 255 options a choice, score levels: one yes/no prompt per level, "
        "states up to 32768 tokens",
    ]


BASE = {"temperature": 1.0, "neutralize_none": False}
KEYS = ("temperature, neutralize_none, isolated_levels, max_options, max_state_tokens, schema_first, layout, "
        "chat_template, images, version, release_date, base, schema_first_trained, vllm_attention, "
        "temperature_schema_first, temperature_schema_first_by_type, temperature_by_type, temperature_by_options, "
        "second_reading")


@pytest.mark.parametrize(
    "body, message",
    [
        ({"neutralize_none": False}, '"temperature" is required'),
        ({"temperature": 1.0}, '"neutralize_none" is required'),
        ({**BASE, "temprature": 1.0}, f'unknown key "temprature"; the keys read are {KEYS}'),
        ({**BASE, "temperature_by_type": {"choice": 1.1}},
         '"temperature_by_type" (a temperature per answer type) is not built in this release; '
         'caldrix reads every answer at the one "temperature"'),
        ({**BASE, "temperature_by_type": {}},
         '"temperature_by_type" (a temperature per answer type) is not built in this release; '
         'caldrix reads every answer at the one "temperature"'),
        ({**BASE, "temperature_by_options": {"a": 1, "b": 0}},
         '"temperature_by_options" (a temperature that depends on the number of options) is not built in this '
         'release; caldrix reads every answer at the one "temperature"'),
        ({**BASE, "second_reading": {"below": 0.5}},
         '"second_reading" (a second reading with the options reversed) is not built in this release; '
         'caldrix reads every answer at the one "temperature"'),
        ({**BASE, "neutralize_none": True},
         '"neutralize_none": true is not built in this release (caldrix writes every option as the request gives '
         "it); set it to false"),
        ({**BASE, "schema_first": True},
         '"schema_first": true (the questions-first layout) is not built in this release; '
         "caldrix builds the plain state-first layout"),
        ({**BASE, "layout": "chat"}, '"layout": "chat" is not built in this release; caldrix builds the plain layout'),
        ({**BASE, "layout": "fancy"}, '"layout" must be "plain" or "chat", got "fancy"'),
        ({**BASE, "chat_template": True},
         '"chat_template": true (the chat layout) is not built in this release; caldrix builds the plain layout'),
        ({**BASE, "images": True}, '"images": true is not built in this release; deciders read text only'),
        ({**BASE, "temperature": 0}, '"temperature" must be a finite number > 0, got 0'),
        ({**BASE, "temperature": -1.5}, '"temperature" must be a finite number > 0, got -1.5'),
        ({**BASE, "temperature": "1.3"}, '"temperature" must be a finite number > 0, got "1.3"'),
        ({**BASE, "temperature": True}, '"temperature" must be a finite number > 0, got true'),
        ({**BASE, "temperature": 1e400}, '"temperature" must be a finite number > 0, got Infinity'),
        ({**BASE, "neutralize_none": "false"}, '"neutralize_none" must be true or false, got "false"'),
        ({**BASE, "isolated_levels": 1}, '"isolated_levels" must be true or false, got 1'),
        ({**BASE, "schema_first_trained": None}, '"schema_first_trained" must be true or false, got null'),
        ({**BASE, "max_options": 256}, '"max_options" must be a whole number from 2 to 255, got 256'),
        ({**BASE, "max_options": 255.0}, '"max_options" must be a whole number from 2 to 255, got 255.0'),
        ({**BASE, "max_options": 1}, '"max_options" must be a whole number from 2 to 255, got 1'),
        ({**BASE, "max_state_tokens": 0}, '"max_state_tokens" must be a whole number 1 or more, got 0'),
        ({**BASE, "temperature_schema_first": 0}, '"temperature_schema_first" must be a finite number > 0, got 0'),
        ({**BASE, "base": 5}, '"base" must be a string, got a number'),
        ({**BASE, "temperature_schema_first_by_type": [1]},
         '"temperature_schema_first_by_type" must be an object, got an array'),
        ({**BASE, "version": ["v1"]}, '"version" must be a string or a number, got an array'),
        ([BASE], "must hold a JSON object, got an array"),
        ('{"temperature": 1, "temperature": 2, "neutralize_none": false}', 'the key "temperature" appears twice'),
        ('{"temperature": NaN, "neutralize_none": false}', "NaN is not a JSON number"),
        ('{"temperature": 1,', "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 19"),
        # integers past float's range, and past Python's int() (4300 digits): refused by name, not raised
        ('{"temperature": 1' + "0" * 400 + ', "neutralize_none": false}',
         '"temperature" must be a finite number > 0, got 1' + "0" * 56 + "..."),
        ('{"temperature": 1, "neutralize_none": false, "temperature_schema_first": -' + "9" * 400 + "}",
         '"temperature_schema_first" must be a finite number > 0, got -' + "9" * 56 + "..."),
        ('{"temperature": 1, "neutralize_none": false, "max_state_tokens": ' + "7" * 5000 + "}",
         '"max_state_tokens" must be a whole number 1 or more, got ' + "7" * 57 + "..."),
        ('{"temperature": ' + "7" * 5000 + ', "neutralize_none": false}',
         '"temperature" must be a finite number > 0, got ' + "7" * 57 + "..."),
    ],
)
def test_every_refusal_names_the_key(tmp_path, body, message):
    if isinstance(body, dict) and body.get("temperature") == 1e400:
        body = json.dumps(body).replace("Infinity", "1e400")
    assert error(tmp_path, body) == message


def test_a_file_over_64_kib_is_refused_naming_the_file_and_the_limit(tmp_path):
    body = json.dumps({**BASE, "version": "x" * 70000})
    assert error(tmp_path, body) == (
        f"{len(body.encode())} bytes; a decider_config.json may be at most 65536 bytes (64 KiB)"
    )
    # exactly at the limit still loads
    pad = 65536 - len(json.dumps({**BASE, "version": ""}).encode())
    path = write(tmp_path, json.dumps({**BASE, "version": "x" * pad}))
    assert path.stat().st_size == 65536 and dc.load(path).version == "x" * pad


def test_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "decider_config.json"
    path.write_bytes(b'{"temperature": 1, "neutralize_none": false, "version": "\xff"}')
    with pytest.raises(DeciderConfigError, match=r"decider_config.json: not UTF-8 text \(invalid start byte at byte 57\)"):
        dc.load(path)


def test_a_model_directory_is_a_decider_when_it_holds_the_file(tmp_path, qwen35_tokenizer):
    from caldrix.decider import Decider, DeciderConfigError

    assert Decider.load(tmp_path, qwen35_tokenizer, 248320) is None
    write(tmp_path, DECIDER_0_8B_LIKE)
    d = Decider.load(tmp_path, qwen35_tokenizer, 248320)
    assert d.config.temperature == 1.03 and d.config.isolated_levels and len(d.labels.ids) == 255
    write(tmp_path, {**DECIDER_0_8B_LIKE, "images": True})
    with pytest.raises(DeciderConfigError, match='"images": true is not built in this release'):
        Decider.load(tmp_path, qwen35_tokenizer, 248320)
