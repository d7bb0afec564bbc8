"""OpenAI request fields the server accepts only at values that change nothing here.

Real clients send fields this server has no use for: the openai SDK's users set `user`, some tools send
`store: false` or `tool_choice: "none"`. Refusing those would break the clients; silently ignoring a *working* value
(`store: true`) would make a client believe it got what it asked for. So each
field here is taken at its neutral values (the ones that leave the output as it is: the field's default, or an
identifier the server has no use for), logged by the server as ignored, and refused at any other value with a 400
naming the field (code "unsupported_value"). A field in neither this table nor the request models stays refused
as unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, create_model, field_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED = "unsupported_value"  # the pydantic error type (and the 400's code) of a non-neutral value
CHAT, COMPLETION = "chat", "completion"


def _anything(_value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Neutral:
    kind: Any  # the field's type on the wire (a wrong type is an ordinary invalid_value)
    neutral: Callable[[Any], bool]  # whether a value leaves the output as it is
    takes: str  # the neutral values, in the error's words
    endpoints: tuple[str, ...] = (CHAT, COMPLETION)


FIELDS: dict[str, Neutral] = {
    # identifiers and tags for the provider's own bookkeeping: any value
    "user": Neutral(str, _anything, "any end-user id"),
    "safety_identifier": Neutral(str, _anything, "any end-user id", (CHAT,)),
    "prompt_cache_key": Neutral(str, _anything, "any key (the prefix cache here needs none)", (CHAT,)),
    "metadata": Neutral(dict[str, str], _anything, "any tags", (CHAT,)),
    # sampling and output controls, at their defaults
    "best_of": Neutral(int, lambda v: v == 1, "1", (COMPLETION,)),
    "suffix": Neutral(str, lambda v: not v, '"" (no text after the completion)', (COMPLETION,)),
    "modalities": Neutral(list[str], lambda v: v == ["text"], '["text"]', (CHAT,)),
    # vLLM's, for its slow tokenizers' decoding: the tokenizers library's decoding has no such spaces to add
    "spaces_between_special_tokens": Neutral(bool, _anything, "true or false (no effect with this tokenizer)"),
    # the provider's storage and tiers: this server stores nothing and has one tier
    "store": Neutral(bool, lambda v: v is False, "false (completions are not stored)", (CHAT,)),
    "service_tier": Neutral(str, lambda v: v in ("auto", "default"), '"auto" or "default" (one tier)', (CHAT,)),
}


class _Fields(BaseModel):
    """The base of the ignorable fields' models: every value checked against its neutral ones."""

    model_config = ConfigDict(extra="forbid", strict=False)

    @field_validator(*FIELDS, check_fields=False)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        spec = FIELDS[info.field_name]
        if value is not None and not spec.neutral(value):
            raise PydanticCustomError(UNSUPPORTED, "{value} is not implemented by this server; it takes only {takes}",
                                      {"value": repr(value), "takes": spec.takes})
        return value


def fields_model(endpoint: str) -> type[BaseModel]:
    """A base for `endpoint`'s request model: one optional field for each ignorable field it takes."""
    return create_model(f"Ignored{endpoint.title()}Fields", __base__=_Fields,
                        **{name: (n.kind | None, None) for name, n in FIELDS.items() if endpoint in n.endpoints})


def ignored(body: BaseModel) -> list[str]:
    """The ignorable fields `body` set (each at a neutral value: the model refused any other)."""
    return [name for name in FIELDS if name in body.model_fields_set and getattr(body, name, None) is not None]
