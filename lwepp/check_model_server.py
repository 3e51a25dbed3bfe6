"""``python -m lwepp.check_model_server URL``: what can an endpoint picker use of this model server?

GIE's model-server protocol asks two things of a model server: the OpenAI
API (so the gateway can send it requests), and Prometheus metrics a picker
can score on. Every engine names those metrics its own way, so pickers carry
a naming table per engine (the llm-d router's ``core-metrics-extractor``
has one for vLLM, SGLang, trtllm-serve and Triton). This tool reads a
server's ``/metrics``, ``/v1/models`` and one one-token completion, and says
signal by signal what a picker would find:

==============  ====================================================================
signal          what a picker does with it
==============  ====================================================================
queue           requests waiting: queue scorers, saturation detection
running         requests in the running batch: load scorers
KV usage        fraction (0–1) of the KV cache in use: KV-cache scorers, saturation
LoRA            adapters running and waiting, and the adapter limit: LoRA affinity
block size      tokens per KV-cache block: prefix-cache scoring's block size
block count     KV-cache blocks: the size of a prefix-cache index per server
==============  ====================================================================

The engine is recognised from the metric names (or given with ``--engine``):
``vllm``, ``sglang``, ``trtllm`` (trtllm-serve), ``triton`` (Triton's
TensorRT-LLM backend) and ``llamacpp`` (llama.cpp's server, whose
``llamacpp:requests_deferred`` is the queue and ``llamacpp:requests_processing``
the running batch). A signal an engine does not export at all is *unknown*
(llama.cpp has no KV-cache gauge): a picker must not read that as 0, which
would make the server look idle.

Verdict and exit status:

- 0 ``ready``: the OpenAI API answers and queue, running and KV usage are all
  readable;
- 1 ``degraded``: the API answers, but a picker scoring on load would be
  missing some of those three (it can still route; it cannot weigh load);
- 2 ``unusable``: no OpenAI API to send requests to (also: bad command line).

The page is read as LWEPP's ``metrics-data-source`` reads it: with its parser
(``lwepp.plugins.prometheus``) and its built-in engine mappings
(``lwepp.plugins.metrics_source.BUILTIN_ENGINES``), so the checker's verdict
is about what a picker would actually find. A leaf module: LWEPP's request
path never imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from lwepp.plugins.metrics_source import BUILTIN_ENGINES, CACHE_ATTRIBUTES, EngineMapping
from lwepp.plugins.prometheus import Families, Sample, Selector, parse

Status = Literal["ok", "missing", "unknown", "invalid"]

SIGNALS: Final = ("queue", "running", "kv_usage", "lora", "block_size", "block_count")
CORE: Final = ("queue", "running", "kv_usage")
"""The signals a load-aware picker scores on; without one of them it is degraded."""

LABELS: Final = {
    "queue": "queue",
    "running": "running",
    "kv_usage": "KV usage",
    "lora": "LoRA",
    "block_size": "block size",
    "block_count": "block count",
}


ENGINES: Final[Mapping[str, str]] = {
    # The checker's short names (the simulator's dialects) → the metrics data source's
    # built-in engine; in this order, a tie in recognising the engine goes to the first.
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "trtllm-serve",
    "triton": "triton-tensorrt-llm",
    "llamacpp": "llamacpp",
}


@dataclass(frozen=True, slots=True)
class Spec:
    """Where one engine exports one signal.

    ``selector`` picks the series; with ``label`` the value is read from that
    label of the series (an "info" gauge) instead of its value.
    """

    selector: Selector
    label: str | None = None

    def describe(self) -> str:
        return f"{self.selector} label {self.label}" if self.label else str(self.selector)


def _spec(selector: Selector | None, label: str | None = None) -> Spec | None:
    return Spec(selector, label) if selector is not None else None


def _specs(engine: EngineMapping) -> Mapping[str, Spec | None]:
    """Signal → where ``engine`` exports it (None: it does not), per the data source."""
    specs = {
        signal: _spec(engine.gauges.get(attribute))
        for signal, attribute in (
            ("queue", "queue_depth"),
            ("running", "running_requests"),
            ("kv_usage", "kv_cache_usage"),
        )
    }
    specs["lora"] = _spec(engine.lora)
    # As EngineMapping.extract: a label of the info gauge when there is one, else a gauge.
    for signal, attribute, label in zip(
        ("block_size", "block_count"), CACHE_ATTRIBUTES, engine.cache_labels, strict=True
    ):
        info = engine.cache_info
        specs[signal] = _spec(info, label) if info else _spec(engine.gauges.get(attribute))
    return specs


DIALECTS: Final[Mapping[str, Mapping[str, Spec | None]]] = {
    # The llm-d router's built-in engine configs (GIE's model-server protocol lists the
    # same names), as lwepp.plugins.metrics_source maps them; None: not exported.
    name: _specs(BUILTIN_ENGINES[builtin])
    for name, builtin in ENGINES.items()
}

OLDER_NAMES: Final = {
    "vllm:gpu_cache_usage_perc": "vLLM before the V1 engine's vllm:kv_cache_usage_perc",
}
"""Names a picker configured for today's names would miss; reported as a hint."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One signal: whether a picker can read it, from where, and what it says."""

    signal: str
    status: Status
    source: str
    value: str = ""
    note: str = ""


