"""The serving flags every service takes, defined, checked and read once; the one way to run.

``python -m lwepp``, ``python -m bbr`` and ``python -m onehop`` listen the
same way (an ext_proc port, a gRPC health port, a metrics port), serve TLS
the same way, run as N workers the same way, drain the same way on SIGTERM
and cap held bodies the same way; only their default ports differ. Each
``main`` does the same four things::

    parser = ...; add_serving_flags(parser, Ports(...))   # the flags
    options = options_or_exit(parser, args)               # checked, read whole; logging
    ...                                                   # its own flags, config
    return run(module, options, lambda: Service(...))     # logs, workers or serve

``serving_options`` is the only reader of the serving flags, and ``run`` the
only caller of ``serve`` and ``run_workers``: a serving flag added to
``add_serving_flags`` and ``ServingOptions`` reaches every service.
``Parser`` prints one line per error (the flag and what is wrong), exit 2.

**The originals' spelling.** Deployments written for GIE's lwepp, the llm-d
router or the payload processor pass Go flags (``pflag``): ``--secure-serving=false``,
``--drain-timeout=30s``, ``--v=3``, ``--zap-encoder json``. Switchyard takes
them as written: booleans as ``--flag``, ``--flag=true`` or ``--flag=false``
(Go's spellings of true and false), durations as Go writes them (``500ms``,
``1m30s``) or as plain seconds, sizes as Kubernetes quantities (``10MiB``).
A flag Switchyard has no use for is listed in its service's table of
``Ignored`` flags: accepted, and named in one warning line at start when its
value asks for something Switchyard does not do.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import structlog

from pods.kubeapi import KubeconfigError, load_kubeconfig
from serving.logs import configure_logging
from serving.metrics_auth import MetricsAuth
from serving.options import Ports, ServingOptions
from serving.server import Service, serve
from serving.tls import ServerTLS, TLSError, shared_tls
from serving.workers import run_workers
from wire.exchange import MAX_BODY_BYTES

LOG_LEVELS = ("debug", "info", "warning", "error")
ENCODERS: Final = ("json", "console")

log = structlog.get_logger()

TLS_VERSIONS: Final = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")
"""``--tls-min-version`` values, Go's names (the llm-d router's flag)."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the flag and what is wrong), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# --- values, as Go's flag packages read them ---------------------------------------------


def port(text: str) -> int:
    """A TCP port number, 0 to 65535 (0: any free port)."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a port (0-65535, 0 picks a free one)")
    return number


_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def go_bool(text: str) -> bool:
    """A boolean as Go's ``strconv.ParseBool`` reads it: 1, t, true, True, TRUE; 0, f, false..."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def duration(text: str) -> float:
    """Seconds, from Go's ``time.ParseDuration`` syntax (``30s``, ``1m30s``, ``250ms``) or a
    plain number of seconds. Never negative."""
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION_PART.findall(text)
        if not parts or "".join(number + unit for number, unit in parts) != text:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration (e.g. 30s, 1m30s, 500ms, or seconds)"
            ) from None
        seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return seconds


_SUFFIXES: Final = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
}


