"""The official OpenAI client's structured-output and tool-calling calls, unmodified, against a
Tandem coordinator (the real Qwen pair); prints what it got as JSON.

usage: openai_tools.py BASE_URL MODEL
"""

import json
import sys
from typing import Literal

from openai import OpenAI, pydantic_function_tool
from pydantic import BaseModel

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="unused")


class Capital(BaseModel):
    country: str
    capital: str
    population_millions: int


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


weather_tool = pydantic_function_tool(GetWeather, name="get_weather")
ask_weather = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
out = {}

# Structured output: the client's own parse helper, a pydantic model as the response format.
parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "The capital of France, as JSON."}],
    response_format=Capital,
    temperature=0,
    max_tokens=60,
)
out["parsed"] = parsed.choices[0].message.parsed.model_dump()

# JSON mode.
json_mode = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "List three colours as a JSON object."}],
    response_format={"type": "json_object"},
    temperature=0,
    max_tokens=60,
)
out["json_object"] = json.loads(json_mode.choices[0].message.content)

# Tool calls: the model chooses (auto), and parsed into the pydantic model by the client.
auto = client.chat.completions.parse(
    model=model, messages=ask_weather, tools=[weather_tool], temperature=0, max_tokens=60
)
message = auto.choices[0].message
out["auto_finish"] = auto.choices[0].finish_reason
out["auto_content"] = message.content
out["auto_calls"] = [
    {"name": c.function.name, "parsed": c.function.parsed_arguments.model_dump()}
    for c in message.tool_calls or []
]

# Required, streamed: the client's stream helper puts the call back together.
with client.chat.completions.stream(
    model=model,
    messages=[{"role": "user", "content": "Is it raining in Oslo?"}],
    tools=[weather_tool],
    tool_choice="required",
    temperature=0,
    max_tokens=60,
) as stream:
    final = stream.get_final_completion()
out["stream_finish"] = final.choices[0].finish_reason
out["stream_calls"] = [
    {"name": c.function.name, "parsed": c.function.parsed_arguments.model_dump()}
    for c in final.choices[0].message.tool_calls or []
]

# The call answered, the conversation goes on: the model answers in text (`none`: no more calls).
if message.tool_calls:
    call = message.tool_calls[0]
    follow = client.chat.completions.create(
        model=model,
        messages=ask_weather
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
        ],
        tools=[weather_tool],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    out["follow_up"] = follow.choices[0].message.content
    out["follow_up_calls"] = len(follow.choices[0].message.tool_calls or [])

print(json.dumps(out))