@dataclass(frozen=True, slots=True)
class ApiCheck:
    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class Report:
    url: str
    engine: str | None = None
    detected: bool = False
    metrics_error: str | None = None
    findings: list[Finding] = field(default_factory=list)
    api: list[ApiCheck] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> tuple[str, int, str]:
        """(verdict, exit status, why)."""
        if not self.api or not all(check.ok for check in self.api):
            return "unusable", 2, "the OpenAI API does not answer: the gateway cannot send requests"
        gaps = [f.signal for f in self.findings if f.signal in CORE and f.status != "ok"]
        if self.engine is None:
            gaps = list(CORE)
        if gaps:
            names = ", ".join(LABELS[g] for g in gaps)
            return "degraded", 1, f"a picker can route to it but cannot weigh {names}"
        return "ready", 0, "every signal a load-aware picker scores on is there"


# --- reading /metrics --------------------------------------------------------------------

_WANTED: Final = frozenset(OLDER_NAMES).union(
    *(BUILTIN_ENGINES[builtin].metric_names for builtin in ENGINES.values())
)
"""Every name the checker reads: the shared parser skips all other lines."""


def _page_names(text: str) -> list[str]:
    """The names of a page's sample lines, sorted (only to say what was seen)."""
    lines = (line.strip() for line in text.split("\n"))
    return sorted(
        {re.split(r"[{\s]", line, maxsplit=1)[0] for line in lines if line and line[0] != "#"}
    )


def detect_engine(families: Families) -> str | None:
    """The dialect under whose names most of the core signals are found, if any is."""
    scores = {
        engine: sum(
            1 for signal in CORE if (spec := specs[signal]) and spec.selector.select(families)
        )
        for engine, specs in DIALECTS.items()
    }
    best = max(scores, key=lambda engine: scores[engine])
    return best if scores[best] else None


def _number(signal: str, spec: Spec, found: list[Sample]) -> Finding:
    if spec.label is not None:
        raw = found[0][0].get(spec.label)
        if raw is None:
            return Finding(signal, "missing", spec.describe(), note=f"no {spec.label} label")
        try:
            value = float(raw)
        except ValueError:
            return Finding(signal, "invalid", spec.describe(), raw, "not a number")
    else:
        # Several series (one per model, or per engine rank): a picker adds them up.
        value = sum(s[1] for s in found)
    if math.isnan(value) or value < 0:
        return Finding(signal, "invalid", spec.describe(), f"{value:g}", "must be a number >= 0")
    if signal == "kv_usage" and value > 1:
        return Finding(signal, "invalid", spec.describe(), f"{value:g}", "a fraction must be <= 1")
    if signal in ("block_size", "block_count") and value <= 0:
        return Finding(signal, "invalid", spec.describe(), f"{value:g}", "must be > 0")
    return Finding(signal, "ok", spec.describe(), f"{value:g}")