def byte_size(text: str) -> int:
    """Bytes, from a Kubernetes quantity (``4194304``, ``10Mi``, ``25M``); a trailing ``B`` is
    dropped first (``10MiB``), as the llm-d router does."""
    number = text.strip()
    if len(number) > 1 and number[-1] in "Bb":
        number = number[:-1]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|k|M|G)?", number)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 10MiB, 25MB, 4194304)")
    size = float(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    if size != int(size) or size > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of bytes, below 2 GiB")
    return int(size)


def add_bool(group: Any, name: str, default: bool | None, help: str) -> None:
    """A Go-style boolean flag: ``--name`` alone is true, ``--name=false`` is false."""
    group.add_argument(
        name, nargs="?", const=True, default=default, type=go_bool, metavar="BOOL", help=help
    )


# --- flags accepted and ignored --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ignored:
    """A flag an original takes that Switchyard accepts without acting on it.

    ``kind`` is ``"bool"``, ``"duration"`` or ``"value"``. ``why`` says what
    Switchyard does instead. ``quiet``: the value that asks for nothing
    Switchyard lacks (``--tracing=false``), which is accepted without a word;
    any other value draws one warning at start. None: every value warns.
    """

    flag: str
    kind: str
    why: str
    quiet: object = None


COMMON_IGNORED: Final = (
    Ignored("--tracing", "bool", "Switchyard emits no traces", quiet=False),
    Ignored("--enable-pprof", "bool", "Python has no pprof handlers", quiet=False),
    Ignored("--zap-devel", "bool", "logging is set by --zap-encoder and -v", quiet=False),
    Ignored("--zap-stacktrace-level", "value", "errors are logged with their traceback"),
    Ignored("--zap-time-encoding", "value", "timestamps are ISO 8601, UTC"),
    Ignored(
        "--tls-min-version",
        "value",
        "grpc serves TLS 1.2 and 1.3 and takes no minimum from Python",
    ),
    Ignored("--tls-cipher-suites", "value", "grpc's default cipher suites are served"),
)
"""Flags every original service takes; each service's table starts with these."""


def add_ignored_flags(parser: argparse.ArgumentParser, table: Sequence[Ignored]) -> None:
    """The table's flags, in a help group of their own, each defaulting to "not given"."""
    group = parser.add_argument_group("accepted for compatibility, and ignored")
    types: dict[str, Callable[[str], Any]] = {"bool": go_bool, "duration": duration, "value": str}
    for entry in table:
        extra: dict[str, Any] = {"nargs": "?", "const": True} if entry.kind == "bool" else {}
        group.add_argument(
            entry.flag,
            type=types[entry.kind],
            default=None,
            metavar=entry.kind.upper() if entry.kind != "value" else "VALUE",
            help=f"ignored: {entry.why}",
            **extra,
        )


def ignored_warnings(args: argparse.Namespace, table: Sequence[Ignored]) -> list[str]:
    """One line per ignored flag whose value asks for something Switchyard does not do."""
    warnings = []
    for entry in table:
        value = getattr(args, entry.flag.lstrip("-").replace("-", "_"))
        if value is None or (entry.quiet is not None and value == entry.quiet):
            continue
        shown = str(value).lower() if entry.kind == "bool" else value
        warnings.append(f"{entry.flag}={shown}: ignored: {entry.why}")
    return warnings


# --- the serving flags -----------------------------------------------------------------------


def add_serving_flags(parser: argparse.ArgumentParser, defaults: Ports) -> None:
    """The ports and host, ``--workers``, the shutdown, the body cap, TLS, gRPC limits and
    logging; ``defaults`` gives the host and ports."""
    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--host", default=defaults.host, help="address to listen on (default %(default)s)"
    )
    serving.add_argument(
        "--grpc-port",
        type=port,
        default=defaults.grpc,
        help="ext_proc gRPC port Envoy calls (default %(default)s; 0: any free port)",
    )
    serving.add_argument(
        "--grpc-health-port",
        type=port,
        default=defaults.health,
        help="gRPC health service port (plaintext, for kubelet's probes); SERVING once the "
        "service is ready (default %(default)s)",
    )
    serving.add_argument(
        "--metrics-port",
        type=port,
        default=defaults.metrics,
        help="HTTP port serving Prometheus /metrics (default %(default)s)",
    )
    add_bool(
        serving,
        "--metrics-endpoint-auth",
        False,
        "answer the metrics port (/metrics, debug pages) only to a caller whose bearer token "
        "the Kubernetes API authenticates (TokenReview) and authorizes for the path "
        "(SubjectAccessReview), as the llm-d router does (default false here: it needs the "
        "API; the manifests turn it on)",
    )
    serving.add_argument(
        "--kubeconfig",
        help="kubeconfig file for the Kubernetes API (the pods, the Lease, and the reviews "
        "--metrics-endpoint-auth asks for; default: $KUBECONFIG, else the in-cluster service "
        "account, from KUBERNETES_SERVICE_HOST/PORT and the mounted token)",
    )
    add_bool(
        serving,
        "--enable-debug-pages",
        False,
        "serve /debug/* beside /metrics: /debug/runtime and, in LWEPP with --config, "
        "/debug/decisions and /debug/attributes, which show recent routing decisions and "
        "the endpoints' measurements to whoever reaches the port (default false)",
    )
    add_bool(
        serving,
        "--health-checking",
        False,
        "also answer the gRPC health service on the ext_proc port (GIE's flag; default false)",
    )
    serving.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="serve from N processes on the same ext_proc and health ports (SO_REUSEPORT "
        "spreads Envoy's connections over them, one core each); /metrics on --metrics-port "
        "sums them; each keeps its own state (default 1)",
    )
    serving.add_argument(
        "--drain-timeout",
        type=duration,
        default=0.0,
        metavar="DURATION",
        help="after SIGTERM, keep accepting streams this long with readiness NOT_SERVING, so "
        "load balancers take the replica out first (the llm-d router's flag, whose default is "
        "30s; default here 0: stop accepting at once)",
    )
    serving.add_argument(
        "--grace",
        type=duration,
        default=10.0,
        metavar="DURATION",
        help="seconds in-flight streams get to finish once new ones are refused "
        "(default %(default)s)",
    )
    serving.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body held while waiting for its end, larger is answered 413 "
        "(default %(default)s, 10 MiB)",
    )
    serving.add_argument(
        "--grpc-max-recv-msg-size",
        type=byte_size,
        metavar="SIZE",
        help="largest ext_proc message accepted from Envoy (e.g. 10MiB; default gRPC's 4 MiB)",
    )
    serving.add_argument(
        "--grpc-max-send-msg-size",
        type=byte_size,
        metavar="SIZE",
        help="largest ext_proc message sent to Envoy (default: unlimited)",
    )
    serving.add_argument(
        "--trace-messages",
        metavar="FILE",
        help="append every ext_proc message, both ways, to FILE in protobuf text format "
        "(for learning and debugging; slow)",
    )

    tls = parser.add_argument_group("TLS on the ext_proc port (as GIE's lwepp, the llm-d router)")
    add_bool(
        tls,
        "--secure-serving",
        True,
        "serve the ext_proc port over TLS (default true): with --cert-path's pair, else a "
        "self-signed certificate made at start; --secure-serving=false serves plaintext",
    )
    tls.add_argument(
        "--cert-path",
        metavar="DIR",
        help="directory holding tls.crt and tls.key (a mounted kubernetes.io/tls Secret)",
    )
    add_bool(
        tls,
        "--enable-cert-reload",
        False,
        "serve a changed tls.crt/tls.key to new connections without a restart (default false)",
    )

    logs = parser.add_argument_group("logging (JSON lines on stderr)")
    logs.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help="lowest level logged; each request logs at debug only (default info, or as -v "
        "and --zap-log-level say)",
    )
    logs.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=int,
        default=None,
        metavar="N",
        help="the originals' verbosity: 4 or more logs at debug, as their DEBUG level",
    )
    logs.add_argument(
        "--zap-log-level",
        metavar="LEVEL",
        help="debug, info or error, or a verbosity number (as -v)",
    )
    logs.add_argument(
        "--zap-encoder",
        choices=ENCODERS,
        default="json",
        help="json (default): one JSON object per line; console: for people",
    )


