"""The README and docs/ say only what is true of the code: every `specpd` flag they name is in the parser,
every benchmark flag is in that benchmark's parser, every result file and relative link they name exists, and
the generated pages (configuration, results, benchmarks, the README's summary) are what their generators
write today."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import gen_configuration  # noqa: E402

PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
FLAG = re.compile(r"(?<![\w=-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
SCRIPT = re.compile(r"evals/(\w+)\.py|-m evals\.(\w+)")  # a benchmark by its path, or run as a module
# commands whose flags are not specpd's: other tools, and the peers' own flags (vLLM, SGLang) named beside ours
OTHER_TOOLS = ("pytest", "pip ", "git ", "curl ", "make ", "vllm", "sglang", "SGLang", "vLLM", "llama")


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _spans(text: str) -> list[str]:
    """Code as the page shows it: each line of a fenced block (a trailing backslash continues it), and each
    inline `span`."""
    spans, fenced = [], re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    for block in fenced:
        spans += block.replace("\\\n", " ").splitlines()
    spans += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return spans


def _script_flags(script: str) -> set[str]:
    """The flags an evals script's parser takes (its own add_argument calls and those of the evals modules it
    imports from)."""
    path = os.path.join(ROOT, "evals", f"{script}.py")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        src = f.read()
    found = set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", src))
    found |= {f"--no-{f[2:]}" for f in found}  # BooleanOptionalAction
    for module in re.findall(r"^from evals\.(\w+) import|^from (\w+) import", src, flags=re.M):
        name = module[0] or module[1]
        if name != script and os.path.exists(os.path.join(ROOT, "evals", f"{name}.py")):
            found |= _script_flags(name)
    return found


@pytest.fixture(scope="module")
def specpd_flags() -> set[str]:
    return gen_configuration.flags()


@pytest.mark.parametrize("page", PAGES)
def test_flags_named_exist(page, specpd_flags):
    unknown = []
    for span in _spans(_read(page)):
        flags = set(FLAG.findall(span))
        if not flags or any(tool in span for tool in OTHER_TOOLS):
            continue
        scripts = [path or module for path, module in SCRIPT.findall(span)]
        if scripts:
            allowed = set().union(*(_script_flags(s) for s in scripts))
        else:
            allowed = specpd_flags
        unknown += [f"{f} (in `{span.strip()[:80]}`)" for f in sorted(flags - allowed)]
    assert not unknown, f"{page} names flags its command does not take: {unknown}"


@pytest.mark.parametrize("page", PAGES)
def test_result_files_and_links_exist(page):
    text = _read(page)
    missing = [f"evals/results/{name}" for name in re.findall(r"evals/results/([\w.-]+\.(?:json|png|log))", text)
               if not os.path.exists(os.path.join(ROOT, "evals", "results", name))]
    base = os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target) and not os.path.exists(os.path.join(base, target)):
            missing.append(target)
    assert not missing, f"{page} names files that do not exist: {missing}"


def test_a_flag_the_parser_lacks_is_caught(specpd_flags):
    assert "--spec-num-steps" in specpd_flags and "--no-spec-ngram" in specpd_flags
    assert "--spec-num-stepz" not in specpd_flags


def test_configuration_page_is_generated_from_the_parser():
    assert subprocess.run([sys.executable, os.path.join(ROOT, "docs", "gen_configuration.py"), "--check"],
                          cwd=ROOT).returncode == 0, "run: python docs/gen_configuration.py"


def test_results_pages_are_generated_from_the_result_files():
    assert subprocess.run([sys.executable, "-m", "evals.report", "--check"], cwd=ROOT).returncode == 0, \
        "run: python -m evals.report"


def test_readme_is_a_front_door():
    assert len(_read("README.md").splitlines()) <= 200


def test_readme_results_name_a_missing_peer_and_read_the_isa_from_the_flags():
    """The README's block from a peers.json without vLLM, with llama.cpp's q4_1 cells, and no ISA field: vLLM's
    table says it was not measured (with the run's reason), llama.cpp's sits beside specpd's default dtype, and
    the box's ISA comes from its recorded CPU flags."""
    import copy
    import json
    sys.path.insert(0, ROOT)
    from evals import report_readme
    with open(os.path.join(ROOT, "evals", "results", "peers.json")) as f:
        data = json.load(f)
    d = copy.deepcopy(data)
    plain = next(v for k, v in d["cells"].items() if k.startswith("specpd/plain/"))
    d["cells"] = {k: v for k, v in d["cells"].items() if not k.startswith("vllm/")}
    d["cells"]["llamacpp/plain/q4_1"] = plain
    d["skipped"] = [{"server": "vllm/plain/bf16", "reason": "no .peers/vllm"}]
    d["specpd_default_dtype"] = "bfloat16"
    d.pop("specpd_probe", None)
    d.pop("isa", None)
    d["machine"]["cpu_flags"] = {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False}
    text = report_readme.render(d, None)
    assert "vLLM's CPU build: not measured in this file (no .peers/vllm)." in text
    assert "| llama.cpp TPOT ms c1 |" in text and "plain (specpd bf16, llama.cpp q4_1)" in text
    assert text.count("ISA avx512_bf16") == 3 and "amx" not in text
    d["isa"] = "avx2"  # a field the file names wins over its flags
    assert "ISA avx2," in report_readme.box(d)
