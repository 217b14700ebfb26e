"""Protocol configuration: one dataclass, the same flags on `hopnet launch` and `hopnet simulate`.

The launcher passes the configuration to its workers as JSON in ``HOPNET_CONFIG``; code
that embeds hopnet builds a :class:`ProtocolConfig` directly or passes keywords to
:func:`hopnet.init`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from hopnet.errors import ConfigError
from hopnet.slowdown import Slowdown, parse_slowdown

PROTOCOLS = ("hop", "notify-ack", "allreduce", "eager-sgd", "pipe-sgd", "ad-psgd", "prague", "partial-reduce")
GRADIENT_PROTOCOLS = ("allreduce", "eager-sgd", "pipe-sgd")
"""Protocols that average gradients (they need the flat gradient buffer)."""
GRAPH_FREE_PROTOCOLS = ("allreduce", "eager-sgd", "pipe-sgd")
"""Protocols that ignore the communication graph (they reduce among all ranks)."""
MODEL_AVERAGING_PROTOCOLS = ("ad-psgd", "prague", "partial-reduce")
"""Protocols that average models (not Hop: they take no Hop options)."""
GROUP_PROTOCOLS = ("prague", "partial-reduce")
"""Protocols that average models within groups a coordinator (or a static schedule) forms."""
DEFAULT_MAX_IG = 2
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_PEER_TIMEOUT_S = 5.0
BULK_PLANES = ("zmq", "torch", "auto")
EAGER_MODES = ("solo", "majority")
DEFAULT_PIPELINE_K = 2
COMPRESSIONS = ("none", "trunc16", "int8")
GROUP_GENERATORS = ("random", "smart", "static")
DEFAULT_GROUP_SIZE = 3
DEFAULT_SLOW_FILTER = 4
GROUP_WEIGHTS = ("const", "dynamic")
DEFAULT_EMA_DECAY = 0.9
MISSING_LEVEL_POLICIES = ("oldest", "nearest", "renormalize")


def parse_backup_workers(text: str | int | dict[int, int] | None) -> int | dict[int, int]:
    """``N`` (every rank) or ``R:N,R:N`` (per rank; unnamed ranks get 0)."""
    if text is None:
        return 0
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"--backup-workers must be >= 0 (got {text})")
        return text
    if isinstance(text, dict):
        return {int(k): int(v) for k, v in text.items()}
    text = text.strip()
    if ":" not in text:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"--backup-workers {text!r}: expected N or R:N,R:N") from None
        if value < 0:
            raise ConfigError(f"--backup-workers must be >= 0 (got {value})")
        return value
    result: dict[int, int] = {}
    for item in text.split(","):
        try:
            rank_text, count_text = item.split(":")
            rank, count = int(rank_text), int(count_text)
        except ValueError:
            raise ConfigError(f"--backup-workers {text!r}: expected N or R:N,R:N") from None
        if rank < 0 or count < 0:
            raise ConfigError(f"--backup-workers {text!r}: ranks and counts must be >= 0")
        if rank in result:
            raise ConfigError(f"--backup-workers {text!r}: rank {rank} given twice")
        result[rank] = count
    return result


@dataclass
class ProtocolConfig:
    """Everything that selects and tunes a protocol. Field names match the long flags."""

    protocol: str = "hop"
    max_ig: int = DEFAULT_MAX_IG
    token_queues: bool = True
    serial: bool = False
    backup_workers: int | dict[int, int] = 0
    staleness: int | None = None
    skip_threshold: int | None = None
    max_jump: int | None = None
    slowdown: list[str] = field(default_factory=list)
    seed: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    bulk: str = "auto"
    eager_mode: str = "solo"
    full_sync_every: int | None = None
    pipeline_k: int = DEFAULT_PIPELINE_K
    compress: str = "none"
    group_generator: str = "smart"
    group_size: int = DEFAULT_GROUP_SIZE
    group_buffer: bool = True
    global_division: bool = True
    inter_intra: bool = True
    slow_filter: int = DEFAULT_SLOW_FILTER
    weights: str = "const"
    ema_decay: float = DEFAULT_EMA_DECAY
    missing_policy: str = "oldest"
    frozen_window: int | None = None

    def __post_init__(self) -> None:
        self.backup_workers = parse_backup_workers(self.backup_workers)
        self.validate()

    def validate(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {self.protocol!r} (choose from {', '.join(PROTOCOLS)})")
        if self.protocol in GRAPH_FREE_PROTOCOLS + MODEL_AVERAGING_PROTOCOLS:
            hop_only = self.hop_options_set()
            if hop_only:
                raise ConfigError(f"{', '.join(hop_only)}: Hop option(s) that --protocol {self.protocol} does not take")
        if not isinstance(self.max_ig, int) or self.max_ig < 1:
            raise ConfigError(f"--max-ig must be an integer >= 1 (got {self.max_ig!r})")
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0 (got {self.staleness})")
        if self.skip_threshold is not None and self.skip_threshold < 1:
            raise ConfigError(f"--skip-threshold must be >= 1 (got {self.skip_threshold})")
        if self.max_jump is not None and self.max_jump < 1:
            raise ConfigError(f"--max-jump must be >= 1 (got {self.max_jump})")
        if (self.max_jump is None) != (self.skip_threshold is None):
            raise ConfigError("--skip-threshold and --max-jump go together")
        if self.skip_threshold is not None and not self.token_queues:
            raise ConfigError("iteration skipping needs token queues (it reads them to spot a straggler)")
        if self.has_backup_workers and not self.token_queues:
            raise ConfigError("backup workers need token queues: without them the iteration gap is unbounded")
        if self.bulk not in BULK_PLANES:
            raise ConfigError(f"--bulk {self.bulk!r}: choose from {', '.join(BULK_PLANES)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 (got {self.timeout_s})")
        if (isinstance(self.peer_timeout_s, bool) or not isinstance(self.peer_timeout_s, (int, float))
                or not math.isfinite(self.peer_timeout_s) or self.peer_timeout_s <= 0):
            raise ConfigError(f"--peer-timeout must be a positive number of seconds (got {self.peer_timeout_s!r})")
        if self.protocol == "notify-ack" and (self.has_backup_workers or self.staleness is not None
                                              or self.skip_threshold is not None):
            raise ConfigError("notify-ack is a baseline: it takes no backup workers, staleness or skipping")
        for spec in self.slowdown:
            parse_slowdown(spec)
        self._validate_eager()
        self._validate_pipe_sgd()
        self._validate_groups()

    def _validate_groups(self) -> None:
        if self.group_generator not in GROUP_GENERATORS:
            raise ConfigError(f"--group-generator must be one of {', '.join(GROUP_GENERATORS)} "
                              f"(got {self.group_generator!r})")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ConfigError(f"--group-size must be an integer >= 2 (got {self.group_size!r})")
        if isinstance(self.slow_filter, bool) or not isinstance(self.slow_filter, int) or self.slow_filter < 0:
            raise ConfigError(f"--slow-filter must be an integer >= 0, 0 turning it off (got {self.slow_filter!r})")
        if self.weights not in GROUP_WEIGHTS:
            raise ConfigError(f"--weights must be one of {', '.join(GROUP_WEIGHTS)} (got {self.weights!r})")
        if (isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float))
                or not 0 <= self.ema_decay < 1):
            raise ConfigError(f"--ema-decay must be in [0, 1) (got {self.ema_decay!r})")
        if self.missing_policy not in MISSING_LEVEL_POLICIES:
            raise ConfigError(f"--missing-policy must be one of {', '.join(MISSING_LEVEL_POLICIES)} "
                              f"(got {self.missing_policy!r})")
        if self.frozen_window is not None and (isinstance(self.frozen_window, bool)
                                               or not isinstance(self.frozen_window, int) or self.frozen_window < 0):
            raise ConfigError(f"--frozen-window must be an integer >= 0, 0 turning the filter off "
                              f"(got {self.frozen_window!r})")
        prague_flags = [flag for flag, set_ in (
            ("--group-generator", self.group_generator != "smart"),
            ("--no-group-buffer", not self.group_buffer),
            ("--no-global-division", not self.global_division),
            ("--no-inter-intra", not self.inter_intra),
            ("--slow-filter", self.slow_filter != DEFAULT_SLOW_FILTER)) if set_]
        partial_flags = [flag for flag, set_ in (
            ("--weights", self.weights != "const"),
            ("--ema-decay", self.ema_decay != DEFAULT_EMA_DECAY),
            ("--missing-policy", self.missing_policy != "oldest"),
            ("--frozen-window", self.frozen_window is not None)) if set_]
        group_flags = ["--group-size"] if self.group_size != DEFAULT_GROUP_SIZE else []
        misplaced = (prague_flags if self.protocol != "prague" else []) + \
                    (partial_flags if self.protocol != "partial-reduce" else []) + \
                    (group_flags if self.protocol not in GROUP_PROTOCOLS else [])
        if misplaced:
            raise ConfigError(f"{', '.join(misplaced)}: group option(s) that --protocol {self.protocol} "
                              "does not take")

    def _validate_eager(self) -> None:
        if self.eager_mode not in EAGER_MODES:
            raise ConfigError(f"--eager-mode must be one of {', '.join(EAGER_MODES)} (got {self.eager_mode!r})")
        if self.full_sync_every is not None and (isinstance(self.full_sync_every, bool)
                                                 or not isinstance(self.full_sync_every, int)
                                                 or self.full_sync_every < 1):
            raise ConfigError(f"--full-sync-every must be an integer >= 1 (got {self.full_sync_every!r})")
        if self.protocol != "eager-sgd":
            flags = (["--eager-mode"] if self.eager_mode != "solo" else []) + \
                    (["--full-sync-every"] if self.full_sync_every is not None else [])
            if flags:
                raise ConfigError(f"{', '.join(flags)}: eager-SGD option(s) that --protocol {self.protocol} "
                                  "does not take")

    def _validate_pipe_sgd(self) -> None:
        if isinstance(self.pipeline_k, bool) or not isinstance(self.pipeline_k, int) or self.pipeline_k < 1:
            raise ConfigError(f"--pipeline-k must be an integer >= 1 (got {self.pipeline_k!r})")
        if self.compress not in COMPRESSIONS:
            raise ConfigError(f"unknown --compress {self.compress!r} (choose from {', '.join(COMPRESSIONS)})")
        if self.protocol != "pipe-sgd":
            flags = [flag for flag, set_ in (("--pipeline-k", self.pipeline_k != DEFAULT_PIPELINE_K),
                                             ("--compress", self.compress != "none")) if set_]
            if flags:
                raise ConfigError(f"{', '.join(flags)}: Pipe-SGD option(s) that --protocol {self.protocol} "
                                  "does not take")

    def hop_options_set(self) -> list[str]:
        """The Hop-only flags this configuration sets away from their defaults."""
        flags = []
        if self.max_ig != DEFAULT_MAX_IG:
            flags.append("--max-ig")
        if not self.token_queues:
            flags.append("--no-token-queues")
        if self.serial:
            flags.append("--serial")
        if self.has_backup_workers:
            flags.append("--backup-workers")
        if self.staleness is not None:
            flags.append("--staleness")
        if self.skip_threshold is not None:
            flags.append("--skip-threshold")
        if self.max_jump is not None:
            flags.append("--max-jump")
        return flags

    def validate_ranks(self, world_size: int) -> None:
        """Check the options that name ranks (slowdowns, per-rank backup workers) against the run."""
        self.make_slowdown().validate_ranks(world_size)
        if isinstance(self.backup_workers, dict):
            bad = sorted(r for r in self.backup_workers if r >= world_size)
            if bad:
                raise ConfigError(f"--backup-workers: rank {bad[0]} out of range (there are {world_size} workers)")

    @property
    def has_backup_workers(self) -> bool:
        bw = self.backup_workers
        return any(v > 0 for v in bw.values()) if isinstance(bw, dict) else bw > 0

    def backup_workers_for(self, rank: int) -> int:
        bw = self.backup_workers
        return bw.get(rank, 0) if isinstance(bw, dict) else bw

    def make_slowdown(self) -> Slowdown:
        return Slowdown.from_specs(self.slowdown, seed=self.seed)

    def to_json(self) -> str:
        data = asdict(self)
        if isinstance(self.backup_workers, dict):
            data["backup_workers"] = {str(k): v for k, v in self.backup_workers.items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProtocolConfig:
        data = json.loads(text)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProtocolConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown protocol option {unknown[0]!r}")
        return cls(**data)

    def replace(self, **changes: Any) -> ProtocolConfig:
        return replace(self, **changes)


def _positive_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """The protocol flags shared by `hopnet launch` and `hopnet simulate`."""
    group = parser.add_argument_group("protocol")
    group.add_argument("--protocol", default="hop", choices=PROTOCOLS,
                       help="training protocol (default: hop). allreduce is synchronous all-reduce of the "
                            "gradients among all ranks (what torch DDP does): the graph plays no part in it, "
                            "and it takes none of the Hop options below. eager-sgd is eager-SGD's partial "
                            "all-reduce (see --eager-mode); pipe-sgd is Pipe-SGD: the same all-reduce, "
                            "pipelined K deep behind the compute (--pipeline-k, --compress); ad-psgd is "
                            "asynchronous pairwise model "
                            "averaging (AD-PSGD) on a bipartite graph: active workers average with one random "
                            "passive neighbour per iteration; prague averages models in groups a Group "
                            "Generator forms (--group-generator); partial-reduce averages models in groups of the "
                            "first --group-size ready workers a controller forms (--weights). None of these "
                            "model-averaging protocols takes the Hop options")
    group.add_argument("--max-ig", type=_positive_int, default=DEFAULT_MAX_IG, metavar="N",
                       help=f"maximum iteration gap between neighbours, via token queues (default: {DEFAULT_MAX_IG})")
    group.add_argument("--no-token-queues", dest="token_queues", action="store_false",
                       help="turn token queues off (the gap is then bounded by path lengths only)")
    group.add_argument("--serial", action="store_true",
                       help="serial approach: compute, apply, send, then reduce (default: parallel)")
    group.add_argument("--backup-workers", default="0", metavar="N|R:N,...",
                       help="updates a worker may go without per iteration: one number or per rank")
    group.add_argument("--staleness", type=_positive_int, default=None, metavar="S",
                       help="bounded staleness: use neighbours' newest update if no older than k-S")
    group.add_argument("--skip-threshold", type=_positive_int, default=None, metavar="T",
                       help="skip iterations when more than T behind every out-neighbour")
    group.add_argument("--max-jump", type=_positive_int, default=None, metavar="J",
                       help="at most J iterations per skip")
    group.add_argument("--eager-mode", default="solo", choices=EAGER_MODES,
                       help="eager-sgd: solo (whoever arrives first starts the round; never waits for another's "
                            "compute) or majority (a seeded random rank starts each round; earlier arrivals wait "
                            "for it). Default: solo")
    group.add_argument("--full-sync-every", type=_positive_int, default=None, metavar="N",
                       help="eager-sgd: average the models with a blocking all-reduce every N iterations")
    group.add_argument("--slowdown", action="append", default=[], metavar="SPEC",
                       help="random:FACTOR:PROB or rank=R:FACTOR (repeatable)")
    group.add_argument("--seed", type=int, default=0, help="seed for slowdowns and sampling (default: 0)")
    group.add_argument("--timeout", dest="timeout_s", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                       help=f"fail a wait after this long, naming what it waited for (default: {DEFAULT_TIMEOUT_S:g})")
    group.add_argument("--peer-timeout", dest="peer_timeout_s", type=float, default=DEFAULT_PEER_TIMEOUT_S,
                       metavar="SECONDS",
                       help="declare a neighbour dead when nothing was heard from it for this long "
                            f"(default: {DEFAULT_PEER_TIMEOUT_S:g})")
    group.add_argument("--bulk", default="auto", choices=BULK_PLANES,
                       help="what carries update tensors: zmq, torch (gloo on CPU, NCCL on CUDA) or auto "
                            "(torch for CUDA tensors, the faster one for CPU; default: auto)")
    group.add_argument("--pipeline-k", type=_positive_int, default=DEFAULT_PIPELINE_K, metavar="K",
                       help="pipe-sgd: each step applies the averaged gradient of K-1 iterations earlier while "
                            "the newer all-reduces run behind the compute (Algorithm 1's g[t-K]); "
                            f"1 is synchronous (default: {DEFAULT_PIPELINE_K})")
    group.add_argument("--compress", default="none", choices=COMPRESSIONS,
                       help="pipe-sgd: compress every hop of the ring: trunc16 keeps the top 16 bits of each "
                            "float32 (2x fewer bytes), int8 quantizes with scale max|block|/127 (4x) (default: none)")
    add_group_arguments(parser)


def add_group_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the group protocols (prague, partial-reduce)."""
    group = parser.add_argument_group("group protocols (prague, partial-reduce)")
    group.add_argument("--group-size", type=_positive_int, default=DEFAULT_GROUP_SIZE, metavar="N",
                       help=f"workers per group (default: {DEFAULT_GROUP_SIZE})")
    group.add_argument("--group-generator", default="smart", choices=GROUP_GENERATORS,
                       help="prague: random (a central Group Generator with a lock vector and FIFO queue), smart "
                            "(Group Buffer, Global Division, Inter-Intra and the slow-worker filter) or static "
                            "(a conflict-free schedule each worker computes alone). Default: smart")
    group.add_argument("--no-group-buffer", dest="group_buffer", action="store_false",
                       help="prague smart: switch the Group Buffer off")
    group.add_argument("--no-global-division", dest="global_division", action="store_false",
                       help="prague smart: switch Global Division off")
    group.add_argument("--no-inter-intra", dest="inter_intra", action="store_false",
                       help="prague smart: switch the Inter-Intra phases (by the graph's machine field) off")
    group.add_argument("--slow-filter", type=_positive_int, default=DEFAULT_SLOW_FILTER, metavar="C",
                       help="prague smart: leave out of a Global Division the workers C or more requests behind "
                            f"its initiator; 0 switches the filter off (default: {DEFAULT_SLOW_FILTER})")
    group.add_argument("--weights", default="const", choices=GROUP_WEIGHTS,
                       help="partial-reduce: const (1/P, keeps the mean) or dynamic (staleness-aware EMA "
                            "weights, Eq. 9). Default: const")
    group.add_argument("--ema-decay", type=float, default=DEFAULT_EMA_DECAY, metavar="ALPHA",
                       help=f"partial-reduce dynamic weights: the EMA decay (default: {DEFAULT_EMA_DECAY:g})")
    group.add_argument("--missing-policy", default="oldest", choices=MISSING_LEVEL_POLICIES,
                       help="partial-reduce dynamic weights: who gets the weight of staleness levels no member "
                            "holds (default: oldest, the paper's reading)")
    group.add_argument("--frozen-window", type=int, default=None, metavar="T",
                       help="partial-reduce: keep the sync graph of the last T groups connected (default: "
                            "derived from the world and group sizes; 0 switches group-frozen avoidance off)")


