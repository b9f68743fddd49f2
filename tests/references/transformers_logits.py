"""Hugging Face transformers' answer for a model (a Hugging Face folder, or a GGUF file, which
transformers dequantizes to float32 as it loads it).

Usage: python transformers_logits.py MODEL '{"tokens": [...], "greedy": N, "positions": [...]}'
Prints JSON: {"logits": [[...] per position asked], "greedy": [N ids after the tokens],
"transformers": version, "torch": version}. The logits are those of the tokens' forward as one
batch, float32 on the CPU, eager attention; the greedy ids come from decoding one token at a
time after it, with the model's own cache.
"""

import json
import pathlib
import sys

import torch
import transformers


def main() -> None:
    path, request = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(2)
    options = {"dtype": torch.float32, "attn_implementation": "eager"}
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, **options
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **options)
    model.eval()
    tokens = torch.tensor([request["tokens"]])
    with torch.no_grad():
        out = model(tokens, use_cache=True)
        logits = out.logits[0]
        cache, row, greedy = out.past_key_values, logits[-1], []
        for _ in range(request["greedy"]):
            nxt = int(torch.argmax(row))
            greedy.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, row = out.past_key_values, out.logits[0, -1]
    json.dump(
        {
            "logits": [
                [float(f"{x:.7g}") for x in logits[p].tolist()] for p in request["positions"]
            ],
            "greedy": greedy,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