DEBUG_VERBOSITY: Final = 4
"""The originals' ``logutil.DEBUG``: ``-v 4`` and above log debug lines."""


def log_level(args: argparse.Namespace) -> str:
    """``--log-level``, else what ``--zap-log-level`` or ``-v`` asks for, else info."""
    if args.log_level is not None:
        return str(args.log_level)
    zap = args.zap_log_level
    if zap is not None:
        if zap.isdigit():
            return "debug" if int(zap) >= DEBUG_VERBOSITY else "info"
        return {"debug": "debug", "info": "info", "warn": "warning", "error": "error"}.get(
            zap.lower(),
            "error",  # dpanic, panic, fatal: only errors
        )
    if args.verbosity is not None and args.verbosity >= DEBUG_VERBOSITY:
        return "debug"
    return "info"


def serving_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the serving flags' values, naming the flag; None if nothing."""
    fixed = [
        number for number in (args.grpc_port, args.grpc_health_port, args.metrics_port) if number
    ]
    if len(set(fixed)) < len(fixed):
        return "--grpc-port, --grpc-health-port and --metrics-port must differ"
    if args.max_body_bytes < 1:
        return "argument --max-body-bytes: must be at least 1"
    if args.workers < 1:
        return "argument --workers: must be at least 1"
    if args.workers > 1 and args.trace_messages:
        return "argument --workers: trace one process (--workers 1) with --trace-messages"
    if args.metrics_endpoint_auth and args.workers > 1:
        return "argument --metrics-endpoint-auth: serve one process (--workers 1) with it"
    if args.cert_path is not None and not args.secure_serving:
        return "argument --cert-path: needs --secure-serving (it is what TLS serves)"
    if args.enable_cert_reload and args.cert_path is None:
        return "argument --enable-cert-reload: needs --cert-path (a self-signed pair never changes)"
    if args.tls_min_version is not None and args.tls_min_version not in TLS_VERSIONS:
        return f"argument --tls-min-version: expected one of {', '.join(TLS_VERSIONS)}"
    return None


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """The serving flags as one value: the only reader of the flags ``add_serving_flags`` adds.

    TLS is set up here (a self-signed pair made, or ``--cert-path``'s read:
    raises ``serving.tls.TLSError``), and the metrics port's guard asks the API
    server that ``--kubeconfig`` (else ``$KUBECONFIG``, else the pod's account)
    names (raises ``pods.kubeapi.KubeconfigError``).
    """
    limits = (
        ("grpc.max_receive_message_length", args.grpc_max_recv_msg_size),
        ("grpc.max_send_message_length", args.grpc_max_send_msg_size),
    )
    tls = (
        ServerTLS.configure(args.cert_path, bool(args.enable_cert_reload))
        if args.secure_serving
        else None
    )
    kubeconfig = args.kubeconfig
    auth = MetricsAuth(load_kubeconfig(kubeconfig)) if args.metrics_endpoint_auth else None
    return ServingOptions(
        ports=Ports(args.host, args.grpc_port, args.grpc_health_port, args.metrics_port),
        workers=args.workers,
        grace=args.grace,
        drain=args.drain_timeout,
        max_body_bytes=args.max_body_bytes,
        grpc_options=tuple((name, size) for name, size in limits if size is not None),
        health_on_ext_proc=bool(args.health_checking),
        debug_pages=bool(args.enable_debug_pages),
        tls=tls,
        metrics_auth=auth,
        kubeconfig=kubeconfig,
        trace_messages=args.trace_messages,
        log_level=log_level(args),
        log_encoder=args.zap_encoder,
    )


