"""InferenceModelRewrite: the model names an operator controls, and the table a request looks up.

An ``InferenceModelRewrite`` (llm-d-router, ``llm-d.ai/v1alpha2``; the older
``inference.networking.x-k8s.io/v1alpha2`` is read too) tells one pool's
picker to serve a client's model name as another: an alias, a fallback, a
canary or an A/B split, all *within* the pool (splitting across pools is the
HTTPRoute's job)::

    apiVersion: llm-d.ai/v1alpha2
    kind: InferenceModelRewrite
    metadata: {name: llama-canary}
    spec:
      poolRef: {name: a}              # group inference.networking.k8s.io, kind InferencePool
      rules:
      - matches:                      # OR'ed; no matches: the rule matches every request
        - model: {type: Exact, value: llama-3-8b}
        targets:                      # one is drawn per request, by weight
        - {modelRewrite: llama-3-8b, weight: 90}
        - {modelRewrite: llama-3-8b-canary, weight: 10}

What this module holds, following the router (``pkg/epp/datastore/modelrewritestore.go``
and ``requestcontrol/director.go`` at ebab68792):

- ``decode``: one object, strictly, every problem named by its field;
- ``RewriteTable``: every rewrite of one pool, and the rule that wins for a
  model, decided once when the set changes, so a request pays one dict lookup;
- ``Rule.choose``: the weighted draw among a rule's targets.

**Precedence.** The router's: a rule that matches the model exactly wins over
a generic one (no ``matches``); among rules of one kind the oldest
``creationTimestamp`` wins; within one object, list order. The router sorts
with Go's ``sort.Slice``, which is not stable, and timestamps have one-second
resolution, so rewrites created in the same second (or rules of one object)
come out in no promised order. Here the order is total: after the timestamp
(absent sorts first), the order the source gives (``RewriteTable``: the
file's order, or by namespace and name from the API), then list order.
"""

from __future__ import annotations

import bisect
import datetime
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from plugin_api import ConfigError

API_VERSIONS: Final = ("llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2")
"""The group the router reads today, then the older one it still reads."""
KIND: Final = "InferenceModelRewrite"
POOL_GROUP: Final = "inference.networking.k8s.io"
"""``poolRef.group``'s default: the InferencePool's group."""
MAX_WEIGHT: Final = 1_000_000
EPOCH: Final = datetime.datetime.min.replace(tzinfo=datetime.UTC)
"""The creation time of a rewrite that gives none (a file's): older than any."""


