"""SFT examples -> (tokens, loss mask): loss on the response only.

Why: Megatron users fine-tune on prompt/response or chat JSONL. The mask is decided at
preprocessing time and stored next to the tokens, so training needs no tokenizer.

Formats (one JSON object a line):
- `{"prompt": "...", "response": "..."}` (key names configurable): tokens are
  tokenize(prompt) + tokenize(response) + [eod]; mask 0 on the prompt, 1 on the response
  and its EOD (the model learns to stop).
- `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`:
  each message is rendered as `<|role|>\\n` + content + `\\n` (a plain template, so any
  tokenizer works); mask 1 on assistant contents and their closing newline, then EOD
  (mask 1) if the last message is the assistant's. Segments are tokenized separately so
  mask boundaries are exact.

The stored mask marks *tokens*; `thd.build_micro_batch` applies it on the label side
(position j counts when token j+1 is a response token).
"""
from __future__ import annotations


class SFTFormatError(ValueError):
    pass


def encode_example(obj: dict, tokenizer, prompt_key: str = "prompt", response_key: str = "response",
                   messages_key: str = "messages") -> tuple[list[int], list[int]]:
    if not isinstance(obj, dict):
        raise SFTFormatError("expected a JSON object")
    if messages_key in obj:
        return _encode_messages(obj[messages_key], tokenizer)
    if prompt_key in obj and response_key in obj:
        prompt, response = obj[prompt_key], obj[response_key]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise SFTFormatError(f"'{prompt_key}' and '{response_key}' must be strings")
        p = tokenizer.tokenize(prompt)
        r = tokenizer.tokenize(response) + [tokenizer.eod]
        return p + r, [0] * len(p) + [1] * len(r)
    raise SFTFormatError(f"no '{messages_key}' and no '{prompt_key}'/'{response_key}' keys")


def _encode_messages(messages, tokenizer) -> tuple[list[int], list[int]]:
    if not isinstance(messages, list) or not messages:
        raise SFTFormatError("'messages' must be a non-empty list")
    tokens: list[int] = []
    mask: list[int] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SFTFormatError("each message needs string 'role' and 'content'")
        head = tokenizer.tokenize(f"<|{m['role']}|>\n")
        body = tokenizer.tokenize(m["content"] + "\n")
        train = 1 if m["role"] == "assistant" else 0
        tokens += head + body
        mask += [0] * len(head) + [train] * len(body)
    if messages[-1]["role"] == "assistant":
        tokens.append(tokenizer.eod)
        mask.append(1)
    if not any(mask):
        raise SFTFormatError("no assistant message: nothing to train on")
    return tokens, mask
