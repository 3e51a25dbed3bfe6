"""Workloads for routing benchmarks: lists of timed OpenAI requests, pure functions of a seed.

Every generator returns a list of ``Arrival`` values sorted by arrival time:
when the request is sent (``at``, seconds from the start), its OpenAI body,
and the prompt as the simulator tokenizes it (``prompt_tokens``), so a
benchmark in virtual time can hand it to an engine without rendering the
body again, and a live benchmark can send the body over HTTP. Nothing here
reads a clock or keeps state: the same parameters and seed give the same
list, request for request.

Four workloads:

``shared_prefix``
    ``groups`` system prompts of ``prefix_tokens`` tokens, each shared by
    ``users`` users who ask ``question_tokens``-token questions (a fresh
    question every time, so only the system prompt is shared). Arrivals are a
    Poisson process at ``rate`` per second; each picks a group and a user
    uniformly at random. The shape of GIE's and llm-d's "shared prefix"
    benchmark (inference-perf's ``shared_prefix`` data generator).
``multi_turn``
    Chat sessions: each turn resends the conversation so far (a system prompt
    shared by every session, then the user's and the assistant's messages)
    plus a new user message, so a session's prompt grows turn by turn.
    Sessions start as a Poisson process; turns follow after exponential think
    times. Turns are scheduled open-loop (turn k at the session's start plus
    k think times), not after the previous answer: every strategy is offered
    exactly the same requests at the same times, and with think times much
    longer than an answer takes the two are the same.
``mooncake``
    Replay of the Mooncake trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``: one id per 512-token block, equal ids
    at equal positions meaning an equal prefix). Each id becomes a fixed text
    block (``simulator.tokenizer.text_block(id, block_tokens)``), so a shared
    id chain is a shared prompt prefix; lengths scale by ``block_tokens / 512``.
``azure``
    Replay of Azure's LLM inference trace (code): real arrival times and
    lengths, every prompt its own text. Nothing is shared: the control.

Chat prompts are tokenized as the simulator's OpenAI server renders them: one
``role: content`` line per message (``chat_text``).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import lzma
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any, Final

import orjson

from simulator.tokenizer import output_token, text_block, token_block, tokenize

MODEL: Final = "sim-model"
"""The model every workload names (the simulated pool serves one base model)."""

MOONCAKE_BLOCK_TOKENS: Final = 512
"""Tokens per ``hash_ids`` entry in the Mooncake trace (its README)."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload: when it is sent and what it asks.

    ``body`` is the OpenAI request (``/v1/completions`` when it has
    ``prompt``, ``/v1/chat/completions`` when it has ``messages``);
    ``prompt_tokens`` is its prompt as the simulator tokenizes it;
    ``group`` and ``session`` label what the request shares with others
    (a system prompt, a conversation, a trace's first block).
    """

    at: float
    request_id: str
    body: Mapping[str, Any]
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    group: str
    session: str

    @property
    def path(self) -> str:
        """The OpenAI path this body goes to."""
        return "/v1/chat/completions" if "messages" in self.body else "/v1/completions"

    def body_bytes(self) -> bytes:
        """The body as sent on the wire (compact JSON)."""
        return orjson.dumps(self.body)


def derived_seed(*parts: object) -> int:
    """A stable 63-bit integer for ``parts`` (a text block's seed, a generator's seed).

    Python's ``hash`` of a string changes between processes; this does not.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def poisson_times(rate: float, count: int, rng: random.Random, start: float = 0.0) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second after ``start``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    times, now = [], start
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def chat_text(messages: Iterable[Mapping[str, str]]) -> str:
    """Chat messages as the simulator renders them for its engine: ``role: content`` lines."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


# --- shared prefix -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The shape of the shared-prefix workload (see the module docstring)."""

    groups: int = 16
    prefix_tokens: int = 1024
    users: int = 8
    question_tokens: int = 64
    max_tokens: int = 32
    model: str = MODEL

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.question_tokens

    @property
    def shared_fraction(self) -> float:
        """The share of prompt tokens a perfect prefix cache could serve once warm."""
        return self.prefix_tokens / self.prompt_tokens


def shared_prefix(shape: SharedPrefix, rate: float, count: int, seed: int = 0) -> list[Arrival]:
    """``count`` completions requests at ``rate`` per second (Poisson) over ``shape``'s groups.

    Group ``g``'s system prompt is ``text_block`` of a seed derived from
    ``(seed, g)``; question ``k`` of a request is a fresh block. Request ids
    are ``sp-<rate>-<n>``. Each request's gap, group and user are drawn in
    turn, so a longer run starts with exactly the requests of a shorter one
    (the first half of a run is the run half as long).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(derived_seed("shared-prefix", seed, rate))
    prefixes = []
    for group in range(shape.groups):
        block = derived_seed("shared-prefix", seed, "system", group)
        prefixes.append(
            (text_block(block, shape.prefix_tokens), tuple(token_block(block, shape.prefix_tokens)))
        )
    arrivals = []
    at = 0.0
    for n in range(count):
        at += rng.expovariate(rate)
        group, user = rng.randrange(shape.groups), rng.randrange(shape.users)
        block = derived_seed("shared-prefix", seed, rate, n)
        question = text_block(block, shape.question_tokens)
        text, tokens = prefixes[group]
        arrivals.append(
            Arrival(
                at=at,
                request_id=f"sp-{rate:g}-{n}",
                body={
                    "model": shape.model,
                    "prompt": text + question,
                    "max_tokens": shape.max_tokens,
                },
                prompt_tokens=tokens + tuple(token_block(block, shape.question_tokens)),
                max_tokens=shape.max_tokens,
                group=f"g{group}",
                session=f"g{group}-u{user}",
            )
        )
    return arrivals


# --- multi-turn chat -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """The shape of the multi-turn chat workload (see the module docstring)."""

    sessions: int = 64
    turns: int = 6
    session_rate: float = 1.0
    """Sessions started per second (Poisson)."""
    system_tokens: int = 256
    user_tokens: int = 96
    max_tokens: int = 64
    """Each answer's length; the next turn resends an answer of this length."""
    think_seconds: float = 8.0
    """Mean think time between two turns of a session (exponential)."""
    model: str = MODEL


def multi_turn(shape: MultiTurn, seed: int = 0) -> list[Arrival]:
    """Every turn of every session, sorted by arrival; ids ``mt-<session>-<turn>``."""
    rng = random.Random(derived_seed("multi-turn", seed))
    system = text_block(derived_seed("multi-turn", seed, "system"), shape.system_tokens)
    # The client resends what the model answered: the simulator's fixed output words.
    answer = "".join(output_token(i) for i in range(shape.max_tokens))
    arrivals = []
    for s, start in enumerate(poisson_times(shape.session_rate, shape.sessions, rng)):
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        rendered = ""
        at = start
        for turn in range(shape.turns):
            if turn:
                messages.append({"role": "assistant", "content": answer})
                at += rng.expovariate(1.0 / shape.think_seconds)
            question = text_block(derived_seed("multi-turn", seed, s, turn, "u"), shape.user_tokens)
            messages.append({"role": "user", "content": question})
            rendered = chat_text(messages)
            arrivals.append(
                Arrival(
                    at=at,
                    request_id=f"mt-{s}-{turn}",
                    body={
                        "model": shape.model,
                        "messages": [dict(m) for m in messages],
                        "max_tokens": shape.max_tokens,
                    },
                    prompt_tokens=tuple(tokenize(rendered)),
                    max_tokens=shape.max_tokens,
                    group="chat",
                    session=f"s{s}",
                )
            )
    arrivals.sort(key=lambda a: a.at)
    return arrivals


# --- trace replay --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One line of the Mooncake trace, as recorded."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AzureRecord:
    """One row of Azure's LLM inference trace: seconds since the first row, and lengths."""

    at: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class HashedFormat:
    """A JSONL trace of prompt block hashes: what one hash id stands for, and the clock."""

    block_tokens: int
    """Tokens of the original prompt each hash id covers."""
    timestamp_ms: float
    """Milliseconds in one unit of the records' ``timestamp``."""


MOONCAKE: Final = HashedFormat(512, 1.0)
"""kvcache-ai/Mooncake's FAST'25 traces: ``timestamp`` in ms, 512-token blocks."""
BAILIAN: Final = HashedFormat(16, 1000.0)
"""alibaba-edu/qwen-bailian-usagetraces-anon's: the same fields plus ``chat_id``,
``parent_chat_id``, ``type`` and ``turn``; ``timestamp`` in seconds, 16-token blocks."""


COMPRESSED: Final[Mapping[str, Callable[..., IO[Any]]]] = {
    ".gz": gzip.open,
    ".xz": lzma.open,
    ".bz2": bz2.open,
}
"""Traces are often kept compressed: a file ending so is read through its decompressor."""


UNREADABLE: Final = (ValueError, csv.Error, OSError, EOFError, lzma.LZMAError)
"""What reading a file that is not a trace raises (a bad record names its line; a damaged
archive, or a file that is not one, speaks for itself)."""


def open_trace(path: Path, mode: str = "rb", **options: Any) -> IO[Any]:
    """``path`` opened for reading, decompressed when its name ends ``.gz``, ``.xz`` or ``.bz2``."""
    opener = COMPRESSED.get(path.suffix)
    return opener(path, mode, **options) if opener else path.open(mode, **options)


def trace_suffix(path: Path) -> str:
    """The suffix saying what the trace is (``.csv``, ``.jsonl``), under any compression's."""
    return Path(path.stem).suffix if path.suffix in COMPRESSED else path.suffix


_SESSION_FIELDS: Final = frozenset({"chat_id", "parent_chat_id"})


def hashed_format(path: Path) -> HashedFormat:
    """Bailian's when the first record has a ``chat_id`` or a ``parent_chat_id`` (replayers
    treat the second as optional in a session's first turn), Mooncake's otherwise."""
    with open_trace(path) as lines:
        for line in lines:
            if line.strip():
                try:
                    first = orjson.loads(line)
                except orjson.JSONDecodeError:
                    return MOONCAKE  # read_mooncake names the line
                return (
                    BAILIAN
                    if isinstance(first, dict) and _SESSION_FIELDS & first.keys()
                    else MOONCAKE
                )
    return MOONCAKE


def read_mooncake(
    path: Path, start: int = 0, count: int | None = None, form: HashedFormat | None = None
) -> list[MooncakeRecord]:
    """Records ``start`` to ``start + count`` of a Mooncake or Bailian JSONL trace, in file order.

    Timestamps come back in milliseconds whichever the format (``form``, or
    ``hashed_format``'s answer when not given). A line that is not such a
    record is a ``ValueError`` naming the line and the field.
    """
    unit = (form or hashed_format(path)).timestamp_ms
    records: list[MooncakeRecord] = []
    with open_trace(path) as lines:
        for index, line in enumerate(lines):
            if index < start or not line.strip():
                continue
            if count is not None and len(records) >= count:
                break
            try:
                row = orjson.loads(line)
                records.append(
                    MooncakeRecord(
                        float(row["timestamp"]) * unit,
                        int(row["input_length"]),
                        int(row["output_length"]),
                        tuple(int(h) for h in row["hash_ids"]),
                    )
                )
            except KeyError as missing:
                raise ValueError(f"line {index + 1}: no field {missing}") from None
            except (TypeError, ValueError) as error:
                raise ValueError(f"line {index + 1}: {error}") from None
    return records


AZURE_COLUMNS: Final = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
"""Azure's LLM inference traces (2023 and 2024): a date and time, prompt and output tokens."""
BURSTGPT_COLUMNS: Final = ("Timestamp", "Request tokens", "Response tokens")
"""BurstGPT's (HPMLL/BurstGPT, beside ``Model``, ``Total tokens``, ``Log Type`` and, in
later files, ``Session ID``): seconds from the trace's start, prompt and output tokens."""
_EPOCH: Final = datetime(1970, 1, 1)


def read_azure(path: Path, start: int = 0, count: int | None = None) -> list[AzureRecord]:
    """Records ``start`` to ``start + count`` of a CSV trace, times relative to the first.

    The header says whose columns it has: Azure's (``AZURE_COLUMNS``) or
    BurstGPT's (``BURSTGPT_COLUMNS``). BurstGPT logs a failed request with 0
    response tokens; such a row never reached an engine's decode and is not a
    record. A row that is not a record is a ``ValueError`` naming the line
    and the column.
    """
    records: list[AzureRecord] = []
    first: datetime | None = None
    with open_trace(path, "rt", newline="") as file:
        rows = csv.DictReader(file)
        header = rows.fieldnames or []
        if all(column in header for column in AZURE_COLUMNS):
            columns, time_of = AZURE_COLUMNS, _azure_time
        elif all(column in header for column in BURSTGPT_COLUMNS):
            columns, time_of = BURSTGPT_COLUMNS, _seconds
        else:
            raise ValueError(
                f"line 1: columns {','.join(header)!r}: expected Azure's "
                f"{','.join(AZURE_COLUMNS)} or BurstGPT's {','.join(BURSTGPT_COLUMNS)}"
            )
        index = 0
        for row in rows:
            try:
                at, prompt, output = (_cell(row, column) for column in columns)
                when, prompt_tokens, output_tokens = time_of(at), int(prompt), int(output)
            except ValueError as error:
                raise ValueError(f"line {rows.line_num}: {error}") from None
            if columns is BURSTGPT_COLUMNS and output_tokens == 0:
                continue
            first = first or when
            index += 1
            if index <= start:
                continue
            if count is not None and len(records) >= count:
                break
            records.append(
                AzureRecord((when - first).total_seconds(), prompt_tokens, output_tokens)
            )
    return records


def _cell(row: dict[str | Any, str | Any], column: str) -> str:
    value = row[column]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"no value in column {column!r}")
    return value.strip()


