"""POST /v1/systemone's front-end logic: the body's JSON (jsonlex), its validation (request),
the zero-shot prompt (prompt) and the readings (reading). The route is caldrix/routes/systemone.py."""
