"""Hugging Face's token ids for texts, from a tokenizer.json (the `tokenizers` library), with no
special tokens added (special tokens written in the text are still matched).

Usage: python hf_tokenize.py tokenizer.json '["text", ...]'
Prints JSON: [[ids of each text]].
"""

import json
import sys

import tokenizers


def main() -> None:
    tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1])
    texts = json.loads(sys.argv[2])
    json.dump([tokenizer.encode(t, add_special_tokens=False).ids for t in texts], sys.stdout)


if __name__ == "__main__":
    main()
