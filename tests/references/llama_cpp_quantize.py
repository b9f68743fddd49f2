"""Quantizes a GGUF file with llama.cpp's quantizer (`llama_model_quantize`, as `llama-quantize`
runs it), through llama-cpp-python, which vendors llama.cpp.

Usage: python llama_cpp_quantize.py IN.gguf OUT.gguf FTYPE   (FTYPE: q8_0, q4_k_m, ...)
"""

import ctypes
import sys

import llama_cpp


def main() -> None:
    source, out, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype.upper())
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    sys.exit(status)


if __name__ == "__main__":
    main()
