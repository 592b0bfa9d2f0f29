#!/usr/bin/env bash
# Installs Hugging Face transformers (pinned, with its safetensors and
# tokenizers wheels; not in Debian) into its own virtual environment,
# /opt/tessera-tools/hf (TESSERA_TOOLS_DIR/hf to change), over Debian's
# python3-torch 1.13 (--system-site-packages; scripts/install-deps.sh installs
# it). The Hugging Face tests (tests/io/test_hf_llama.cpp) run
# tests/support/hf_llama.py in it: a tiny LlamaForCausalLM made and saved by
# transformers itself, and directories `tessera export --format hf-llama`
# writes loaded by LlamaForCausalLM and AutoTokenizer.from_pretrained.
# transformers 4.47.1 is the newest whose dependency table still accepts
# torch 1.x (4.48 asks for torch>=2.0). Users do not need it. Idempotent and
# quiet when the pins are in place; about 30 s and 60 MB the first time. Run
# by scripts/install-deps.sh.
set -euo pipefail
here=$(dirname "$0")
"$here/install-pypi-venv.sh" --system-site-packages hf bin/python \
  transformers==4.47.1 tokenizers==0.21.0 safetensors==0.4.5 huggingface-hub==0.27.0
"${TESSERA_TOOLS_DIR:-/opt/tessera-tools}/hf/bin/python" -c 'import torch, transformers' 2>/dev/null || {
  echo "install-hf: transformers or torch does not import in the venv; is Debian's python3-torch installed?" >&2
  exit 1
}