def _lora(spec: Spec, found: list[Sample]) -> Finding:
    """vLLM's LoRA gauge: the newest series (its value is a timestamp) carries the state."""
    labels = max(found, key=lambda s: s[1])[0]
    if "max_lora" not in labels:
        return Finding("lora", "invalid", spec.describe(), note="no max_lora label")
    running = labels.get("running_lora_adapters") or "-"
    waiting = labels.get("waiting_lora_adapters") or "-"
    value = f"max {labels['max_lora']}, running {running}, waiting {waiting}"
    return Finding("lora", "ok", spec.describe(), value)


def read_signals(families: Families, engine: str) -> list[Finding]:
    """Each signal as ``engine`` names it, judged as a picker would read it."""
    findings = []
    for signal in SIGNALS:
        spec = DIALECTS[engine][signal]
        if spec is None:
            note = f"{engine} does not export it: a picker must treat it as unknown, not 0"
            if signal == "lora":
                note = f"{engine} reports no LoRA state"
            findings.append(Finding(signal, "unknown", "-", note=note))
            continue
        found = spec.selector.select(families)
        if not found:
            findings.append(Finding(signal, "missing", spec.describe(), note="not in /metrics"))
        elif signal == "lora":
            findings.append(_lora(spec, found))
        else:
            findings.append(_number(signal, spec, found))
    return findings


def check_metrics(text: str, engine: str | None = None, report: Report | None = None) -> Report:
    """Judge a ``/metrics`` page; ``engine`` None recognises it from the names."""
    report = report or Report("")
    # The parser LWEPP's metrics data source uses: a line that does not follow the
    # format is skipped, as a picker would skip it, rather than failing the page.
    families = parse(text, _WANTED)
    report.detected = engine is None
    report.engine = engine or detect_engine(families)
    report.hints += [
        f"{name} found: {why}" for name, why in OLDER_NAMES.items() if name in families
    ]
    if report.engine is None:
        shown = ", ".join(_page_names(text)[:8]) or "no samples at all"
        report.metrics_error = f"no known engine's names (saw: {shown})"
        return report
    report.findings = read_signals(families, report.engine)
    return report


# --- the OpenAI API ----------------------------------------------------------------------


