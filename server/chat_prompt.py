"""Chat messages -> prompt token ids through the model's chat template (chat route,
/tokenize, `graphserve generate --chat`).

Message contents are text: special-token text in them (`<|im_start|>` ...) is tokenized
as ordinary text, so a user cannot forge system or assistant turns; only the template's
own markup becomes control tokens. `parse_special_in_content=True` restores the old
behaviour (the rendered prompt tokenized as a whole, special-token text parsed anywhere).
Raw `prompt` strings on /v1/completions are not chat: they keep parsing special tokens,
as vLLM does."""

from __future__ import annotations

from typing import Any

from graphserve.server.protocol import ChatCompletionRequest, ChatMessage
from graphserve.server.tools import CallFormat, conversation


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage] | list[dict[str, Any]], add_generation_prompt: bool,
                       parse_special_in_content: bool = False, tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Apply the model's chat template and tokenize; the template already holds any BOS.
    `messages`: request messages, or a conversation already in the template's form (with
    tool calls: server/tools.py). A template that rejects the messages raises the engine's
    InvalidRequestError (a 400). `template_kwargs`: a request's chat_template_kwargs."""
    conversation = [
        m if isinstance(m, dict) else
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
        for m in messages
    ]
    if not parse_special_in_content and hasattr(tokenizer, "encode_chat"):
        return tokenizer.encode_chat(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **({"template_kwargs": template_kwargs} if template_kwargs else {}))
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **({"template_kwargs": template_kwargs} if template_kwargs else {}))
    return tokenizer.encode(text, add_special_tokens=False)


def chat_request_prompt(tokenizer: Any, body: ChatCompletionRequest, fmt: CallFormat, use_tools: bool,
                        parse_special_in_content: bool = False) -> list[int]:
    """A chat request's prompt token ids: its conversation (tool calls and results in the template's
    form, server/tools.py) through the chat template. The chat routes (server/chat_generation.py) and
    the Ray ingress's prefix keys (server/ray_app/routing_keys.py) both take it from here."""
    messages, template_tools = conversation(body, fmt, use_tools)
    return render_chat_prompt(tokenizer, messages, body.add_generation_prompt, parse_special_in_content,
                              template_tools, body.chat_template_kwargs)
