"""The check catalog (slurm_gpu/checkcatalog.py): every check name any code path can emit is declared
there once, and every table that names checks (severity, hardware, remedies, metric labels, docs) is
derived from it.  Before it, `sram_threshold` had a remedy but no check, and `nvml`, `config` and
`driver_library_mismatch` were emitted outside CHECK_NAMES (their metric label was `other`)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Set

from slurm_gpu import checkcatalog as C
from slurm_gpu import config
from slurm_gpu.hooks import main as hook_main
from slurm_gpu.metrics.node import check_label
from slurm_gpu.policy import breaker, judge
from slurm_gpu.remediation import remedy, verifyjob
from slurm_gpu.store import apply

PACKAGE = Path(C.__file__).parent
DOCS = PACKAGE.parent / "docs"


def _literal_first_arg(call: ast.Call) -> str:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return ""


def emitted_by_the_judge() -> Set[str]:
    """Check names the judge's callers give it: j.add / j.reading / j.enabled with a literal name."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("add", "reading", "enabled")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("j", "judge")):
                name = _literal_first_arg(node)
                assert name, f"{path}:{node.lineno}: a check name that is not a literal cannot be checked here"
                names.add(name)
    return names


def results_built_by_hand() -> Set[str]:
    """CheckResult("name", ...) outside the judge (the hooks' own verdicts)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "CheckResult":
                name = _literal_first_arg(node)
                if name:
                    names.add(name)
    return names


def test_every_check_the_judge_can_emit_is_in_the_catalog_and_every_judged_check_is_emitted():
    emitted = emitted_by_the_judge()
    assert emitted == set(C.JUDGED), (sorted(emitted - set(C.JUDGED)), sorted(set(C.JUDGED) - emitted))


def test_every_check_named_outside_the_judge_is_in_the_catalog():
    outside = results_built_by_hand() | {hook_main.NVML_CHECK, apply.MISMATCH_CHECK} | set(verifyjob.CHECKS.values())
    assert outside <= set(C.BY_NAME), sorted(outside - set(C.BY_NAME))
    # and the catalog names nothing no code path emits (the former sram_threshold)
    assert set(C.BY_NAME) == set(C.JUDGED) | outside, sorted(set(C.BY_NAME) - set(C.JUDGED) - outside)


def test_the_tables_that_name_checks_are_the_catalogs():
    assert config.CHECK_NAMES == C.JUDGED
    assert judge.DEFAULT_SEVERITY == {c.name: c.severity for c in C.CHECKS if c.severity != "fail"}
    assert breaker.HARDWARE == {c.name for c in C.CHECKS if c.hardware}
    assert remedy.CHECK_REMEDY == {c.name: (c.remedy, c.remedy_source) for c in C.CHECKS if c.remedy}
    assert "sram_threshold" not in remedy.CHECK_REMEDY
    assert all(c.severity in ("fail", "warn") for c in C.CHECKS)
    assert all(c.remedy in ("", remedy.RESET, remedy.REBOOT, remedy.RMA) for c in C.CHECKS)
    assert len(C.BY_NAME) == len(C.CHECKS), "a check declared twice"


def test_checks_named_outside_the_judge_have_their_own_metric_label_and_no_severity_key():
    for name in ("nvml", "config", "driver_library_mismatch", "verify_dcgm"):
        assert check_label(name) == name
        assert name not in config.CHECK_NAMES
    assert check_label("made_up") == "other" and check_label(None) == "other"


def test_docs_show_the_catalog():
    assert C.markdown_table() in (DOCS / "hooks.md").read_text(), "regenerate the table: checkcatalog.markdown_table()"
