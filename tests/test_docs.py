"""The docs cite their evidence by file name: every cited result file is in benchmarks/results."""
import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "BUILD.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# names in backticks that are not results: a checkpoint's files and the build's
NOT_RESULTS = {"config.json", "generation_config.json", "tokenizer.json", "CMakeLists.txt"}
CITED = re.compile(r"`(?:benchmarks/results/)?([\w\-.{},*]+\.(?:json|jsonl|txt|png))`")


def expand(name: str) -> list[str]:
    """A cited name's files: {a,b} alternatives and {0..3} ranges spelled out, as the docs write them."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    body = m.group(1)
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    alts = [str(i) for i in range(int(r.group(1)), int(r.group(2)) + 1)] if r else body.split(",")
    return [x for alt in alts for x in expand(name[:m.start()] + alt + name[m.end():])]


def test_expand_spells_out_alternatives_and_ranges():
    assert expand("a_{1,2}_x{0..2}.json") == ["a_1_x0.json", "a_1_x1.json", "a_1_x2.json",
                                              "a_2_x0.json", "a_2_x1.json", "a_2_x2.json"]
    assert expand("plain.json") == ["plain.json"]


def test_every_cited_result_file_exists():
    missing = []
    for doc in DOCS:
        for name in set(CITED.findall((ROOT / doc).read_text())) - NOT_RESULTS:
            for f in expand(name):
                if not glob.glob(str(ROOT / "benchmarks" / "results" / f)) and not glob.glob(str(ROOT / f)):
                    missing.append(f"{doc}: {f}")
    assert not missing, "cited but not in benchmarks/results:\n" + "\n".join(sorted(missing))


def test_every_registered_op_has_its_section_in_ffi_md():
    """docs/FFI.md is where an op's operands, results and order are written down: each op the
    library registers (custom_calls/_lib.py) has a `### <op>` section there, or is the `_small`
    twin (the same operands plus a scratch result) of an op that has one, named where the doc
    describes the twins."""
    from custom_calls import _lib

    text = (ROOT / "docs" / "FFI.md").read_text()
    sections = set(re.findall(r"^### (baro_\w+)", text, re.M))
    twins = {op for op in _lib.TARGETS if op.endswith("_small") and op.removesuffix("_small") in sections
             and f"`{op}`" in text}
    assert set(_lib.TARGETS) - sections - twins == set()
