"""Hugging Face transformers' rendering of a chat template: `apply_chat_template`'s own renderer
(`render_jinja_template`: a sandboxed jinja2 with trim_blocks, lstrip_blocks, loop controls,
its own `tojson`, `raise_exception` and `strftime_now`).

Usage: python chat_template.py TEMPLATE.jinja '[{"messages": [...], "variables": {...}}, ...]'
Prints JSON: {"renderings": [{"text": the rendered prompt, with the generation prompt} or
{"error": message} where the template refuses or fails on the messages, one per request],
"transformers": version}.
"""

import json
import pathlib
import sys

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template


def main() -> None:
    template = pathlib.Path(sys.argv[1]).read_text()
    renderings = []
    for request in json.loads(sys.argv[2]):
        try:
            rendered, _ = render_jinja_template(
                conversations=[request["messages"]],
                chat_template=template,
                add_generation_prompt=True,
                **request["variables"],
            )
            renderings.append({"text": rendered[0]})
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
            # The template refused the messages, or failed on them (Qwen3's reads a tool-calling
            # turn's null content as text).
            renderings.append({"error": f"{type(e).__name__}: {e}"})
    answer = {"renderings": renderings, "transformers": transformers.__version__}
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
