"""Chat messages -> prompt token ids through the model's chat template (chat route,
/tokenize, `graphserve generate --chat`)."""

from __future__ import annotations

from typing import Any

from server.protocol import ChatMessage


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Apply the model's chat template and tokenize; the template already holds any BOS.
    A template that rejects the messages raises the engine's InvalidRequestError (a 400)."""
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        | ({"name": m.name} if m.name else {})
        for m in messages
    ]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)