def _fetch(url: str, timeout: float, body: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"} if data else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def check_api(base: str, timeout: float, model: str | None = None) -> list[ApiCheck]:
    """``GET /v1/models`` and a one-token ``POST /v1/completions``."""
    try:
        status, raw = _fetch(f"{base}/v1/models", timeout)
        cards = json.loads(raw)["data"] if status == 200 else None
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [ApiCheck("GET /v1/models", False, f"{type(error).__name__}: {error}")]
    if not isinstance(cards, list) or not cards:
        return [ApiCheck("GET /v1/models", False, f"status {status}, no model listed")]
    ids = [str(card.get("id")) for card in cards if isinstance(card, dict)]
    adapters = [str(c.get("id")) for c in cards if isinstance(c, dict) and c.get("parent")]
    listed = ", ".join(i for i in ids if i not in adapters)
    if adapters:
        listed += f"; adapters: {', '.join(adapters)}"
    checks = [ApiCheck("GET /v1/models", True, listed)]
    chosen = model or ids[0]
    body = {"model": chosen, "prompt": "Hello", "max_tokens": 1}
    try:
        status, raw = _fetch(f"{base}/v1/completions", timeout, body)
        answer = json.loads(raw) if status == 200 else None
    except (OSError, ValueError) as error:
        checks.append(ApiCheck("POST /v1/completions", False, f"{type(error).__name__}: {error}"))
        return checks
    if not isinstance(answer, dict) or not answer.get("choices"):
        detail = f"status {status}: {raw[:200].decode(errors='replace')}"
        checks.append(ApiCheck("POST /v1/completions", False, detail))
        return checks
    usage = answer.get("usage")
    said = "usage reported" if isinstance(usage, dict) else "no usage (token counts unknown)"
    checks.append(ApiCheck("POST /v1/completions", True, f"model {chosen}, 1 token, {said}"))
    return checks


def check(
    base: str, engine: str | None = None, model: str | None = None, timeout: float = 10.0
) -> Report:
    """Everything: ``/metrics``, ``/v1/models`` and a tiny completion of the server at ``base``."""
    base = base.rstrip("/")
    report = Report(base)
    try:
        status, raw = _fetch(f"{base}/metrics", timeout)
    except OSError as error:
        report.metrics_error = f"/metrics: {type(error).__name__}: {error}"
    else:
        if status != 200:
            report.metrics_error = f"/metrics answered {status}"
        else:
            check_metrics(raw.decode(errors="replace"), engine, report)
    report.api = check_api(base, timeout, model)
    return report


# --- output ------------------------------------------------------------------------------


def render(report: Report) -> str:
    lines = [f"Model server: {report.url}"]
    if report.engine:
        how = "recognised from /metrics" if report.detected else "as given"
        lines.append(f"Engine: {report.engine} ({how})")
    lines += ["", "OpenAI API"]
    for api in report.api:
        lines.append(f"  {'ok' if api.ok else 'FAILED':<8} {api.name:<22} {api.detail}")
    lines += ["", "Signals an endpoint picker reads (/metrics)"]
    if report.metrics_error:
        lines.append(f"  {'unknown':<8} all of them        {report.metrics_error}")
    for f in report.findings:
        value = f" = {f.value}" if f.value else ""
        note = f"  ({f.note})" if f.note else ""
        lines.append(f"  {f.status:<8} {LABELS[f.signal]:<12} {f.source}{value}{note}")
    lines += [f"  hint: {hint}" for hint in report.hints]
    verdict, status, why = report.verdict
    lines += ["", f"Verdict: {verdict.upper()}: {why} (exit {status})"]
    return "\n".join(lines)


def as_json(report: Report) -> str:
    verdict, status, why = report.verdict
    return json.dumps(
        {
            "url": report.url,
            "engine": report.engine,
            "verdict": verdict,
            "exit": status,
            "why": why,
            "metrics_error": report.metrics_error,
            "api": [dataclasses.asdict(c) for c in report.api],
            "signals": {f.signal: dataclasses.asdict(f) for f in report.findings},
            "hints": report.hints,
        },
        indent=2,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lwepp.check_model_server",
        description="Check what an endpoint picker can use of a model server: its OpenAI API "
        "(GET /v1/models, a one-token completion) and, signal by signal, its /metrics (queue, "
        "running, KV-cache usage, LoRA, cache block size and count) under vLLM, SGLang, "
        "trtllm-serve, Triton (TensorRT-LLM) or llama.cpp naming. Exit 0: ready; 1: degraded "
        "(the API works, some load signal is missing or unknown); 2: unusable (no OpenAI API).",
    )
    parser.add_argument("url", help="the server's base URL, e.g. http://10.0.0.7:8000")
    parser.add_argument(
        "--engine",
        choices=sorted(DIALECTS),
        help="read /metrics under this engine's names (default: recognise them)",
    )
    parser.add_argument(
        "--model", help="the model for the test completion (default: the first listed)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds per HTTP request (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = check(args.url, args.engine, args.model, args.timeout)
    print(as_json(report) if args.json else render(report))
    sys.exit(report.verdict[1])


if __name__ == "__main__":
    main()
