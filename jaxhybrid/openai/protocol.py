"""The OpenAI request bodies with vLLM's extras, parsed into `SamplingParams`.

Unknown fields are accepted and ignored, as vLLM does (clients send fields a server does not know);
vLLM's fields we do not implement (`suffix`, `best_of`, structural tags, beam search, ...
`_UNSUPPORTED`) are refused with a 400 when set to anything but their default, rather than silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxhybrid.engine.prompts import PromptPreparer
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.openai import render
from jaxhybrid.openai.errors import BadRequest, as_bad_request
from jaxhybrid.openai.tool_choice import forced_schema
from jaxhybrid.parsers.messages import ChatTool
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams

LONG_MIN, LONG_MAX = -2 ** 63, 2 ** 63 - 1  # a request's seed is a signed 64-bit integer (vLLM)
# The most prompts one request may list (the queue's bound refuses fewer), and messages one conversation may
# hold: past them validation stops at once, where a body of a million `[]` would hold up the event loop
MAX_PROMPTS, MAX_MESSAGES = 4096, 16384
# a request's stop conditions, checked for every token it generates
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 4096, 1024


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # vLLM's (an empty stream_options adds no usage)
    continuous_usage_stats: bool | None = False  # usage on every chunk too


def _unset(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return not value


# vLLM request fields this server does not implement -> "the value is vLLM's default (or changes nothing)";
# any other value is a 400 naming the field
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _off, "length_penalty": lambda v: v == 1, "watermarking": _off,
    "spaces_between_special_tokens": lambda v: v is True,
    "prompt_embeds": _unset, "priority": lambda v: v == 0,
    "guided_json": _unset, "guided_regex": _unset, "guided_choice": _unset, "guided_grammar": _unset,
    "structural_tag": _unset,
    "kv_transfer_params": _unset, "ec_transfer_params": _unset, "vllm_xargs": _unset,
    "repetition_detection": _unset, "thinking_token_budget": lambda v: v in (None, -1),
    "stream_interval": lambda v: v in (None, 1),
}
_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "documents": _unset, "chat_template": _unset, "mm_processor_kwargs": _unset,
    "media_io_kwargs": _unset, "return_prompt_text": _off,
}


class _Request(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=LONG_MIN, le=LONG_MAX)
    stop: str | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                          Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None  # the response id's default (an X-Request-Id header wins)
    logprob_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    _unsupported: ClassVar[dict[str, Callable[[Any], bool]]] = _UNSUPPORTED

    def engine_prompt(self, prompts: PromptPreparer, prompt: str | list[int] | dict, params: SamplingParams) -> Prompt:
        """`prompt_for` with this request's truncation side and special-token choice (every entry point
        that reads a request prepares its prompts here, so none can drop an option)."""
        return render.prompt_for(prompts, prompt, params, self.truncation_side, self.add_special_tokens)

    def check(self) -> None:
        extra = self.model_extra or {}
        for name, is_default in self._unsupported.items():
            if name in extra and not is_default(extra[name]):
                raise BadRequest(f"{name} is not supported by this server (only its default)", name)
        self._check_logprob_token_ids()
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs is not available when streaming", "prompt_logprobs")

    def _check_logprob_token_ids(self) -> None:
        """vLLM's rules for the field first, so a malformed one says what is wrong; a well-formed one is
        refused: the engine reports top-k logprobs, not those of chosen ids."""
        if self.logprob_token_ids is None:
            return
        if not self.logprob_token_ids:
            raise BadRequest("`logprob_token_ids` must not be an empty list", "logprob_token_ids")
        if self.logprobs is None or self.logprobs is False:
            raise BadRequest("`logprobs` must be set when using `logprob_token_ids`", "logprob_token_ids")
        raise BadRequest("logprob_token_ids is not supported by this server", "logprob_token_ids")

    def usage_flags(self, force_include_usage: bool = False) -> tuple[bool, bool]:
        """(a usage chunk at the end of a stream, usage on every chunk): vLLM's stream options, or both
        when the server forces usage (--enable-force-include-usage)."""
        if force_include_usage:
            return True, True
        options = self.stream_options
        include = bool(options and options.include_usage)
        return include, include and bool(options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, Any]) -> SamplingParams:
        """`defaults` (the checkpoint's generation config), then vLLM's, where a field is null; a broken rule
        is a 400 naming its field."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        values = dict(n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                      stop=tuple(stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
                      ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens, min_tokens=self.min_tokens,
                      logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
                      bad_words=self.bad_words, structured_outputs=self.structured(),
                      truncate_prompt_tokens=self.truncate_prompt_tokens)
        values = {k: defaults[k] if v is None and k in defaults and k != "max_tokens" else v for k, v in values.items()}
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None or k in _NULLABLE})
        except ValueError as error:
            raise as_bad_request(error) from error

    def structured(self) -> StructuredOutputsParams | None:
        """vLLM's `structured_outputs`, with OpenAI's `response_format` setting its constraint (json_object, or
        json_schema's schema; `strict` closes the schema's objects, as OpenAI's strict mode requires)."""
        fields, field = dict(self.structured_outputs or {}), "structured_outputs"
        form = self.response_format
        if form is not None and form.get("type") != "text":
            fields, field = {**fields, **_response_format_constraint(form)}, "response_format"
        if not fields:
            return None
        try:
            return StructuredOutputsParams.from_dict(fields)
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error), field) from error

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids."""
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError as error:
            raise BadRequest(f"logit_bias keys must be token ids, got {list(self.logit_bias)}", "logit_bias") from error


def _response_format_constraint(form: dict[str, Any]) -> dict[str, Any]:
    kind = form.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = form.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise BadRequest("When response_format type is 'json_schema', the 'json_schema' field must be provided "
                             "with a 'schema'", "response_format")
        return {"json": schema, **({"disable_additional_properties": True} if spec.get("strict") else {})}
    if kind == "structural_tag":
        raise BadRequest("response_format structural_tag is not supported by this server", "response_format")
    raise BadRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")


_NULLABLE = {"max_tokens", "logprobs", "prompt_logprobs", "seed", "logit_bias", "allowed_token_ids", "bad_words",
             "truncate_prompt_tokens", "structured_outputs"}


def _tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """Tools as a chat template reads them: OpenAI's dicts."""
    return None if tools is None else [tool.model_dump() for tool in tools]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]  # ids before strings: a long id list validates in one pass
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's own special tokens (a BOS, say) around the prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, prompt: Any) -> Any:
        """A list of more than MAX_PROMPTS entries must be one prompt's token ids: checked before the union's
        validation, which would report each of a million nested lists on its own."""
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not all(type(t) is int for t in prompt):
            raise ValueError(f"a list of more than {MAX_PROMPTS} prompts; a longer list must be token ids")
        return prompt

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise BadRequest("suffix is not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of is not supported by this server (use n)", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt must not be empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        # echo with logprobs reports the prompt's logprobs too (vLLM)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else self.prompt_logprobs
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the reply starts with the last message's content when its role is the reply's
    prompt_token_ids: list[int] | None = None  # a rendered prompt, instead of messages (vLLM's token in)
    add_special_tokens: bool = False  # the chat template already wrote them
    tools: list[ChatTool] | None = None
    tool_choice: Any = "none"  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # false: no `reasoning` in the reply (vLLM)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    _unsupported: ClassVar[dict[str, Callable[[Any], bool]]] = {**_UNSUPPORTED, **_CHAT_UNSUPPORTED}
    _TEMPLATE_OPTIONS: ClassVar[tuple[str, ...]] = ("add_generation_prompt", "continue_final_message",
                                                    "chat_template_kwargs")

    def check(self) -> None:
        super().check()
        if self.prompt_token_ids is not None:
            self._check_token_in()
        elif not self.messages:
            raise BadRequest("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        self._check_tools()

    @property
    def resolved_tool_choice(self) -> Any:
        """vLLM's: "auto" when tools come without a tool_choice."""
        if "tool_choice" not in self.model_fields_set and self.tools:
            return "auto"
        return self.tool_choice

    def tool_mode(self, auto_tools: bool) -> str:
        """"none", "auto", "required" or "named". An explicit null tool_choice is "auto" where the server parses
        tool calls (`auto_tools`), else "none"."""
        choice = self.resolved_tool_choice
        if isinstance(choice, dict):
            return "named"
        if choice is None:
            return "auto" if self.tools and auto_tools else "none"
        return choice

    def _check_tools(self) -> None:
        """vLLM's rules for tools and tool_choice, with its messages."""
        if self.tools == []:
            raise BadRequest("`tools` must not be an empty array. Either provide at least one tool or omit the "
                             "field entirely.", "tools")
        choice = self.resolved_tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, dict):
            self._check_named_tool(choice)
        elif choice not in ("auto", "required"):
            raise BadRequest(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                             '"required" are supported.', "tool_choice")

    def _check_named_tool(self, choice: dict) -> None:
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                             "tool_choice.function")
        if "name" not in function:
            raise BadRequest(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                             "tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise BadRequest(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                             "tool_choice.function.name")
        if all(tool.function.name != name for tool in self.tools):
            raise BadRequest("The tool specified in `tool_choice` does not match any of the specified `tools`",
                             "tool_choice")
        constraints = self.structured_outputs or {}
        if any(constraints.get(kind) is not None for kind in ("json", "regex", "choice")):
            raise BadRequest("You can only either use constraints for structured outputs or tools, not both.",
                             "structured_outputs")

    def structured(self) -> StructuredOutputsParams | None:
        """A forced tool choice's schema (it replaces any other constraint, as in vLLM), else the request's."""
        schema = forced_schema(self.tools, self.resolved_tool_choice, self.parallel_tool_calls)
        return super().structured() if schema is None else StructuredOutputsParams(json=schema)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables (and the reasoning parser's view of them): chat_template_kwargs,
        with vLLM's `reasoning_effort`, which also sets `enable_thinking` (false for "none") unless they do."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def template_tools(self, exclude_when_none: bool = False) -> list[dict] | None:
        """The tools as the template reads them; none with tool_choice "none" under vLLM's
        --exclude-tools-when-tool-choice-none."""
        return None if exclude_when_none and self.resolved_tool_choice == "none" else _tool_dicts(self.tools)

    def _check_token_in(self) -> None:
        """Pre-tokenized input is already rendered: messages and chat-template options would be ignored."""
        if not self.prompt_token_ids:
            raise BadRequest("prompt_token_ids must not be empty", "prompt_token_ids")
        if self.messages:
            raise BadRequest("send either messages or prompt_token_ids, not both", "messages")
        for name in self._TEMPLATE_OPTIONS:
            if name in self.model_fields_set:
                raise BadRequest(f"{name} applies to messages; prompt_token_ids are already rendered", name)

    def echoed_content(self) -> str:
        """vLLM's chat echo: the last message's text when its role is the reply's (the assistant's after a
        generation prompt, else the last message's own), "" otherwise or without echo."""
        if not self.echo or not self.messages:
            return ""
        last = render.text_content(self.messages[-1:], "messages")[0]
        role = "assistant" if self.add_generation_prompt else last.get("role")
        return (last.get("content") or "") if last.get("role") == role else ""

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        # unset: whatever fits in max_model_len (the engine resolves None)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch body: the chat fields, with `messages` a list of conversations, each
    answered by one choice whose index is its position. No streaming, n = 1, no prompt_logprobs, and no
    prompt_token_ids (one rendered prompt cannot stand for several conversations)."""

    messages: list[Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]] = Field(max_length=MAX_PROMPTS)

    def check(self) -> None:
        """The batch's own rules, then each conversation's as /v1/chat/completions checks its body."""
        if not self.messages or not all(self.messages):
            raise BadRequest("messages must be a non-empty list of non-empty conversations", "messages")
        if self.stream:
            raise BadRequest("Batch chat completions do not support streaming", "stream")
        if self.n != 1:
            raise BadRequest("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
        if self.prompt_token_ids is not None:
            raise BadRequest("Batch chat completions take messages: one prompt_token_ids cannot serve several "
                             "conversations", "prompt_token_ids")
        if self.prompt_logprobs is not None:  # vLLM's batched reply has no place for them
            raise BadRequest("Batch chat completions do not return prompt_logprobs", "prompt_logprobs")
        if self.tool_choice not in (None, "none"):  # vLLM's batch takes tool_choice "none" only
            raise BadRequest('Batch chat completions do not call tools: tool_choice must be "none"', "tool_choice")
        for conversation in self.conversations():
            conversation.check()

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, with the batch's other fields (those it was sent); tool_choice is
        "none" (tools still reach the template, as in vLLM)."""
        fields = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return [ChatCompletionRequest.model_validate({"tool_choice": "none", **fields, "messages": messages})
                for messages in self.messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None  # vLLM's: messages are rendered with them, as chat renders them

    def template_tools(self) -> list[dict] | None:
        return _tool_dicts(self.tools)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


