"""What every `rtserve bench` module shares: its flag parser, a progress line on stderr while it runs, a summary table
with units on stdout, `--output FILE.json` (the raw figures, with the machine and the commit they came from) and
`--plot [FILE.png]` (matplotlib, headless).

A benchmark builds its figures as plain data (`Column`s and rows for the table, `Panel`s for the plot); this module
alone formats, writes and draws them, so every benchmark reads and files the same way.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the instruction sets the kernels dispatch on (kernels.packed_isa) and llama.cpp's integer dot products use
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8")

CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def parser(name: str, description: str | None, **kwargs) -> argparse.ArgumentParser:
    """`rtserve bench NAME`'s parser: a bad flag is one line with exit code 2 (as `rtserve serve`), and every benchmark
    has --output and --plot."""
    from gateway.cli import ArgumentParser   # argparse with a one-line error; gateway.cli imports nothing heavy

    ap = ArgumentParser(prog=f"rtserve bench {name}", description=description, **kwargs)
    ap.add_argument("--output", metavar="FILE.json", type=Path, default=None,
                    help="write the raw figures, the summary and the machine (CPU flags, commit) as JSON")
    ap.add_argument("--plot", metavar="FILE.png", nargs="?", const="", default=None,
                    help="draw the figures as a PNG (without FILE: next to --output, else bench-NAME.png)")
    ap.set_defaults(bench_name=name)
    return ap


def int_list(lo: int, hi: int, what: str):
    """An argparse type: comma-separated integers, each in lo..hi (`what` names them in the error); "" is []."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(not lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"{what} must lie in {lo}..{hi}, got {text!r}")
        return values
    return parse


def plot_path(args: argparse.Namespace) -> Path | None:
    if args.plot is None:
        return None
    if args.plot:
        return Path(args.plot)
    return args.output.with_suffix(".png") if args.output else Path(f"bench-{args.bench_name}.png")


