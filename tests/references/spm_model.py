"""A SentencePiece model (`tokenizer.model`) with the pieces and types of a Hugging Face
`tokenizer.json` of a SentencePiece BPE vocabulary: the file llama.cpp's converter reads such a
vocabulary from (Gemma 3's converter requires it). Scores are the pieces' order, as
SentencePiece's BPE trainer writes them (a piece's score is minus its rank); control, unknown
and byte pieces score 0.

Usage: python spm_model.py TOKENIZER_JSON OUT '{"add_dummy_prefix": bool}'
"""

import json
import sys

# SentencePiece's model schema as transformers ships it (sentencepiece's own wants protobuf 5,
# the converter's requirements pin 4).
from transformers.utils import sentencepiece_model_pb2_new as spm


def main() -> None:
    source, out, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with open(source, encoding="utf-8") as f:
        tokenizer = json.load(f)
    model = tokenizer["model"]
    pieces = {i: p for p, i in model["vocab"].items()}
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    proto = spm.ModelProto()
    for i in range(max(pieces) + 1):
        piece = proto.pieces.add()
        piece.piece = pieces[i]
        piece.score = 0.0
        if pieces[i] == model.get("unk_token"):
            piece.type = spm.ModelProto.SentencePiece.UNKNOWN
        elif i in added and added[i].get("special"):
            piece.type = spm.ModelProto.SentencePiece.CONTROL
        elif i in added:
            piece.type = spm.ModelProto.SentencePiece.USER_DEFINED
        elif len(pieces[i]) == 6 and pieces[i].startswith("<0x") and pieces[i].endswith(">"):
            piece.type = spm.ModelProto.SentencePiece.BYTE
        else:
            piece.type = spm.ModelProto.SentencePiece.NORMAL
            piece.score = -float(i)
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(proto.pieces)
    proto.trainer_spec.byte_fallback = bool(model.get("byte_fallback"))
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(options["add_dummy_prefix"])
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    with open(out, "wb") as f:
        f.write(proto.SerializeToString())


if __name__ == "__main__":
    main()
