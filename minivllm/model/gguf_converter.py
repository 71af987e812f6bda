"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py), run as a subprocess.

It writes what a GGUF file must say for llama.cpp to run it (each family's metadata keys, the tokenizer as
tokens, types, merges and pre-tokenizer name, llama.cpp's tensor names, Llama's q / k rows in its rope order,
GPT-2's projections transposed, Gemma's norms plus one): `minivllm quantize --out m.gguf` starts from its float
file, and the tests and benches make their GGUF files with it. The converter is Python, shipped in the
llama-cpp-python sdist (not in its wheels nor in the `gguf` package): it is read out of the sdist of the installed
llama-cpp-python, or CONVERTER_VERSION's without one, fetched from PyPI once into ~/.cache/minivllm.

A locally trained BPE tokenizer (every test checkpoint's) has a pre-tokenizer whose hash the converter does not
know and refuses: it is told the name of the split the tokenizer really uses (transformers' Qwen2 and Llama 3
tokenizers bring their own regex; GPT-2's byte-level split otherwise), with a warning, so the file's tokenizer
splits text as the checkpoint's.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile

# The sdist whose converter runs where llama-cpp-python is not installed.
CONVERTER_VERSION = "0.3.36"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

_CONVERT = r"""
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
original = base.TextModel.get_vocab_base_pre
def vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:  # a locally trained BPE: its pre-tokenizer hash is nobody's; name its split
        split = str(tokenizer.backend_tokenizer.pre_tokenizer)
        name = "llama-bpe" if r"\p{N}{1,3}" in split else "qwen2" if r"|\p{N}|" in split else "gpt-2"
        print(f"warning: llama.cpp does not know this tokenizer's pre-tokenizer; named {name!r} by its split",
              file=sys.stderr)
        return name
base.TextModel.get_vocab_base_pre = vocab_base_pre
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_dir() -> str:
    """The directory holding convert_hf_to_gguf.py, its conversion/ package and the gguf-py it ships."""
    try:
        import llama_cpp

        version = llama_cpp.__version__
    except ImportError:
        version = CONVERTER_VERSION
    root = os.path.join(os.path.expanduser("~/.cache/minivllm"), f"llama.cpp-{version}")
    if os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
        return root
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
                               "--no-binary", ":all:", "--no-deps", "-d", tmp, "-q"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cannot fetch llama.cpp's GGUF converter (the llama-cpp-python {version} sdist) "
                               f"from the package index: {proc.stderr.strip()[-400:]}")
        (sdist,) = glob.glob(os.path.join(tmp, "*.tar.gz"))
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted) and m.isfile()]
            for m in members:
                m.name = m.name[len(prefix):]
            os.makedirs(root + ".tmp", exist_ok=True)
            tar.extractall(root + ".tmp", members=members, filter="data")
    os.replace(root + ".tmp", root)
    return root


def convert_hf(hf_dir: str, out: str, outtype: str = "f32", extra: tuple[str, ...] = ()) -> str:
    """The HF checkpoint as a GGUF file written by llama.cpp's converter (outtype: one of OUTTYPES; extra: more of
    its flags, e.g. --split-max-tensors N); its error, named, if it refuses the checkpoint."""
    if outtype not in OUTTYPES:
        raise ValueError(f"GGUF converter: outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    proc = subprocess.run([sys.executable, "-c", _CONVERT, converter_dir(), hf_dir, "--outfile", out, "--outtype",
                           outtype, *extra], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf failed for {hf_dir}: {proc.stderr.strip()[-600:]}")
    return out