class Progress:
    """One status line on stderr while a benchmark runs: rewritten in place on a terminal; elsewhere (a log, CI, a
    test's pipe) a new line at most every `every_s` seconds, so the log shows it is alive without flooding."""

    def __init__(self, label: str, total: int | None = None, every_s: float = 5.0, stream=None) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.done = 0
        self.shown = ""   # the last state written, so close() does not repeat it

    def advance(self, note: str = "") -> None:
        """One more unit of work done (a request, a turn, a round)."""
        self.done += 1
        self.update(self.done, note)

    def update(self, done: int | None = None, note: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not (force or self.tty or now - self.last >= self.every_s):
            return
        self.last = now
        count = "" if done is None else f" {done}/{self.total}" if self.total is not None else f" {done}"
        state = f"{self.label}:{count}{' ' + note if note else ''}"
        if force and state == self.shown and not self.tty:
            return
        self.shown = state
        line = f"{state} [{now - self.start:.0f} s]"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, note: str = "") -> None:
        self.update(self.total if self.total is not None else self.done or None, note, force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def wait_until_ready(proc: subprocess.Popen, port: int, label: str, timeout_s: float, why) -> None:
    """Poll a started `rtserve serve` on `port` until /health answers 200, with a progress line (`label`) showing its
    loading stage. Raises RuntimeError if the process exits first (with `why()`: the tail of its log) or the timeout
    passes (the process is left to the caller)."""
    import httpx

    progress = Progress(label)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {why()}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if r.status_code == 200:
                progress.close("ready")
                return
            progress.update(note=f"({r.json().get('stage') or 'loading'})")
        except (httpx.HTTPError, ValueError, AttributeError):
            progress.update()
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def proc_stat(path: str | Path) -> tuple[str, float]:
    """A /proc `stat` file (a process's or one of its tasks'): its command name and the CPU seconds (user + system)
    it has used. Raises OSError when it is gone."""
    text = Path(path).read_text()
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    return head[head.index("(") + 1:], (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def stage(message: str) -> None:
    """A one-off line on stderr (what is starting, what is loaded), next to the progress lines."""
    print(message, file=sys.stderr, flush=True)


@dataclass(slots=True)
class Column:
    header: str
    unit: str = ""
    digits: int = 1   # for floats; ints and strings print as they are

    def title(self) -> str:
        return f"{self.header} ({self.unit})" if self.unit else self.header

    def cell(self, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        if isinstance(value, float):
            return f"{value:.{self.digits}f}"
        return str(value)


def table(columns: list[Column], rows: list[list]) -> str:
    """A Markdown table (pastes into docs/benchmarks.md as it is): units in the headers, numbers right-aligned."""
    lines = ["| " + " | ".join(c.title() for c in columns) + " |",
             "|" + "|".join("---:" if c.unit else "---" for c in columns) + "|"]
    lines += ["| " + " | ".join(c.cell(v) for c, v in zip(columns, row)) + " |" for row in rows]
    return "\n".join(lines)


def print_table(columns: list[Column], rows: list[list], title: str | None = None) -> None:
    print(f"\n{title}\n" if title else "")
    print(table(columns, rows), flush=True)


def percentiles(values, qs=(50, 95, 99)) -> dict:
    """{"p50": .., "p95": .., "p99": .., "mean": ..} of `values` (linear interpolation); NaN when there are none."""
    import numpy as np

    if len(values) == 0:
        return {**{f"p{q}": math.nan for q in qs}, "mean": math.nan}
    arr = np.asarray(values, dtype=float)
    return {**{f"p{q}": float(np.percentile(arr, q)) for q in qs}, "mean": float(arr.mean())}


def machine() -> dict:
    """Where the figures came from: CPU model and the flags that pick kernels, cores, the checkout's commit."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": _version("torch"),
            "commit": commit()}


def commit() -> str | None:
    """The checkout's commit, with "-dirty" when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_json(path: Path, args: argparse.Namespace, results: dict) -> None:
    """`results` with the run's flags, time and machine around it. NaN (a percentile of nothing) is written as null."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc = {"benchmark": args.bench_name, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "config": config, **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nan_to_none(doc), indent=1) + "\n")
    stage(f"wrote {path}")


def _nan_to_none(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x


@dataclass(slots=True)
class Panel:
    """One plot. kind "line": series = {label: (xs, ys)}; "cdf": {label: values} (drawn as the share of values at or
    below x); "bars": {group: {label: value}} (grouped bars, one colour per label)."""
    title: str
    kind: str
    series: dict
    xlabel: str = ""
    ylabel: str = ""
    logx: bool = False
    notes: list[str] = field(default_factory=list)


def save_plot(path: Path, panels: list[Panel], title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'rtserve[bench]'") from None
    matplotlib.use("Agg")   # no display: a server or CI machine
    from matplotlib import pyplot as plt

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    stage(f"wrote {path}")


def _draw(ax, panel: Panel) -> None:
    import numpy as np
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    if panel.kind == "line":
        for label, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, marker="o", label=label)
        xs = sorted({x for xs, _ in panel.series.values() for x in xs})
        if panel.logx:
            ax.set_xscale("log", base=2)
        if len(xs) <= 12:   # levels, turns: label each one, not the axis' fractions
            ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylim(bottom=0)
    elif panel.kind == "cdf":
        every = []
        for label, values in panel.series.items():
            values = np.sort(np.asarray([v for v in values if v is not None], dtype=float))
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
                every += [values[0], values[-1]]
        if panel.logx and every and min(every) > 0 and max(every) / min(every) >= 10:   # else no decade to label
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.02)
    elif panel.kind == "bars":
        groups = list(panel.series)
        labels = list(dict.fromkeys(label for g in groups for label, v in panel.series[g].items() if v is not None))
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            ys = [panel.series[g].get(label, 0) or 0 for g in groups]
            ax.bar(np.arange(len(groups)) + (i - (len(labels) - 1) / 2) * width, ys, width, label=label)
        ax.set_xticks(np.arange(len(groups)), groups, fontsize=7)
    else:
        raise ValueError(f"unknown panel kind {panel.kind!r}")
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(panel.xlabel, fontsize=8)
    ax.set_ylabel(panel.ylabel or ("share of samples ≤ x" if panel.kind == "cdf" else ""), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if len(panel.series) > 1 or panel.kind == "bars":
        ax.legend(fontsize=7)