_STAMP: Final = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?")


def _azure_time(text: str) -> datetime:
    """A timestamp as Azure writes it, as naive UTC.

    2023's trace writes ``2023-11-16 18:17:03.9799600``: seven fractional
    digits, one more than Python parses (the seventh, 100 ns, is dropped);
    2024's adds an offset, ``2024-05-10 00:00:00.009930+00:00``.
    """
    stamp = _STAMP.fullmatch(text)
    if stamp is None:
        raise ValueError(f"timestamp {text!r} is not YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]")
    when, fraction, offset = stamp.groups()
    parsed = datetime.fromisoformat(f"{when}.{((fraction or '') + '000000')[:6]}{offset or ''}")
    utc = parsed.utcoffset()
    return parsed.replace(tzinfo=None) - utc if utc is not None else parsed


def _seconds(text: str) -> datetime:
    """BurstGPT's timestamp, seconds from the trace's start, on the same clock as Azure's."""
    try:
        return _EPOCH + timedelta(seconds=float(text))
    except (ValueError, OverflowError):  # not a number, nan, or past datetime's years
        raise ValueError(f"timestamp {text!r} is not a number of seconds") from None


@dataclass(frozen=True, slots=True)
class Replay:
    """How a trace is scaled onto the simulated servers; every factor is reported with results.

    ``length_scale`` multiplies prompt lengths (for Mooncake it is
    ``block_tokens / 512``, so a 512-token block becomes ``block_tokens``
    tokens); ``output_scale`` multiplies output lengths; ``time_scale``
    multiplies the gaps between arrivals (0.5 replays twice as fast).
    Scaled lengths are rounded up and at least 1.
    """

    length_scale: float
    output_scale: float
    time_scale: float
    max_output: int = 1 << 30
    """Output lengths are capped here after scaling (a few very long answers would make the
    replay's length the time of one request)."""
    model: str = MODEL


