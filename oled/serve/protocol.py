"""Request and response bodies of the OpenAI-compatible API, plus LLaDA2 extras.

Every field is validated strictly, so that a wrong type or range is a 400, never a crash. Each
OpenAI parameter of a request is honoured, ignored because it asks nothing of the output
(`user`, `metadata`, ...), or `refused` unless it asks for nothing. A field the server does not
know is ignored, as self-hosted servers do (oled.serve.app names it in a warning and in the
response); inside messages and `stream_options`, unknown fields are ignored silently.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)
from pydantic_core import PydanticCustomError

MAX_TOKENS_LIMIT = 1 << 20
Number = StrictInt | StrictFloat
NO_LOGPROBS = "this server computes no log probabilities"
NO_TOOLS = "this server does not call tools"


def refused(reason: str, *neutral: Any) -> AfterValidator:
    """A parameter the server cannot honour: accepted only when it asks for nothing (None or
    one of `neutral`), else a 400 with code `unsupported_parameter`."""

    def check(value: Any) -> Any:
        if value is None or value in neutral:
            return value
        raise PydanticCustomError(
            "unsupported_parameter", "not supported ({reason})", {"reason": reason}
        )

    return AfterValidator(check)


class Lenient(BaseModel):
    """Nested request parts: ignore unknown fields."""

    model_config = ConfigDict(extra="ignore")


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Lenient):
    include_usage: StrictBool = False


class SamplingParams(BaseModel):
    """Fields shared by both endpoints; unknown fields are left out (the app reports them)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)  # below 1 only when greedy
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: Annotated[StrictInt | None, Field(ge=1, le=128), refused("one choice per request", 1)] = None
    frequency_penalty: Annotated[
        Number | None, Field(ge=-2.0, le=2.0), refused("no repetition penalties", 0)
    ] = None
    presence_penalty: Annotated[
        Number | None, Field(ge=-2.0, le=2.0), refused("no repetition penalties", 0)
    ] = None
    logit_bias: Annotated[
        dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None, refused("no logit bias", {})
    ] = None
    user: str | None = None  # ignored: names the end user
    # LLaDA2 extras
    block_length: StrictInt | None = Field(default=None, ge=1, le=4096)
    threshold: Number | None = Field(default=None, gt=0.0, le=1.0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stops(self) -> list[str]:
        """The stop strings (`stop` as the validator left it: a list, or None for none)."""
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    def wanted_tokens(self) -> int | None:
        """The answer's length the request asks for, None: the server's default."""
        return self.max_tokens


class ChatCompletionRequest(SamplingParams):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Annotated[StrictBool | None, refused(NO_LOGPROBS, False)] = None
    top_logprobs: Annotated[StrictInt | None, Field(ge=0, le=20), refused(NO_LOGPROBS)] = None
    response_format: Annotated[
        dict[str, Any] | None, refused("plain text only", {"type": "text"})
    ] = None
    tools: Annotated[list[Any] | None, refused(NO_TOOLS, [])] = None
    tool_choice: Annotated[str | dict[str, Any] | None, refused(NO_TOOLS, "none")] = None
    functions: Annotated[list[Any] | None, refused(NO_TOOLS, [])] = None
    function_call: Annotated[str | dict[str, Any] | None, refused(NO_TOOLS, "none")] = None
    parallel_tool_calls: StrictBool | None = None  # ignored: no tools
    modalities: Annotated[list[str] | None, refused("text only", ["text"])] = None
    audio: Annotated[dict[str, Any] | None, refused("text only")] = None
    prediction: Annotated[dict[str, Any] | None, refused("no predicted outputs")] = None
    reasoning_effort: Annotated[str | None, refused("not a reasoning model")] = None
    verbosity: Annotated[str | None, refused("no verbosity control")] = None
    web_search_options: Annotated[dict[str, Any] | None, refused("no web search")] = None
    store: Annotated[StrictBool | None, refused("completions are not stored", False)] = None
    service_tier: Annotated[str | None, refused("one service tier", "auto", "default")] = None
    metadata: dict[str, str] | None = None  # ignored: tags
    prompt_cache_key: str | None = None  # ignored: a caching hint
    safety_identifier: str | None = None  # ignored: names the end user

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingParams):
    prompt: str | list[StrictInt] | list[str] = Field(min_length=1)
    echo: StrictBool = False
    logprobs: Annotated[StrictInt | None, Field(ge=0, le=5), refused(NO_LOGPROBS)] = None
    best_of: Annotated[
        StrictInt | None, Field(ge=1, le=20), refused("one candidate per request", 1)
    ] = None
    suffix: Annotated[str | None, refused("no text after the completion", "")] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list) -> str | list:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (batching is not supported)")
            return value[0]
        return value


# Responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


FinishReason = Literal["stop", "length"]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    oled: dict[str, Any] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    oled: dict[str, Any] | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class Completion(BaseModel):
    """Both the whole answer and a streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    oled: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "oled-moe"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
