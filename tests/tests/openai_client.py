"""Runs the official OpenAI client against a Tandem coordinator and prints what it got as JSON.

usage: openai_client.py BASE_URL MODEL PROMPT MAX_TOKENS
"""

import json
import sys

from openai import OpenAI

base_url, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = OpenAI(base_url=base_url, api_key="unused")

completion = client.completions.create(
    model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, seed=1
)
messages = [{"role": "user", "content": prompt}]
chat = client.chat.completions.create(
    model=model, messages=messages, max_tokens=max_tokens, temperature=0
)
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=max_tokens,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
chunks, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for choice in chunk.choices:
        if choice.delta.content:
            chunks.append(choice.delta.content)
        finish = choice.finish_reason or finish

# Log-probabilities, token prompts and content parts, as the client sends them.
with_logprobs = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}],
    max_tokens=max_tokens,
    temperature=0,
    logprobs=True,
    top_logprobs=2,
)
token_prompt = client.completions.create(
    model=model, prompt=[1, 403, 407], max_tokens=4, temperature=0, logprobs=1
)

try:
    client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
    unknown_model = None
except Exception as e:  # the client raises NotFoundError
    unknown_model = {"type": type(e).__name__, "status": getattr(e, "status_code", None)}

print(
    json.dumps(
        {
            "completion": completion.choices[0].text,
            "completion_usage": completion.usage.model_dump(),
            "completion_tandem": completion.model_extra.get("tandem"),
            "chat": chat.choices[0].message.content,
            "chat_finish": chat.choices[0].finish_reason,
            "chat_stream": "".join(chunks),
            "chat_stream_finish": finish,
            "chat_stream_usage": usage,
            "unknown_model": unknown_model,
            "chat_parts": with_logprobs.choices[0].message.content,
            "chat_logprobs": [
                {"token": c.token, "logprob": c.logprob, "top": len(c.top_logprobs)}
                for c in with_logprobs.choices[0].logprobs.content
            ],
            "token_prompt_logprobs": token_prompt.choices[0].logprobs.token_logprobs,
        }
    )
)
