"""Copy a trained draft (config.json + model.safetensors) with its float weights cast, e.g. to ship it.

  python -m specpd.spec.draft.export runs/eagle3-smollm2-700k specpd/spec/draft/heads/smollm2-135m-instruct-eagle3 \
      --dtype bfloat16

Integer tensors (d2t) and masks (t2d) keep their dtype; the engine casts the weights to its own dtype at
load time. A provenance file (the run's args.json and last training log line) is copied alongside.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_draft(src: str, dst: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Returns the bytes of the written model.safetensors."""
    weights = load_file(os.path.join(src, "model.safetensors"))
    cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    os.makedirs(dst, exist_ok=True)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    out = os.path.join(dst, "model.safetensors")
    save_file(cast, out, metadata={"format": "pt"})
    provenance = {}
    if os.path.isfile(os.path.join(src, "args.json")):
        with open(os.path.join(src, "args.json"), encoding="utf-8") as f:
            provenance["args"] = json.load(f)
    if os.path.isfile(os.path.join(src, "train_log.jsonl")):
        with open(os.path.join(src, "train_log.jsonl"), encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        provenance["first_log"], provenance["last_log"] = (lines[0], lines[-1]) if lines else (None, None)
    provenance["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(dst, "provenance.json"), "w", encoding="utf-8") as f:
        json.dump(provenance, f, indent=2)
    return os.path.getsize(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    args = ap.parse_args(argv)
    size = export_draft(args.src, args.dst, _DTYPES[args.dtype])
    print(f"{args.dst}/model.safetensors: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