@dataclass(frozen=True, slots=True)
class Target:
    """A model a rule may send a request to, and its weight (None: not given)."""

    model: str
    weight: int | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: the models it matches (none: every request) and the targets it draws from.

    ``weights`` are the cumulative weights of the targets that can be drawn:
    every target when none has a weight (each counts 1: a uniform draw), only
    the weighted ones when some have (the router never picks an unweighted
    target beside weighted ones).
    """

    models: tuple[str, ...]
    targets: tuple[Target, ...]
    drawn: tuple[str, ...] = field(init=False, repr=False)
    weights: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        weighted = [t for t in self.targets if t.weight is not None]
        pool = weighted or list(self.targets)
        running, cumulative = 0, []
        for target in pool:
            running += target.weight if target.weight is not None else 1
            cumulative.append(running)
        object.__setattr__(self, "drawn", tuple(t.model for t in pool))
        object.__setattr__(self, "weights", tuple(cumulative))

    @property
    def generic(self) -> bool:
        return not self.models

    def choose(self, rng: random.Random) -> str:
        """A target drawn by weight (uniform over the sum, as the router's ``rand.Intn``);
        ``""`` when the rule has no target (the request is then answered 400)."""
        if not self.drawn:
            return ""
        if len(self.drawn) == 1:
            return self.drawn[0]
        return self.drawn[bisect.bisect_right(self.weights, rng.randrange(self.weights[-1]))]


@dataclass(frozen=True, slots=True)
class ModelRewrite:
    """One InferenceModelRewrite, decoded: who it is, which pool it is for, its rules."""

    name: str
    namespace: str
    pool: str
    rules: tuple[Rule, ...]
    created: datetime.datetime = EPOCH
    pool_group: str = POOL_GROUP
    api_version: str = API_VERSIONS[0]

    def names(self) -> set[str]:
        """The model names it enumerates: exact matches and targets (what clients may send,
        and what the servers must serve)."""
        return {m for rule in self.rules for m in rule.models} | {
            t.model for rule in self.rules for t in rule.targets
        }


@dataclass(frozen=True, slots=True)
class Decision:
    """The rule that applies to a model, and the rewrite it belongs to (for the metric)."""

    rule: Rule
    rewrite: str


class RewriteTable:
    """Every rewrite of one pool, with the winning rule of each model decided up front.

    Immutable: a source builds a new table whenever its set changes and swaps
    it in whole, so a request reads one consistent table without a lock.
    ``rewrites`` come in the source's order, the tiebreak after the creation
    time (see the module docstring).
    """

    __slots__ = ("_exact", "_generic", "clients", "rewrites")

    def __init__(self, rewrites: Iterable[ModelRewrite] = ()) -> None:
        self.rewrites: Final = tuple(rewrites)
        ranked = sorted(
            (
                (rewrite.created, position, index, rewrite, rule)
                for position, rewrite in enumerate(self.rewrites)
                for index, rule in enumerate(rewrite.rules)
            ),
            key=lambda entry: entry[:3],
        )
        exact: dict[str, Decision] = {}
        generic: Decision | None = None
        for *_, rewrite, rule in ranked:
            if rule.generic:
                generic = generic or Decision(rule, rewrite.name)
            for model in rule.models:
                exact.setdefault(model, Decision(rule, rewrite.name))
        self._exact: Final = exact
        self._generic: Final = generic
        self.clients: Final = frozenset(exact)
        """The model names some rule matches exactly."""

    def __len__(self) -> int:
        return len(self.rewrites)

    def lookup(self, model: str) -> Decision | None:
        """The rule for ``model``: its exact match, else the generic one, else None."""
        return self._exact.get(model, self._generic)

    def names(self) -> set[str]:
        """Every model name the rewrites enumerate (``ModelRewrite.names``)."""
        return {name for rewrite in self.rewrites for name in rewrite.names()}


# --- decoding --------------------------------------------------------------------------


class RewriteError(ConfigError):
    """A field of an InferenceModelRewrite that cannot be used; ``field`` is its path."""


def _fail(where: str, message: str) -> RewriteError:
    return RewriteError(f"{where}: {message}", where)


def _mapping(raw: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise _fail(where, f"expected a mapping, got {type(raw).__name__}")
    return raw


def _known(raw: Mapping[str, Any], where: str, known: set[str]) -> None:
    if unknown := sorted(set(raw) - known):
        raise _fail(f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")


def _string(raw: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = raw.get(key, default)
    if value is None:
        raise _fail(f"{where}.{key}", "required")
    if not isinstance(value, str) or not value:
        raise _fail(f"{where}.{key}", f"expected a non-empty string, got {value!r}")
    return value


def _list(raw: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(f"{where}.{key}", f"expected a list, got {type(value).__name__}")
    return value


def _created(metadata: Mapping[str, Any]) -> datetime.datetime:
    stamp = metadata.get("creationTimestamp")
    if stamp is None:
        return EPOCH
    if isinstance(stamp, datetime.datetime):  # YAML reads an unquoted timestamp as one
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.UTC)
    try:
        parsed = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        raise _fail("metadata.creationTimestamp", f"not an RFC 3339 time: {stamp!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def _target(raw: Any, where: str) -> Target:
    target = _mapping(raw, where)
    _known(target, where, {"modelRewrite", "weight"})
    weight = target.get("weight")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT
    ):
        raise _fail(f"{where}.weight", f"expected an integer 1 to {MAX_WEIGHT:,}, got {weight!r}")
    return Target(_string(target, "modelRewrite", where), weight)


def _match(raw: Any, where: str) -> str:
    match = _mapping(raw, where)
    _known(match, where, {"model"})
    model = _mapping(match.get("model"), f"{where}.model") if "model" in match else None
    if model is None:
        raise _fail(f"{where}.model", "required")
    _known(model, f"{where}.model", {"type", "value"})
    kind = model.get("type", "Exact")
    if kind != "Exact":
        raise _fail(f"{where}.model.type", f"only Exact is defined, got {kind!r}")
    return _string(model, "value", f"{where}.model")


def _rule(raw: Any, where: str, warnings: list[str]) -> Rule:
    rule = _mapping(raw, where)
    _known(rule, where, {"matches", "targets"})
    if "targets" in rule and not _list(rule, "targets", where):
        raise _fail(f"{where}.targets", "at least one target when given")
    matches, given = _list(rule, "matches", where), _list(rule, "targets", where)
    models = [_match(m, f"{where}.matches[{i}]") for i, m in enumerate(matches)]
    targets = [_target(t, f"{where}.targets[{i}]") for i, t in enumerate(given)]
    weighted = sum(1 for t in targets if t.weight is not None)
    if 0 < weighted < len(targets):
        warnings.append(
            f"{where}.targets: some targets have a weight and some not: those without are "
            "never chosen (the router's rule)"
        )
    if not targets:
        warnings.append(
            f"{where}: no targets: the requests it matches are answered 400, as the router does"
        )
    return Rule(tuple(dict.fromkeys(models)), tuple(targets))


def decode(raw: Any, warnings: list[str] | None = None) -> ModelRewrite:
    """One InferenceModelRewrite object (as the API serves it, or as a file holds it).

    Strict where the CRD is (required fields, types, weight range, ``Exact``
    only, unknown fields in ``spec``); ``status`` and the other metadata are
    ignored. Raises ``RewriteError`` naming the field (``spec.rules[0].targets[1].weight``);
    what is allowed but suspicious goes into ``warnings``.
    """
    found: list[str] = [] if warnings is None else warnings
    obj = _mapping(raw, "")
    version = obj.get("apiVersion")
    if version not in API_VERSIONS:
        raise _fail("apiVersion", f"expected one of {', '.join(API_VERSIONS)}, got {version!r}")
    if obj.get("kind") != KIND:
        raise _fail("kind", f"expected {KIND}, got {obj.get('kind')!r}")
    metadata = _mapping(obj.get("metadata"), "metadata")
    spec = _mapping(obj.get("spec"), "spec")
    _known(spec, "spec", {"poolRef", "rules"})
    pool = _mapping(spec.get("poolRef"), "spec.poolRef")
    _known(pool, "spec.poolRef", {"group", "kind", "name"})
    if pool.get("kind", "InferencePool") != "InferencePool":
        raise _fail("spec.poolRef.kind", f"expected InferencePool, got {pool.get('kind')!r}")
    if "rules" not in spec:
        raise _fail("spec.rules", "required")
    listed = _list(spec, "rules", "spec")
    rules = [_rule(r, f"spec.rules[{i}]", found) for i, r in enumerate(listed)]
    return ModelRewrite(
        name=_string(metadata, "name", "metadata"),
        namespace=_string(metadata, "namespace", "metadata", "default"),
        pool=_string(pool, "name", "spec.poolRef"),
        rules=tuple(rules),
        created=_created(metadata),
        pool_group=_string(pool, "group", "spec.poolRef", POOL_GROUP),
        api_version=str(version),
    )


def for_pool(rewrites: Sequence[ModelRewrite], pool: str | None, group: str) -> list[ModelRewrite]:
    """The rewrites whose ``poolRef`` names ``pool`` in ``group`` (the router's filter); all of
    them when ``pool`` is None (a picker that stands for no named pool)."""
    if pool is None:
        return list(rewrites)
    return [r for r in rewrites if r.pool == pool and r.pool_group == group]
