"""The decider reading of /v1/systemone (http-api.md "The decider reading").

A model directory with a decider_config.json beside its weights is a decider. This package holds
what is particular to reading one, and nothing of the route, the scheduler or the engine:

- config: decider_config.json, read once at load and checked strictly (DeciderConfig);
- prompt: the prompt pieces from token ids, exactly as decider-ai 1.10.0 builds them, and the
  label table;
- limits: the decider's refusals, worded as the spec words them (Refusal);
- plan: Decider (made at load) and plan_request(), which checks a request and builds its DeciderPrompts;
- reading: label probabilities and the answers.
"""

from caldrix.decider.config import DeciderConfig, DeciderConfigError, startup_lines
from caldrix.decider.limits import Refusal
from caldrix.decider.plan import Decider, DeciderPrompts, QuestionPlan, Row, plan_request
from caldrix.decider.prompt import LabelError, Labels

__all__ = [
    "Decider",
    "DeciderConfig",
    "DeciderConfigError",
    "DeciderPrompts",
    "LabelError",
    "Labels",
    "QuestionPlan",
    "Refusal",
    "Row",
    "plan_request",
    "startup_lines",
]
