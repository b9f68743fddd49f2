"""llama.cpp's answer for a GGUF file, through llama-cpp-python (which vendors llama.cpp).

Usage: python llama_cpp_logits.py MODEL.gguf '{"tokens": [...], "greedy": N, "n_ctx": C,
"positions": [...]}'
Prints JSON: {"logits": [[...] per position asked], "greedy": [N ids after the tokens],
"llama_cpp": version}. The logits (to 9 significant digits: every float32 exactly) are computed
for every position as one batch; the greedy ids come from decoding one token at a time after it.
"""

import json
import os
import sys

import llama_cpp
import numpy as np


def main() -> None:
    path, request = sys.argv[1], json.loads(sys.argv[2])
    tokens = request["tokens"]
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=request["n_ctx"],
        n_batch=request["n_ctx"],
        logits_all=True,
        n_threads=2,
        # f32 keys and values, no flash attention: llama.cpp's defaults keep the cache in f16.
        type_k=0,
        type_v=0,
        flash_attn=False,
        verbose=bool(os.environ.get("TANDEM_LLAMA_CPP_VERBOSE")),
    )
    llm.eval(tokens)
    rows = np.asarray(llm.scores[: len(tokens)], dtype=np.float32)[request["positions"]]
    logits = [[float(f"{x:.9g}") for x in row] for row in rows.tolist()]
    greedy = []
    for _ in range(request["greedy"]):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    json.dump(
        {
            "logits": logits,
            "greedy": greedy,
            "llama_cpp": llama_cpp.__version__,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