def _scaled(value: int, scale: float, cap: int = 1 << 30) -> int:
    return min(cap, max(1, math.ceil(value * scale)))


def mooncake(records: Sequence[MooncakeRecord], block_tokens: int, replay: Replay) -> list[Arrival]:
    """Completions requests replaying ``records``; each hash id is a ``block_tokens`` block.

    The prompt is the blocks of the request's ``hash_ids`` in order, cut to
    its scaled ``input_length`` (the trace's last block is usually partial).
    ``replay.length_scale`` should be ``block_tokens`` over the tokens a hash id covers
    in the trace (512 in Mooncake's, 16 in Bailian's). The group is the
    first hash id (requests with the same first block share at least it).
    """
    if not records:
        return []
    blocks: dict[int, tuple[str, tuple[int, ...]]] = {}
    t0 = min(record.timestamp_ms for record in records)
    arrivals = []
    for n, record in enumerate(records):
        texts: list[str] = []
        tokens: list[int] = []
        last = 0  # tokens in the last block taken
        length = _scaled(record.input_length, replay.length_scale)
        for hash_id in record.hash_ids:
            if len(tokens) >= length:
                break
            block = blocks.get(hash_id)
            if block is None:
                block = blocks[hash_id] = (
                    text_block(hash_id, block_tokens),
                    tuple(token_block(hash_id, block_tokens)),
                )
            texts.append(block[0])
            tokens += block[1]
            last = len(block[1])
        if len(tokens) > length:  # cut the text at the same word as the tokens
            cut = length - (len(tokens) - last)
            texts[-1] = "".join(f"{word} " for word in texts[-1].split()[:cut])
            del tokens[length:]
        output = _scaled(record.output_length, replay.output_scale, replay.max_output)
        group = f"h{record.hash_ids[0]}" if record.hash_ids else "none"
        arrivals.append(
            Arrival(
                at=(record.timestamp_ms - t0) / 1000 * replay.time_scale,
                request_id=f"mc-{n}",
                body={"model": replay.model, "prompt": "".join(texts), "max_tokens": output},
                prompt_tokens=tuple(tokens),
                max_tokens=output,
                group=group,
                session=group,
            )
        )
    arrivals.sort(key=lambda a: a.at)
    return arrivals


def azure(records: Sequence[AzureRecord], replay: Replay, seed: int = 0) -> list[Arrival]:
    """Completions requests replaying ``records``, each prompt a fresh text of its scaled length."""
    if not records:
        return []
    t0 = min(record.at for record in records)
    arrivals = []
    for n, record in enumerate(records):
        length = _scaled(record.context_tokens, replay.length_scale)
        block = derived_seed("azure", seed, n)
        text = text_block(block, length)
        output = _scaled(record.generated_tokens, replay.output_scale, replay.max_output)
        arrivals.append(
            Arrival(
                at=(record.at - t0) * replay.time_scale,
                request_id=f"az-{n}",
                body={"model": replay.model, "prompt": text, "max_tokens": output},
                prompt_tokens=tuple(token_block(block, length)),
                max_tokens=output,
                group=f"az-{n}",
                session=f"az-{n}",
            )
        )
    arrivals.sort(key=lambda a: a.at)
    return arrivals
