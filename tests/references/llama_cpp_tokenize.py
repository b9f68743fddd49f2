"""llama.cpp's token ids for texts, from a GGUF file's vocabulary (llama-cpp-python, which
vendors llama.cpp), special tokens in the text parsed as such and no BOS added.

Usage: python llama_cpp_tokenize.py VOCAB.gguf '["text", ...]'
Prints JSON: [[ids of each text]].
"""

import json
import sys

import llama_cpp


def main() -> None:
    path, texts = sys.argv[1], json.loads(sys.argv[2])
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    ids = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    json.dump(ids, sys.stdout)


if __name__ == "__main__":
    main()
