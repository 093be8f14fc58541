"""Is the measured draft schedule the same from start to start? Runs ``draft_schedule.measure`` as
a server start does, once per fresh process, ``--starts`` times, and prints each start's schedule
and how long its measurement took. ``--load`` keeps one core busy (a spinning process) meanwhile;
``--module FILE`` measures with another copy of ``draft_schedule.py`` (e.g. the version before a
change), imported as part of the ``runtime`` package.

    python scripts/schedule_repro.py --engine engines/smollm2-135m-instruct --threads 2 --starts 5 [--load]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one start: load the engine as the server does, then time only the measurement
START = """
import importlib.util, sys, time
sys.path.insert(0, {root!r})
from runtime.decoding.generator import Generator
g = Generator.from_engine({engine!r}, "ort", {threads})
if {module!r}:
    spec = importlib.util.spec_from_file_location("runtime._measured_schedule", {module!r})
    schedule_module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(schedule_module)
else:
    import runtime.decoding.draft_schedule as schedule_module
begin = time.perf_counter()
schedule = schedule_module.measure(g.backend)[0]
print(schedule, f"{{time.perf_counter() - begin:.2f}}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="engines/smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--module", default="", help="a draft_schedule.py to measure with instead")
    p.add_argument("--load", action="store_true", help="keep one core busy meanwhile")
    args = p.parse_args()

    code = START.format(root=str(ROOT), engine=args.engine, threads=args.threads,
                        module=str(Path(args.module).resolve()) if args.module else "")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    schedules = []
    try:
        for start in range(1, args.starts + 1):
            done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"start {start} failed:\n{done.stderr}")
            out = done.stdout.split()
            schedules.append(out[0])
            print(f"start {start}: schedule {out[0]}  (measured in {out[1]} s)", flush=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    counts = Counter(schedules)
    print(f"{len(counts)} distinct schedule(s) in {args.starts} starts: "
          + ", ".join(f"{s} x{n}" for s, n in counts.most_common()))


if __name__ == "__main__":
    main()
