"""DESIGN.md §2's layout as a test: imports flow entrypoints → engine → model only, nothing but the CLI's
dispatch imports the bench package (and the bench package never imports the CLI), and no module grows past
one job's size."""

from __future__ import annotations

import ast
import pathlib
import re

import minivllm

ROOT = pathlib.Path(minivllm.__file__).parent
MAX_LINES = 400  # DESIGN.md: a file past ~400 lines has taken a second job; split it along its seam
GENERATED = ("entrypoints/proto/",)


def _modules() -> dict[str, pathlib.Path]:
    return {p.relative_to(ROOT).as_posix(): p for p in ROOT.rglob("*.py")
            if not p.relative_to(ROOT).as_posix().startswith(GENERATED)}


def _imports(path: pathlib.Path) -> set[str]:
    """Every minivllm module this file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "minivllm" or m.startswith("minivllm.")}


_ABOVE_ENGINE = ("minivllm.entrypoints", "minivllm.distributed.ray", "minivllm.bench", "minivllm.cli", "minivllm.llm")
_ENGINE = ("minivllm.engine", "minivllm.spec_decode", "minivllm.structured_output")

# A file under the key (its most specific one) may not import modules under any of the values. The engine's
# features (speculation, structured outputs) sit at the engine's level; tensor-parallel groups and their collectives
# (distributed/) at the model's; Ray replicas and their front (distributed/ray/) at the entry points'.
FORBIDDEN = {
    "utils.py": ("minivllm.",),
    "model/": _ENGINE + _ABOVE_ENGINE,
    "distributed/": _ENGINE + _ABOVE_ENGINE,
    "engine/": _ABOVE_ENGINE,
    "spec_decode/": _ABOVE_ENGINE,
    "structured_output/": _ABOVE_ENGINE,
    "distributed/ray/": ("minivllm.bench", "minivllm.cli"),
    "entrypoints/": ("minivllm.bench", "minivllm.cli"),
    "bench/": ("minivllm.cli",),
}


def _rules(rel: str) -> tuple[str, ...]:
    """The forbidden imports of the most specific key the file is under (none for the package's top level)."""
    keys = [k for k in FORBIDDEN if rel.startswith(k)]
    return FORBIDDEN[max(keys, key=len)] if keys else ()


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module is one of the packages or modules named (whole dotted names: minivllm.engine_config is not
    under minivllm.engine), or starts with a prefix that ends in a dot."""
    return any(module.startswith(p) if p.endswith(".") else module == p or module.startswith(p + ".")
               for p in prefixes)


def test_imports_flow_downwards_only():
    bad = []
    for rel, path in _modules().items():
        imports = _imports(path)
        forbidden = _rules(rel)
        if forbidden:
            bad += [f"{rel} imports {m}" for m in imports if _under(m, forbidden)]
        if not rel.startswith("bench/") and rel != "cli.py":
            bad += [f"{rel} imports {m}" for m in imports if m.startswith("minivllm.bench")]
    assert not bad, bad


def test_the_checks_see_real_imports():
    """The walker finds what it must (so the test above cannot pass by finding nothing)."""
    mods = _modules()
    assert "minivllm.model.runner" in _imports(mods["engine/llm_engine.py"])
    assert "minivllm.bench.verbs" in _imports(mods["cli.py"])  # the one way in, inside build_parser
    assert len(mods) > 50
    assert _rules("distributed/ray/client.py") == FORBIDDEN["distributed/ray/"]
    assert _rules("distributed/tp_group.py") == FORBIDDEN["distributed/"]
    assert _under("minivllm.engine.scheduler", _ENGINE) and not _under("minivllm.engine_config", _ENGINE)


def test_the_features_and_distributed_pieces_have_their_packages():
    """Speculative decoding, structured outputs and the distributed pieces each live in one package (issue 32)."""
    mods = _modules()
    for rel in ("spec_decode/speculator.py", "spec_decode/draft_proposer.py", "spec_decode/ngram_proposer.py",
                "model/rejection_sampler.py", "structured_output/manager.py", "distributed/tp_group.py",
                "distributed/shm_comm.py", "distributed/ray/client.py", "distributed/ray/replica.py", "utils.py"):
        assert rel in mods, rel
    assert not [rel for rel in mods if rel.startswith(("engine/spec", "model/tp_", "entrypoints/ray_"))]


def test_no_module_past_the_size_of_one_job():
    sizes = {rel: len(p.read_text().splitlines()) for rel, p in _modules().items()}
    assert not {rel: n for rel, n in sizes.items() if n > MAX_LINES}


FEATURE_WORDS = re.compile(r"spec|draft|propos|guided|grammar|mask|structured|beam|swap|fault|lora|prompt_logprob|"
                           r"evict|sink", re.IGNORECASE)


def test_no_feature_is_named_inside_the_step():
    """LLMEngine.step is schedule → forward → process → outputs; optional features take part through the hook
    points (engine/hooks.py), so the step's own code (comments included) names none of them."""
    src = (ROOT / "engine/llm_engine.py").read_text()
    (step,) = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "step"]
    text = ast.get_source_segment(src, step)
    assert text is not None and "hooks.before_schedule" in text
    assert not FEATURE_WORDS.findall(text), FEATURE_WORDS.findall(text)