def config_from_args(args: argparse.Namespace) -> ProtocolConfig:
    return ProtocolConfig(
        protocol=args.protocol,
        max_ig=args.max_ig,
        token_queues=args.token_queues,
        serial=args.serial,
        backup_workers=args.backup_workers,
        staleness=args.staleness,
        skip_threshold=args.skip_threshold,
        max_jump=args.max_jump,
        slowdown=list(args.slowdown),
        seed=args.seed,
        timeout_s=args.timeout_s,
        peer_timeout_s=args.peer_timeout_s,
        bulk=getattr(args, "bulk", "auto"),
        eager_mode=args.eager_mode,
        full_sync_every=args.full_sync_every,
        pipeline_k=args.pipeline_k,
        compress=args.compress,
        group_generator=getattr(args, "group_generator", "smart"),
        group_size=getattr(args, "group_size", DEFAULT_GROUP_SIZE),
        group_buffer=getattr(args, "group_buffer", True),
        global_division=getattr(args, "global_division", True),
        inter_intra=getattr(args, "inter_intra", True),
        slow_filter=getattr(args, "slow_filter", DEFAULT_SLOW_FILTER),
        weights=getattr(args, "weights", "const"),
        ema_decay=getattr(args, "ema_decay", DEFAULT_EMA_DECAY),
        missing_policy=getattr(args, "missing_policy", "oldest"),
        frozen_window=getattr(args, "frozen_window", None),
    )
