"""Write a model tokenmill can load (e.g. the embedded GGUF) as a Hugging Face directory.

Peer engines (vLLM, `transformers serve`) want HF directories; transformers refuses
`save_pretrained` on a GGUF-loaded model, so the dequantized weights are written directly.

    python -m benchmarks.export_hf OUTPUT_DIR [--model PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.model.loader import load_model_source


def export_hf(output: Path, model: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    source = load_model_source(model)
    output.mkdir(parents=True, exist_ok=True)
    config = source.hf_config
    config.architectures = [source.architecture]
    config.save_pretrained(output)
    weights = {name: tensor.contiguous() for name, tensor in source.iter_weights(dtype)}
    if "lm_head.weight" not in weights and not getattr(config, "tie_word_embeddings", False):
        raise ValueError("the checkpoint has no lm_head and does not tie embeddings")
    save_file(weights, str(output / "model.safetensors"), metadata={"format": "pt"})
    source.tokenizer.save_pretrained(output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    print(export_hf(args.output, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
