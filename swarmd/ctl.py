"""`swarmctl`: talk to the local daemon. Data goes to stdout, messages to stderr; `--json` everywhere.

Exit statuses: 0 done; 1 the daemon refused the request (typed error, printed); 2 bad usage or a
bad input file; 4 no usable daemon (not running, not permitted). Output carries no colour, except
`logs --follow` (and `submit --follow`) on a terminal: a redrawn progress bar, coloured unless
NO_COLOR is set; piped, or with `--json`, they print one line per event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from swarmd.client import DEFAULT_TIMEOUT_S, SOCKET_ENV, Client, ControlError, DaemonUnavailable, SyncClient
from swarmd.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE
from swarmd.plot import plot_command
from swarmd.swarmkey import SwarmKeyError, generate


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--socket/--json/--timeout, accepted before or after the command name."""
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    parser.add_argument("--socket", metavar="PATH", default=default(None),
                        help=f"control socket [${SOCKET_ENV}; default: where swarmd puts it]")
    parser.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    parser.add_argument("--timeout", type=float, metavar="S", default=default(DEFAULT_TIMEOUT_S),
                        help="seconds to wait for the daemon")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmctl", description="Control the local swarmd daemon.")
    _common(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help, description=help)
        _common(cmd, suppress=True)
        return cmd

    command("status", "peer id, addresses, version, uptime, what it serves")
    command("peers", "known peers with addresses, last-seen and liveness")
    dht = command("dht", "inspect the DHT (debugging)")
    dht_sub = dht.add_subparsers(dest="dht_command", required=True, metavar="SUBCOMMAND")
    get = dht_sub.add_parser("get", help="records under a key", description="records under a key")
    _common(get, suppress=True)
    get.add_argument("key", nargs="+", metavar="PART",
                     help="key parts, namespace first (e.g. job J1 stage 3); digits are integers, hex:.. is bytes")
    command("drain", "leave the swarm gracefully and stop the daemon")
    submit = command("submit", "submit a job spec (TOML) to this daemon")
    submit.add_argument("spec", type=Path, metavar="JOB.toml")
    submit.add_argument("--data", action="append", default=[], metavar="PATH", help="local data (repeatable)")
    submit.add_argument("--follow", action="store_true", help="then follow its progress")
    submit.add_argument("--trainers", type=int, default=1, metavar="K",
                        help="trainer shards this daemon runs (0: none; others join with `train`)")
    command("jobs", "jobs known to the swarm")
    command("job", "one job: stages, peers, samples/s, step, loss").add_argument("job")
    logs = command("logs", "a job's progress events")
    logs.add_argument("job")
    logs.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    command("cancel", "cancel a job submitted here").add_argument("job")
    train = command("train", "run a trainer for a running job on local data")
    train.add_argument("job")
    train.add_argument("--data", action="append", required=True, metavar="PATH", help="local data (repeatable)")
    train.add_argument("--shard", type=int, default=0, metavar="k", help="which shard of each step's microbatches")
    train.add_argument("--shards", type=int, default=1, metavar="K", help="how many trainer shards split a step")
    train.add_argument("--eval-data", action="append", default=[], metavar="PATH",
                       help="local data of the job's [eval] files, for shard 0, which evaluates (repeatable; "
                            "default: the spec's eval.files patterns, absolute ones only)")
    serve = command("serve", "serve a stage of a job (pin by hand)")
    serve.add_argument("job")
    serve.add_argument("--stage", type=int, metavar="I")
    export = command("export", "write a job's trained model: model.safetensors and config.json")
    export.add_argument("job")
    export.add_argument("-o", "--out", type=Path, required=True, metavar="DIR",
                        help="directory for model.safetensors and config.json (created)")
    export.add_argument("--state-dir", type=Path, action="append", default=[], metavar="DIR",
                        help="also look for checkpoints of stages no live peer serves in this daemon "
                             "state dir (repeatable)")
    keygen = sub.add_parser("keygen", help="write a new swarm key file (private swarms; never overwrites)",
                            description="Write a new swarm key (32 random bytes as hex, mode 0600) for "
                                        "network.swarm_key_file; an existing file is never replaced.")
    _common(keygen, suppress=True)
    keygen.add_argument("path", type=Path, metavar="PATH")
    _plot_flags(command("plot", "PNG of a job's loss curve beside a single-process baseline of its spec"))
    return p


def _plot_flags(plot: argparse.ArgumentParser) -> None:
    """`swarmctl plot` (swarmd.plot.plot_command)."""
    plot.add_argument("job", help="job id or name (with --events: only the plot's title)")
    plot.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.png")
    plot.add_argument("--spec", type=Path, metavar="JOB.toml",
                      help="the job's spec, for the baseline (default: the one published in the DHT; relative "
                           "data paths then start at the current directory)")
    plot.add_argument("--baseline", type=Path, metavar="FILE.json",
                      help="reuse a baseline `python -m swarmd.reference --out` wrote instead of training one")
    plot.add_argument("--no-baseline", action="store_true", help="plot the swarm's curve alone")
    plot.add_argument("--events", type=Path, metavar="FILE.jsonl",
                      help="plot recorded events (`swarmctl logs JOB --json`) instead of asking the daemon")
    plot.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads for the baseline (default 1)")