# --- the one way to run a service ------------------------------------------------------------


def run(
    module: str,
    options: ServingOptions,
    service: Callable[[], Service],
    argv: Sequence[str] | None = None,
    warnings: Sequence[str] = (),
) -> int:
    """What every service's ``main`` ends with, once its own flags and config are checked.

    Warns once per line of ``warnings`` (the ignored flags, say), then
    serves: ``service()``, made inside the event loop, with ``options``
    (``serving.server.serve``); or, with ``--workers N``, N processes of
    ``python -m module`` with ``argv`` on the same ports, all
    serving the supervisor's TLS pair (``serving.workers``). Returns the exit
    status.
    """
    for warning in warnings:
        log.warning("flag", detail=warning)
    if options.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        return run_workers(module, flags, options.workers, options.ports, shared_tls(options.tls))

    async def serving() -> None:
        await serve(service(), options)

    asyncio.run(serving())
    return 0


def options_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServingOptions:
    """``serving_options``, after ``serving_problem``: a bad flag is the parser's one-line
    error (exit 2), a TLS pair or kubeconfig that cannot be read the service's (exit 1).
    Logging is set up as the options say before they are returned: what the service logs
    while it builds itself (its configuration's warnings, say) is in its format."""
    if problem := serving_problem(args):
        parser.error(problem)
    try:
        options = serving_options(args)
    except (TLSError, KubeconfigError) as error:
        sys.exit(f"{parser.prog.removeprefix('python -m ')}: {error}")
    configure_logging(options.log_level, options.log_encoder)
    return options
