"""The input processor every front end shares: prompts and conversations to prompt token ids."""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np

Prompt = Union[str, Sequence[int], dict]


def load_tokenizer(tokenizer: Optional[str], model_path: Optional[str]):
    """The tokenizer named by `tokenizer`, else the checkpoint's (None, with a warning: it has no
    tokenizer file); a missing or corrupt file raises."""
    import logging

    from checkpoints.tokenizer_format import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE
    from kimi_jax.text.tokenizer import Tokenizer, TokenizerNotFound
    path = tokenizer or model_path
    if path is None:
        return None
    if tokenizer is None and not any(os.path.isfile(os.path.join(path, f))
                                     for f in (TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE)):
        logging.getLogger(__name__).warning("%s has no %s: prompts must be token ids", path,
                                            TIKTOKEN_FILE)
        return None
    try:
        return Tokenizer.from_pretrained(path)
    except TokenizerNotFound as e:
        raise ValueError(str(e)) from None


class InputProcessor:
    """Prompt token ids from what a user sends; source: what errors name (the checkpoint)."""

    def __init__(self, tokenizer, source: Optional[str] = None):
        self.tokenizer, self.source = tokenizer, source

    def token_ids(self, prompt: Prompt, i: int = 0) -> list[int]:
        """Token ids of a prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids":
        ids}; i: the request's index in errors (the engine core checks the ids)."""
        if isinstance(prompt, dict):
            for key in ("multi_modal_data", "mm_processor_kwargs"):
                if prompt.get(key) not in (None, {}):
                    raise ValueError(
                        f"request {i}: the prompt's {key!r} is not supported (a text-only " "model)"
                    )
            keys = set(prompt) - {"multi_modal_data", "mm_processor_kwargs"}
            if keys == {"prompt_token_ids"}:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                    raise ValueError(f"request {i}: prompt_token_ids must be a list of token ids")
                return list(ids)
            if keys == {"prompt"}:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"request {i}: 'prompt' must be a string, got "
                                     f"{type(prompt['prompt']).__name__}")
                return self.token_ids(prompt["prompt"], i)
            raise ValueError(f"request {i}: a prompt dict needs exactly one of 'prompt' (text) or "
                             f"'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"request {i}: a text prompt needs a tokenizer, and the checkpoint "
                    f"{self.source or '(preset)'} has no tiktoken.model; pass token ids"
                )
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (Sequence, np.ndarray)) or isinstance(prompt, bytes):
            raise ValueError(
                f"request {i}: a prompt is a string, a list of token ids or a dict with "
                f"'prompt' / 'prompt_token_ids', got {type(prompt).__name__}"
            )
        return list(prompt)

    @staticmethod
    def prompt_text(prompt) -> Optional[str]:
        """A prompt's text (RequestOutput.prompt), None for token ids."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt")
        return prompt if isinstance(prompt, str) else None

    def _template(self, chat_template: Optional[str]):
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer; {self.source or 'this preset'} has none")
        return self.tokenizer.load_chat_template(chat_template)

    def render_chat(self, messages, *, add_generation_prompt: bool = True, tools=None,
                    chat_template: Optional[str] = None) -> str:
        """One conversation rendered with the checkpoint's own chat template (sandboxed Jinja)."""
        return self._template(chat_template).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_chat(self, messages, *, add_generation_prompt: bool = True, tools=None,
                    chat_template: Optional[str] = None) -> list[int]:
        """Prompt token ids of one conversation (kimi_jax.text.conversation: only the template's own
        markup is special tokens); a bad message raises ValueError naming its index."""
        from kimi_jax.text.conversation import encode_conversation
        return encode_conversation(self._template(chat_template), self.tokenizer, messages,
                                   add_generation_prompt=add_generation_prompt, tools=tools)