# ---------------------------------------------------------------------------------------------------
# Rendering


def _emit(args: argparse.Namespace, data: Any, text: Callable[[Any], str]) -> None:
    if args.json:
        sys.stdout.write(json.dumps(_jsonable(data), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(text(data) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] * bool(days) + [f"{hours}h"] * bool(hours) + [f"{minutes}m"] * bool(minutes)
    return " ".join(parts + [f"{secs}s"]) if not days else " ".join(parts)


def _status_text(s: dict[str, Any]) -> str:
    serving = ", ".join(s["serving"]["stages"]) or "no stages"
    rows = [
        ("peer id", s["peer_id"]), ("version", s["version"]), ("pid", s["pid"]),
        ("uptime", _duration(s["uptime_s"])), ("listen", s["listen"]), ("announce", s["announce"]),
        ("socket", s["control_socket"]), ("state dir", s["state_dir"]), ("device", s["device"]),
        ("peers", f"{s['peers']['alive']} alive of {s['peers']['known']} known"),
        ("bootstrap", "joined" if s["bootstrap"]["joined"] else f"alone ({s['bootstrap']['state']})"),
        ("serving", serving), ("state", "draining" if s["draining"] else "running"),
        *_rebalance_rows(s.get("rebalance"), time.time()),
        *_supervision_rows(s.get("supervision")),
    ]
    return "\n".join(f"{name:<10} {value}" for name, value in rows)


def _supervision_rows(sup: dict[str, Any] | None) -> list[tuple[str, str]]:
    """`status` text on supervised loops that failed: each task's restarts and last error."""
    if not sup or not sup["tasks"]:
        return [] if sup is None else [("faults", "none")]
    rows = [("faults", f"{sup['failures_total']} restarts of supervised loops")]
    for t in sup["tasks"]:
        when = "restarting" if t["retry_in_s"] is not None else f"running again, failed {_duration(t['last_error_s_ago'])} ago"
        rows.append(("", f"{t['task']}: {t['restarts']} restarts ({when}): {t['last_error']}"))
    return rows


def _rebalance_rows(r: dict[str, Any] | None, now: float) -> list[tuple[str, str]]:
    """`status` text on rebalancing: on/off and period, moves since start, each job's last check,
    and the last move (from -> to, how long it took, or why it failed)."""
    if r is None:
        return []
    if not r["enabled"]:
        return [("rebalance", "off")]
    failed = f" ({r['failed_moves_total']} failed)" if r.get("failed_moves_total") else ""
    rows = [("rebalance", f"on, every {r['period_s']:g} s; {r.get('moves_total', 0)} moves{failed}")]
    for job in r["jobs"]:
        last = job["last_decision"]
        if last is None or job.get("last_check_s_ago") is None:
            check = "not checked yet"
        else:
            check = f"last check {_duration(job['last_check_s_ago'])} ago: {last['reason']}"
            check += f"; next in {_duration(max(0.0, last['next_check_in_s']))}"
        rows.append(("", f"job {job['job'][:16]} (stage {', '.join(map(str, job['stages'])) or '-'}): {check}"))
    if r["moves"]:
        m = r["moves"][-1]
        how = (f"in {m['total_s']:.1f} s ({m['drain_s']:.1f} s draining)" if not m["error"]
               else f"failed after {m['total_s']:.1f} s: {m['error']}")
        rows.append(("last move", f"job {m['job'][:16]} stage {m['source']} -> {m['target']} {how}, "
                                  f"{_duration(max(0.0, now - m['at']))} ago"))
    return rows


def _peers_text(peers: list[dict[str, Any]]) -> str:
    lines = [f"{'PEER ID':<18} {'ADDRESS':<24} {'LAST SEEN':>10}  STATE"]
    for p in peers:
        seen = "now" if p["self"] else f"{p['last_seen_s_ago']:.1f}s ago"
        state = "self" if p["self"] else ("alive" if p["alive"] else "dead")
        lines.append(f"{p['peer_id'][:16]:<18} {p['address']:<24} {seen:>10}  {state}")
    return "\n".join(lines)


def _jobs_text(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "no jobs known"
    return "\n".join(f"{j['job'][:16]}  {j['name']:<20} {j['state']:<9} step {j['step']}  "
                     f"{j['stages']} stages" for j in jobs)


def _job_text(job: dict[str, Any]) -> str:
    loss = "-" if job["loss"] is None else f"{job['loss']:.4f}"
    # Older daemons' replies carry no eval_loss; a job without [eval] has none.
    held_out = "" if job.get("eval_loss") is None else f", eval loss {job['eval_loss']:.4f} (step {job['eval_step']})"
    lines = [f"job        {job['job']} ({job['name']})", f"status     {job['status']}",
             f"step       {job['step']} / {job['steps']}, loss {loss}{held_out}, {job['samples_per_s']:.1f} samples/s"]
    for stage in job["stages"]:
        peers = ", ".join(f"{p['address']} (step {p['step']}, {p['samples_per_s']:.1f}/s, queue {p['queue']})"
                          for p in stage["peers"]) or "no peers"
        lines.append(f"stage {stage['stage']:<4} {peers}")
    # Older daemons' replies carry neither list.
    for ban in job.get("banned", ()):
        lines.append(f"banned     stage {ban['stage']} peer {ban['peer'][:16]} ({ban['addr']}): {ban['reason']}")
    for found in job.get("outliers", ()):
        peers = ", ".join(p[:16] for p in found["peers"])
        lines.append(f"outliers   stage {found['stage']} step {found['step']}: {peers}")
    return "\n".join(lines)


def _value_text(value: bytes) -> str:
    try:
        text = value.decode()
    except UnicodeDecodeError:
        return value.hex()
    return text if text.isprintable() else value.hex()


def _records_text(reply: dict[str, Any]) -> str:
    if not reply["records"]:
        return "(no live records)"
    return "\n".join(
        f"{r['subkey'].hex()[:16]}  expires in {r['expires_in_s']:.0f}s  {_value_text(r['value'])}"
        for r in reply["records"]
    )


def _key_part(text: str) -> str | int | bytes:
    if text.isdigit():
        return int(text)
    if text.startswith("hex:"):
        try:
            return bytes.fromhex(text[4:])
        except ValueError:
            raise SystemExit(_usage_error(f"key part {text!r} is not valid hex")) from None
    return text


def _usage_error(message: str) -> int:
    print(f"swarmctl: {message}", file=sys.stderr)
    return EXIT_CONFIG


def _read_spec(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise SystemExit(_usage_error(f"{path}: cannot read: {exc.strerror or exc}")) from None
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(_usage_error(f"{path}: not valid TOML: {exc}")) from None


async def _follow_logs(args: argparse.Namespace) -> None:
    live = args.follow and not args.json and sys.stdout.isatty()
    async with Client(args.socket, timeout=args.timeout) as client:
        bar = _ProgressBar(sys.stdout, (await client.job(args.job))["steps"], _colour(os.environ)) if live else None
        try:
            async for event in client.logs(args.job, follow=args.follow):
                if bar is not None:
                    bar.show(event)
                    continue
                # One line per event otherwise: `--json` gives JSON Lines, so a follower can parse
                # each event as it arrives.
                line = json.dumps(_jsonable(event), sort_keys=True) if args.json else _event_text(event)
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        finally:
            if bar is not None:
                bar.close()


def _colour(env: Mapping[str, str]) -> bool:
    """Colour unless NO_COLOR is set to anything non-empty (no-color.org) or the terminal is dumb."""
    return not env.get("NO_COLOR") and env.get("TERM", "") != "dumb"


class _ProgressBar:
    """`logs --follow` on a terminal: one redrawn line (bar, step, loss, tokens/s, peers per
    stage) at the bottom, every other event printed above it as its usual line. Colour only marks
    the bar and warnings, so with NO_COLOR nothing is lost."""

    WIDTH = 24

    def __init__(self, out: Any, steps: int, colour: bool) -> None:
        self.out, self.steps, self.colour = out, max(int(steps), 1), colour
        self.last: dict[str, Any] | None = None
        self.eval_loss: float | None = None  # the last held-out loss seen ([eval])

    def _paint(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.colour else text

    def show(self, event: dict[str, Any]) -> None:
        if event["kind"] == "step":
            self.last = event
            if event.get("eval_loss") is not None:
                self.eval_loss = event["eval_loss"]
        else:
            line = _event_text(event)
            self.out.write("\r\x1b[K" + (self._paint("33", line) if event["kind"] == "warning" else line) + "\n")
        self._draw()

    def _draw(self) -> None:
        if self.last is None:
            return
        e = self.last
        filled = min(self.WIDTH, self.WIDTH * int(e["step"]) // self.steps)
        bar = self._paint("32", "#" * filled) + "." * (self.WIDTH - filled)
        loss = "-" if e.get("loss") is None else f"{e['loss']:.4f}"
        rate = "-" if e.get("tokens_per_s") is None else f"{e['tokens_per_s']:,.0f}"
        peers = "·".join(str(n) for n in e.get("peers_per_stage") or []) or "-"
        held_out = "" if self.eval_loss is None else f"  eval {self.eval_loss:.4f}"
        self.out.write(f"\r[{bar}] step {e['step']}/{self.steps}  loss {loss}{held_out}  tokens/s {rate}  "
                       f"peers/stage {peers}\x1b[K")
        self.out.flush()

    def close(self) -> None:
        if self.last is not None:
            self.out.write("\n")
            self.out.flush()


def _event_text(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    loss = "" if event.get("loss") is None else f" loss {event['loss']:.4f}"
    rate = "" if event.get("tokens_per_s") is None else f" {event['tokens_per_s']:.0f} tokens/s"
    if event.get("eval_step") is not None:  # a step event with a held-out evaluation ([eval])
        loss += " eval given up" if event.get("eval_loss") is None else f" eval loss {event['eval_loss']:.4f}"
    return f"{when} {event['kind']:<7} step {event['step']}{loss}{rate}  {event['message']}".rstrip()


# ---------------------------------------------------------------------------------------------------
# Commands


def run_command(args: argparse.Namespace) -> None:
    client = SyncClient(args.socket, timeout=args.timeout)
    cmd = args.command
    if cmd == "status":
        _emit(args, client.status(), _status_text)
    elif cmd == "peers":
        _emit(args, client.peers(), _peers_text)
    elif cmd == "dht":
        _emit(args, client.dht_get([_key_part(p) for p in args.key]), _records_text)
    elif cmd == "drain":
        reply = client.drain()
        _emit(args, reply, lambda r: f"draining: the daemon stops within {r['drain_timeout_s']:g} s")
    elif cmd == "submit":
        reply = client.submit(_read_spec(args.spec), [str(Path(d).resolve()) for d in args.data],
                              base=str(args.spec.resolve().parent), trainers=args.trainers)
        _emit(args, reply, lambda r: f"submitted job {r['job']} ({r['name']}, {r['stages']} stages)")
        if args.follow:
            args.job = reply["job"]
            asyncio.run(_follow_logs(args))
    elif cmd == "jobs":
        _emit(args, client.jobs(), _jobs_text)
    elif cmd == "job":
        _emit(args, client.job(args.job), _job_text)
    elif cmd == "logs":
        asyncio.run(_follow_logs(args))
    elif cmd == "cancel":
        _emit(args, client.cancel(args.job), str)
    elif cmd == "train":
        _emit(args, client.train(args.job, [str(Path(d).resolve()) for d in args.data], args.shard, args.shards,
                                 [str(Path(d).resolve()) for d in args.eval_data]), str)
    elif cmd == "serve":
        _emit(args, client.serve(args.job, args.stage), str)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Connection trouble is reported once, by us, as a sentence; the transport's own log lines
    # about the same event would only repeat it on stderr.
    logging.getLogger("transport").setLevel(logging.CRITICAL)
    try:
        if args.command == "plot":
            return plot_command(args)
        if args.command == "keygen":
            return _keygen(args)
        if args.command == "export":
            return _export(args)
        run_command(args)
    except ControlError as exc:
        _error(args, exc.code, exc.message)
        return EXIT_FAILURE
    except DaemonUnavailable as exc:
        _error(args, "unavailable", str(exc))
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return EXIT_FAILURE
    return EXIT_OK


def _keygen(args: argparse.Namespace) -> int:
    """Local work only: the daemon is not asked (it may not run yet, and must not see new keys)."""
    try:
        generate(args.path)
    except SwarmKeyError as exc:
        _error(args, "exists", str(exc))
        return EXIT_CONFIG
    except OSError as exc:
        _error(args, "io", f"{args.path}: {exc.strerror or exc}")
        return EXIT_CONFIG
    _emit(args, {"path": str(args.path)},
          lambda r: f"wrote a new swarm key to {r['path']} (mode 0600); copy it to every member and set "
                    "network.swarm_key_file")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    # torch is imported only by the one command that needs it: every other command stays quick.
    from swarmd.exporter import export_command
    from swarmd.model.export import ExportError

    try:
        result = export_command(args)
    except ExportError as exc:
        _error(args, "unavailable", str(exc))
        return EXIT_FAILURE
    except OSError as exc:
        _error(args, "io", f"{args.out}: {exc.strerror or exc}")
        return EXIT_CONFIG
    _emit(args, result, lambda r: f"wrote {r['out']}: job {r['name']} at step {r['step']}, "
                                  f"{r['parameters']:,} parameters from " +
                                  ", ".join(f"stage {s['stage']} ({s['source']})" for s in r["stages"]))
    return EXIT_OK


def _error(args: argparse.Namespace, code: str, message: str) -> None:
    if args.json:
        print(json.dumps({"error": {"code": code, "message": message}}), file=sys.stderr)
    else:
        print(f"swarmctl: {message}" if code == "unavailable" else f"swarmctl: {code}: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
