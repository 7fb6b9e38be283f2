"""Packs what the GPU check needs beyond the repository into parts a device call can carry.

A device call carries the repository (~42 MiB, the shipped heads most of it) and at most 64 MiB in all, and the
device has no network. What evals/gpu.py's speculation and PD cells need is larger: the default model's GGUF
(94 MB), the held-out chat and grounded prompts (token ids of the default tokenizer: the dataset package is not
there), and wheels its image lacks (gguf for the GGUF; with --wheels pyzmq and Mooncake's CUDA build, ~98 MB, for PD
with KV in GPU memory). They go into one tar, split into parts under .gpu_stage/ (git-ignored), with a manifest:

    python -m evals.gpu_stage [--wheels] [--part-mib 20]

Then, in a session lent a GPU, one device call per part, back to back while the machine stays warm (each part is
appended under /tmp/specpd-stage there), then the check, which reassembles and verifies the tar first:

    run(command="bash evals/gpu_check.sh stage 0", carry=[".gpu_stage/manifest.json", ".gpu_stage/part00"])
    ... one call per part ...
    run(command="bash evals/gpu_check.sh", carry=[".gpu_stage/manifest.json"])

Without the parts the check still runs: the speculation and PD cells then say why they were not measured.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))

from evals.harness.results import REPO_ROOT

STAGE_DIR = os.path.join(REPO_ROOT, ".gpu_stage")
WHEEL_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
BASE_WHEELS = ["gguf==0.19.0"]
PD_WHEELS = ["pyzmq==27.3.0", "mooncake-transfer-engine==0.3.13.post1"]  # the versions make install pins (CPU)
NUM_PROMPTS = 16


def prompts() -> dict[str, list[list[int]]]:
    from evals.spec_workloads import chat_prompts, grounded_prompts

    from specpd.model.loader import load_checkpoint
    tokenizer = load_checkpoint("default").tokenizer
    return {"chat": chat_prompts(tokenizer, NUM_PROMPTS), "grounded": grounded_prompts(tokenizer, NUM_PROMPTS)}


def wheels(names: list[str], into: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *WHEEL_TARGET,
                    "-d", into, *names], check=True)


def split(path: str, part_bytes: int, out_dir: str) -> list[str]:
    names = []
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            names.append(f"part{len(names):02d}")
            with open(os.path.join(out_dir, names[-1]), "wb") as out:
                out.write(chunk)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", action="store_true", help="also pyzmq and Mooncake's CUDA build (PD on the GPU)")
    ap.add_argument("--part-mib", type=int, default=20, help="each part's size: the repository plus one part must "
                                                             "stay under a call's 64 MiB")
    ap.add_argument("--no-model", action="store_true", help="leave the GGUF out (a dry run of the packing)")
    args = ap.parse_args()
    from specpd.model.default import GGUF_NAME, ensure_default_model
    os.makedirs(STAGE_DIR, exist_ok=True)
    for name in os.listdir(STAGE_DIR):
        os.remove(os.path.join(STAGE_DIR, name))
    with tempfile.TemporaryDirectory() as tmp:
        payload = os.path.join(tmp, "payload")
        os.makedirs(os.path.join(payload, "wheels"))
        with open(os.path.join(payload, "prompts.json"), "w", encoding="utf-8") as f:
            json.dump(prompts(), f)
        wheels(BASE_WHEELS + (PD_WHEELS if args.wheels else []), os.path.join(payload, "wheels"))
        tar_path = os.path.join(tmp, "stage.tar")
        with tarfile.open(tar_path, "w") as tar:
            for name in sorted(os.listdir(payload)):
                tar.add(os.path.join(payload, name), arcname=name)
            if not args.no_model:
                tar.add(ensure_default_model(), arcname=GGUF_NAME)
            members = tar.getnames()
        with open(tar_path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        parts = split(tar_path, args.part_mib << 20, STAGE_DIR)
    manifest = {"parts": parts, "sha256": digest, "files": members, "model": None if args.no_model else GGUF_NAME}
    with open(os.path.join(STAGE_DIR, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps(manifest, indent=1))
    print(f"{len(parts)} parts under {STAGE_DIR}: one device call each (`bash evals/gpu_check.sh stage N`), then "
          f"`bash evals/gpu_check.sh`")


if __name__ == "__main__":
    main()
