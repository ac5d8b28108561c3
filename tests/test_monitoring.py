"""monitoring/: the alert rules and Grafana dashboards, checked by promtool and against a real
Prometheus.

Debian's prometheus scrapes two node_exporters serving hand-written slurm-gpu metrics of two
nodes (tests/data/metrics/gpu01.prom: healthy, two jobs; gpu02.prom: a failed GPU, drained,
stale, records unshipped) and two more serving what dcgm-exporter would (dcgm-*.prom, scrape job
"dcgm"). Every dashboard variable and panel query must return data of the shape its panel
draws, and the alert rules, loaded into that Prometheus with every `for:` set to 0s (the
file's durations are covered by `promtool test rules`), must fire exactly where expected.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from prometheus import NODE_EXPORTER, PROMETHEUS, PROMTOOL, NodeExporter, Prometheus, PrometheusUnavailable, require
from testbed import unavailable

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "monitoring" / "alerts"
RULES = ALERTS / "slurm-gpu.rules.yml"
DASHBOARDS = sorted((ROOT / "monitoring" / "dashboards").glob("*.json"))
FIXTURES = Path(__file__).resolve().parent / "data" / "metrics"
NODES = ("gpu01", "gpu02")


def _promtool(*args: str, cwd: Path = ALERTS) -> subprocess.CompletedProcess:
    try:
        require(PROMTOOL)
    except PrometheusUnavailable as e:
        unavailable(str(e))
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check():
    r = _promtool("check", "rules", RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_unit_tests_pass():
    r = _promtool("test", "rules", "slurm-gpu.rules.test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_unit_tests_firing_and_not_firing():
    tests = (ALERTS / "slurm-gpu.rules.test.yml").read_text()
    for name in alert_names():
        cases = re.findall(rf"alertname: {name}\n\s+exp_alerts:(.*)", tests)
        assert "" in cases, f"{name}: no eval_time where it must fire"
        assert " []" in cases, f"{name}: no eval_time where it must not fire"


def test_hardware_xids_are_the_configs_critical_ones():
    """SlurmGpuXidHardware alerts on the XIDs that make a GPU FAIL by default ([xid] critical)."""
    from slurm_gpu.config import SCHEMA
    regexes = set(re.findall(r'xid=~"([0-9|]+)"', RULES.read_text()))
    assert regexes == {"|".join(map(str, SCHEMA["xid"]["critical"].default))}


def test_fixtures_follow_the_metric_catalog():
    from slurm_gpu.metrics.catalog import FAMILIES
    catalog = {f.name: (f.type, set(f.labels)) for f in FAMILIES}
    for node in NODES:
        text = (FIXTURES / f"{node}.prom").read_text()
        for name, typ in re.findall(r"^# TYPE (\w+) (\w+)$", text, re.M):
            assert catalog[name][0] == typ, name
        for name, labels in re.findall(r"^(\w+)(?:\{(.*)\})? \S+$", text, re.M):
            assert set(re.findall(r'(\w+)="', labels)) == catalog[name][1], f"{node}: {name}{{{labels}}}"


def test_fixture_check_names_are_real_checks():
    from slurm_gpu.config import CHECK_NAMES
    names = {m for f in FIXTURES.glob("gpu*.prom") for m in re.findall(r'check="(\w+)"', f.read_text())}
    assert names and names <= set(CHECK_NAMES)


def alert_names() -> List[str]:
    return re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), re.M)


# ----------------------------------------------------------------------------- dashboard schema
# The required parts of Grafana's dashboard JSON model (the "classic" model, schemaVersion 36
# and later) as its dashboard kind schema documents them (docs/sources/developers/kinds/core/
# dashboard/schema-reference.md in grafana/grafana), plus what an importable, portable
# dashboard needs: uid, title, ids and grid positions on every panel, refId and expr on every
# Prometheus query.
STR = {"type": "string"}
NONEMPTY = {"type": "string", "minLength": 1}
DATASOURCE_REF = {"type": ["object", "null"], "properties": {"type": STR, "uid": STR}}
THRESHOLDS = {"type": "object", "required": ["mode", "steps"], "properties": {
    "mode": {"enum": ["absolute", "percentage"]},
    "steps": {"type": "array", "items": {"type": "object", "required": ["color", "value"],
                                         "properties": {"color": STR, "value": {"type": ["number", "null"]}}}}}}
PANEL = {
    "type": "object", "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": NONEMPTY,
        "title": NONEMPTY,
        "datasource": DATASOURCE_REF,
        "gridPos": {"type": "object", "required": ["h", "w", "x", "y"], "properties": {
            "h": {"type": "integer", "minimum": 1}, "w": {"type": "integer", "minimum": 1, "maximum": 24},
            "x": {"type": "integer", "minimum": 0, "maximum": 23}, "y": {"type": "integer", "minimum": 0}}},
        "targets": {"type": "array", "items": {"type": "object", "required": ["refId", "expr"], "properties": {
            "refId": NONEMPTY, "expr": NONEMPTY, "datasource": DATASOURCE_REF, "legendFormat": STR,
            "instant": {"type": "boolean"}, "range": {"type": "boolean"},
            "format": {"enum": ["time_series", "table", "heatmap"]}}}},
        "fieldConfig": {"type": "object", "required": ["defaults", "overrides"], "properties": {
            "defaults": {"type": "object", "properties": {"unit": STR, "noValue": STR, "thresholds": THRESHOLDS}},
            "overrides": {"type": "array", "items": {"type": "object", "required": ["matcher", "properties"]}}}},
        "transformations": {"type": "array", "items": {"type": "object", "required": ["id", "options"]}},
        "options": {"type": "object"},
    },
}
VARIABLE = {
    "type": "object", "required": ["name", "type"],
    "properties": {
        "name": {"type": "string", "pattern": r"^\w+$"},
        "type": {"enum": ["query", "adhoc", "groupby", "constant", "datasource", "interval", "textbox", "custom", "system"]},
        "datasource": DATASOURCE_REF, "hide": {"enum": [0, 1, 2]}, "refresh": {"enum": [0, 1, 2]},
        "includeAll": {"type": "boolean"}, "multi": {"type": "boolean"}, "allValue": STR,
        "sort": {"type": "integer", "minimum": 0, "maximum": 8},
        "current": {"type": "object", "required": ["text", "value"]},
        "options": {"type": "array", "items": {"type": "object", "required": ["text", "value"]}},
    },
}
DASHBOARD = {
    "type": "object", "required": ["uid", "title", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "uid": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{8,40}$"},
        "title": NONEMPTY,
        "schemaVersion": {"type": "integer", "minimum": 36},
        "id": {"type": ["integer", "null"]},
        "editable": {"type": "boolean"}, "graphTooltip": {"enum": [0, 1, 2]}, "timezone": STR, "refresh": STR,
        "tags": {"type": "array", "items": STR},
        "time": {"type": "object", "required": ["from", "to"], "properties": {"from": NONEMPTY, "to": NONEMPTY}},
        "templating": {"type": "object", "required": ["list"], "properties": {"list": {"type": "array", "items": VARIABLE}}},
        "annotations": {"type": "object", "properties": {"list": {"type": "array", "items": {
            "type": "object", "required": ["datasource", "enable", "iconColor", "name"]}}}},
        "links": {"type": "array", "items": {"type": "object", "required": [
            "asDropdown", "icon", "includeVars", "keepTime", "tags", "targetBlank", "title", "tooltip", "type"],
            "properties": {"type": {"enum": ["link", "dashboards"]}}}},
        "panels": {"type": "array", "minItems": 1, "items": PANEL},
    },
}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _schema_errors(value: Any, schema: Dict[str, Any], path: str = "$") -> Iterator[str]:
    """The violations of the JSON Schema subset used above (type, enum, required, properties,
    items, minimum/maximum, minItems, minLength, pattern)."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, (int, float)) and not isinstance(value, bool) if t == "number"
                 else isinstance(value, int) and not isinstance(value, bool) if t == "integer"
                 else isinstance(value, _TYPES[t]) for t in types)
        if not ok:
            yield f"{path}: {value!r} is not of type {'/'.join(types)}"
            return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{path}: {value!r} not one of {schema['enum']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            yield f"{path}: {value} out of range"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            yield f"{path}: empty"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield f"{path}: {value!r} does not match {schema['pattern']}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                yield f"{path}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _schema_errors(value[key], sub, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{path}: fewer than {schema['minItems']} items"
        for i, item in enumerate(value):
            yield from _schema_errors(item, schema.get("items", {}), f"{path}[{i}]")


def test_schema_checker_finds_violations():
    bad = {"uid": "x", "title": "", "schemaVersion": 30, "time": {"from": "now-1h"}, "templating": {"list": [{"type": "nope"}]},
           "panels": [{"id": 1, "type": "stat", "title": "t", "gridPos": {"h": 4, "w": 30, "x": 0, "y": 0},
                       "targets": [{"expr": "up"}]}]}
    errors = "\n".join(_schema_errors(bad, DASHBOARD))
    for needle in ("$.uid: 'x' does not match", "$.title: empty", "$.schemaVersion: 30 out of range",
                   "$.time: missing 'to'", "$.templating.list[0]: missing 'name'", "'nope' not one of",
                   "$.panels[0].gridPos.w: 30 out of range", "$.panels[0].targets[0]: missing 'refId'"):
        assert needle in errors, errors


def load(path: Path) -> Dict[str, Any]:
    return json.loads(path.read_text())


def query_panels(dashboard: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_matches_grafana_model(path):
    d = load(path)
    assert list(_schema_errors(d, DASHBOARD)) == []
    names = [v["name"] for v in d["templating"]["list"]]
    assert {"datasource", "cluster", "partition", "node"} <= set(names)
    assert len(names) == len(set(names))
    ds = next(v for v in d["templating"]["list"] if v["name"] == "datasource")
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in query_panels(d):
        assert p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
            for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                assert var in names or var in GRAFANA_VARS, f"{p['title']}: unknown variable ${var}"


# Keys Grafana writes when it exports a dashboard that its dashboard model does not name: the
# built-in annotation's flag and a variable's query text as the editor shows it.
GRAFANA_EXPORT_ONLY = re.compile(r"^\$\.annotations\.list\[0\]\.builtIn$|^\$\.templating\.list\[\d+\]\.definition$")


def _dropped(ours: Any, back: Any, path: str = "$") -> Iterator[str]:
    """Paths of what `ours` has and the round trip `back` lost or changed."""
    if isinstance(ours, dict):
        for k, v in ours.items():
            if not isinstance(back, dict) or k not in back:
                yield f"{path}.{k}"
            else:
                yield from _dropped(v, back[k], f"{path}.{k}")
    elif isinstance(ours, list):
        if not isinstance(back, list) or len(back) != len(ours):
            yield f"{path} (list)"
        else:
            for i, (a, b) in enumerate(zip(ours, back)):
                yield from _dropped(a, b, f"{path}[{i}]")
    elif ours != back:
        yield f"{path} ({ours!r} -> {back!r})"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_round_trips_through_grafanas_own_dashboard_model(path):
    """Grafana's foundation SDK (its models are generated from Grafana's dashboard schema) reads
    the dashboard and writes it back: a key it does not know (a misspelt option, a field of
    another panel type) is lost on the way, and the test names it."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard
    plugins.register_default_plugins()

    def lost(d: Dict[str, Any]) -> List[str]:
        back = json.loads(json.dumps(Dashboard.from_json(d), cls=JSONEncoder))
        assert [p["type"] for p in back["panels"]] == [p["type"] for p in d["panels"]]
        return [p for p in _dropped(d, back) if not GRAFANA_EXPORT_ONLY.match(p)]

    ours = load(path)
    assert lost(ours) == []
    # The check itself: a misspelt key and an option the panel type does not have are caught.
    bad = load(path)
    panel = query_panels(bad)[0]
    panel["fieldconfig"] = panel.pop("fieldConfig")
    panel.setdefault("options", {})["colour"] = "red"
    i = bad["panels"].index(panel)
    assert set(lost(bad)) >= {f"$.panels[{i}].fieldconfig", f"$.panels[{i}].options.colour"}


def test_dashboard_uids_are_unique():
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(DASHBOARDS) == 4 and len(set(uids)) == 4


# ----------------------------------------------------------------------------- real Prometheus
GRAFANA_VARS = {"__rate_interval": "1m", "__interval": "5s", "__range": "1h"}


def substitute(expr: str, variables: List[Dict[str, Any]]) -> str:
    """Grafana's variable interpolation for the test: every query variable is All (regex .*),
    custom variables keep their current value, $__rate_interval and friends get fixed values."""
    values = dict(GRAFANA_VARS)
    for v in variables:
        values[v["name"]] = v["current"]["value"] if v["type"] in ("custom", "constant", "textbox") else ".*"

    def one(m: "re.Match[str]") -> str:
        return values[m.group(1) or m.group(2)]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def _fixture(name: str, now: int) -> str:
    return re.sub(r"\$\{now(?:-(\d+))?\}", lambda m: str(now - int(m.group(1) or 0)), (FIXTURES / name).read_text())


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


class Stack:
    def __init__(self, tmp: Path):
        self.now = int(time.time())
        self.dirs: Dict[str, Path] = {}
        self.exporters: List[NodeExporter] = []
        targets: Dict[str, List[Tuple[str, Dict[str, str]]]] = {"node": [], "dcgm": []}
        for node in NODES:
            for job, fixture, instance in (("node", f"{node}.prom", node), ("dcgm", f"dcgm-{node}.prom", f"{node}:9400")):
                d = tmp / f"textfile-{job}-{node}"
                d.mkdir()
                write_atomically(d / fixture, _fixture(fixture, self.now))
                self.dirs[fixture] = d
                exporter = NodeExporter(d, workdir=tmp / f"exporter-{job}-{node}")
                self.exporters.append(exporter)
                exporter.start()
                targets[job].append((exporter.address, {"instance": instance}))
        # The rules as shipped but for `for:`, so that alerts fire within the test.
        rules = tmp / "slurm-gpu.rules.yml"
        rules.write_text(re.sub(r"^(\s+for:\s*)\S+$", r"\g<1>0s", RULES.read_text(), flags=re.M))
        self.prometheus = Prometheus(targets, rule_files=[rules], workdir=tmp / "prometheus")
        self.prometheus.start()

    def rewrite(self, fixture: str, old: str, new: str) -> None:
        path = self.dirs[fixture] / fixture
        text = path.read_text()
        assert old in text, old
        write_atomically(path, text.replace(old, new))

    def stop(self) -> None:
        self.prometheus.cleanup()
        for e in self.exporters:
            e.cleanup()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    try:
        require(PROMETHEUS, NODE_EXPORTER)
    except PrometheusUnavailable as e:
        unavailable(str(e))
    s = Stack(tmp_path_factory.mktemp("monitoring"))
    try:
        p = s.prometheus
        # Every target scraped a few times (rate() and increase() need two samples)...
        p.wait_for("count(count_over_time(up[1m]) >= 3)", lambda r: r and r[0]["value"][1] == str(2 * len(NODES)))
        # ... and no textfile rejected by node_exporter.
        assert p.query("max(node_textfile_scrape_error)")["result"][0]["value"][1] == "0"
        yield s
    finally:
        s.stop()


def test_prometheus_renames_the_job_label_of_job_info(stack):
    """Prometheus keeps its scrape job in `job` and renames the exposed Slurm job id to
    `slurm_job` (honor_labels: false, the default): the queries use `slurm_job`."""
    series = stack.prometheus.query("slurm_gpu_job_info")["result"]
    assert sorted((s["metric"]["job"], s["metric"]["slurm_job"], s["metric"]["cluster"]) for s in series) == [
        ("node", "4242", "sgtest"), ("node", "4243", "sgtest")]


def _legend_labels(target: Dict[str, Any]) -> List[str]:
    return re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))


def check_query(p: Prometheus, expr: str, instant: bool, labels: List[str], where: str) -> None:
    if instant:
        data = p.query(expr)
        assert data["resultType"] == "vector", f"{where}: {data['resultType']}"
    else:
        end = time.time()
        data = p.query_range(expr, end - 30, end, step=2)
        assert data["resultType"] == "matrix", f"{where}: {data['resultType']}"
    assert data["result"], f"{where}: no data for {expr}"
    for series in data["result"]:
        missing = [label for label in labels if not series["metric"].get(label)]
        assert not missing, f"{where}: series {series['metric']} lacks legend label(s) {missing}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_queries_return_data(stack, path):
    d = load(path)
    variables = d["templating"]["list"]
    checked = 0
    for v in variables:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
        assert m, f"variable {v['name']}: only label_values(metric, label) is checked here"
        check_query(stack.prometheus, substitute(m.group(1), variables), True, [m.group(2)], f"variable {v['name']}")
        checked += 1
    for panel in query_panels(d):
        for t in panel["targets"]:
            check_query(stack.prometheus, substitute(t["expr"], variables), t.get("instant", False),
                        _legend_labels(t), f"{d['uid']} / {panel['title']} / {t['refId']}")
            checked += 1
    assert checked >= 10


def _alert_key(a: Dict[str, Any]) -> Tuple[str, str, str, str]:
    labels = a["labels"]
    return (labels["alertname"], labels.get("Hostname") or labels.get("instance", ""), labels.get("gpu", ""),
            labels.get("check") or labels.get("xid") or labels.get("slurm_job", ""))


EXPECTED_ALERTS = sorted([
    ("SlurmGpuCheckFailed", "gpu02", "1", "ecc_uncorrectable"),
    ("SlurmGpuCheckFailed", "gpu02", "1", "row_remap_failure"),
    ("SlurmGpuCheckFailed", "gpu02", "1", "pending_reset"),
    ("SlurmGpuCheckFailed", "gpu02", "", "xid"),
    ("SlurmGpuNodeDrained", "gpu02", "", ""),
    ("SlurmGpuBreakerOpen", "", "", "xid"),  # max by (cluster, check): no instance
    ("SlurmGpuXidHardware", "gpu02", "1", "48"),
    ("SlurmGpuEccUncorrectable", "gpu02", "1", ""),
    ("SlurmGpuRowRemapFailure", "gpu02", "1", ""),
    ("SlurmGpuResetPending", "gpu02", "1", ""),
    ("SlurmGpuRecordsBacklog", "gpu02", "", ""),
    ("SlurmGpuRecordsUnshippedOld", "gpu02", "", ""),
    ("SlurmGpuSpoolBacklog", "gpu02", "", ""),
    ("SlurmGpuMetricsStale", "gpu02", "", ""),
    ("SlurmGpuIdleHeldByJob", "gpu01", "1", "4243"),
    ("SlurmGpuRemapHeadroomLow", "gpu02", "1", ""),
    ("SlurmGpuDriverVersionsMixed", "", "", ""),  # gpu01 on 550.54.15, gpu02 on 535.104.05
    ("SlurmGpuVbiosVersionsMixed", "gpu02", "", ""),
    ("SlurmGpuFabricNotReady", "gpu02", "1", ""),
    ("SlurmGpuRecoveryActionPending", "gpu02", "1", ""),
    ("SlurmGpuDriverLibraryMismatch", "gpu02", "", ""),
    ("SlurmGpuFanFailed", "gpu02", "0", ""),
    ("SlurmGpuInforomCorrupted", "gpu02", "1", ""),
    ("SlurmGpuPowerCapped", "gpu02", "1", ""),
])


def test_alerts_fire_in_prometheus(stack):
    assert {a[0] for a in EXPECTED_ALERTS} == set(alert_names()), "every alert is expected somewhere"
    # A new XID 48 and a third uncorrectable ECC error on gpu02 GPU 1 (a fresh Prometheus has
    # no history: the counters must move while it watches).
    gpu1 = 'UUID="GPU-7f3b2c4d-0000-4000-8000-000000000202",modelName="NVIDIA H100 80GB HBM3"'
    stack.rewrite("gpu02.prom", f'{gpu1},xid="48"}} 1', f'{gpu1},xid="48"}} 2')
    stack.rewrite("gpu02.prom", f'{gpu1},type="uncorrected",counter="volatile"}} 2',
                  f'{gpu1},type="uncorrected",counter="volatile"}} 3')

    def settled(alerts: List[Dict[str, Any]]) -> bool:
        return sorted(_alert_key(a) for a in alerts if a["state"] == "firing") == EXPECTED_ALERTS
    try:
        alerts = stack.prometheus.wait_for_alerts(settled, timeout=30)
    except TimeoutError:
        alerts = []
    if not alerts:
        got = sorted((_alert_key(a), a["state"]) for a in stack.prometheus.alerts())
        pytest.fail(f"firing alerts differ from the expected ones after 30 s:\n got {got}\nwant {EXPECTED_ALERTS}")
    for a in alerts:
        assert a["labels"]["severity"] in ("critical", "warning", "info")
        assert a["labels"]["cluster"] == "sgtest"
        assert "{{" not in a["annotations"]["summary"] + a["annotations"]["description"]
    idle = next(a for a in alerts if a["labels"]["alertname"] == "SlurmGpuIdleHeldByJob")
    assert (idle["labels"]["user"], idle["labels"]["account"]) == ("bob", "chem")
    assert idle["annotations"]["summary"] == "Job 4243 holds gpu01 GPU 1 idle"
