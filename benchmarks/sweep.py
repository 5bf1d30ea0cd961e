"""A sweep: the launches one benchmark makes (one per world size, sometimes a W=1 baseline too), run so that
nothing finished is lost, and the tables written from it.

    <out>/<name>.sweep.<stamp>/        this run's folder, new for every run (an earlier run's results are never
                                       touched while this one runs):
        manifest.json                  the command line, the launcher, under SLURM every job's id and W, and the
                                       reason of every launch that failed
        <key>.pkl                      each launch's results (every rank's dict and machine), written as soon as it
                                       finished, before the next one is waited for
    <out>/<name>.sweep/                the last COMPLETE run's folder: a run becomes it only once every launch
                                       finished and its tables were written

Under SLURM every launch is submitted at once (one job each: their shapes differ, so they cannot be one job array)
and all of them are polled together: a job SLURM can never start is reported (and cancelled) as soon as it is
queued, with SLURM's reason, while the others go on. A launch that fails is listed under the tables and the script
exits with an error after writing them, to <out>/<name>.incomplete.{json,md,png}: the tables of an earlier complete
run (<out>/<name>.{json,md,png}) are only ever replaced by a complete run. ``--collect FOLDER`` re-reads a manifest,
waits for the jobs still running, and writes the tables a driver that was killed mid-sweep would have written.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks import machine
from benchmarks.report import is_writer, log, write_outputs


class SweepFailed(RuntimeError):
    """Some launches of the sweep did not finish; the tables of the others were written (as .incomplete)."""


def folder_of(args: argparse.Namespace, name: str) -> Path:
    """The folder of the last complete sweep of ``name`` under --out."""
    return Path(args.out) / f"{name}.sweep"


def _new_folder(args: argparse.Namespace, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(args.out) / f"{name}.sweep.{stamp}-{os.getpid()}"
    return folder


def load_manifest(folder: Path, name: str) -> dict:
    """The manifest of the ``name`` sweep in ``folder``: a sweep folder itself, or the <out> holding sweeps (then
    the newest one, complete or not)."""
    folder = Path(folder)
    candidates = [folder / "manifest.json"]
    if not candidates[0].exists():
        candidates = sorted(folder.glob(f"{name}.sweep*/manifest.json"), key=lambda p: p.stat().st_mtime)[-1:]
    for candidate in candidates:
        if candidate.exists():
            manifest = json.loads(candidate.read_text())
            if manifest["name"] != name:
                raise SystemExit(f"--collect {folder}: that is a {manifest['name']!r} sweep, not {name!r}")
            manifest["folder"] = str(candidate.parent.resolve())  # where its results are, whatever --out says now
            return manifest
    raise SystemExit(f"--collect {folder}: no {name} sweep there (looked for manifest.json and "
                     f"{name}.sweep*/manifest.json)")


def _save(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(obj))
    tmp.replace(path)  # atomic: a driver killed while writing leaves no half file


def _unwrap(key: str, ranks: list, args: argparse.Namespace) -> list:
    """launch.run_rank returns {"result": ..., "machine": ...} per rank: keep the machines aside."""
    args.sweep_machines[key] = [r["machine"] for r in ranks]
    return [r["result"] for r in ranks]


def run(args: argparse.Namespace, name: str, target: str, launches: list[tuple[str, int, dict]]) -> dict[str, list]:
    """Run (or with --collect, gather) ``launches`` = [(key, W, payload)]; return {key: every rank's result} for
    the launches that finished. Failures are kept in ``args.sweep_failures`` for ``finish``."""
    if args.collect is None:
        folder = _new_folder(args, name)
    else:
        folder = Path(load_manifest(args.collect, name)["folder"])
    args.sweep_failures, args.sweep_machines, args.sweep_folder, args.sweep_name = [], {}, folder, name
    writer = is_writer()
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    if args.collect is None:
        manifest = {"name": name, "argv": args.argv, "launcher": args.launcher, "target": target, "jobs": {},
                    "failed": {}, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "launches": [[k, w] for k, w, _ in launches]}
        if writer:
            _write_manifest(folder, manifest)
    else:
        manifest = load_manifest(folder, name)
        manifest.setdefault("failed", {})
    args.sweep_manifest = manifest

    done: dict[str, list] = {}
    for key, _, _ in launches:
        if (folder / f"{key}.pkl").exists():
            done[key] = _unwrap(key, pickle.loads((folder / f"{key}.pkl").read_bytes()), args)
    try:
        if args.launcher == "slurm":
            return _run_slurm(args, name, target, launches, folder, manifest, done)
        return _run_here(args, target, launches, folder, manifest, done, writer)
    except KeyboardInterrupt:
        raise SystemExit(interrupted_message(args, name, folder, manifest, done)) from None


def _run_here(args, target, launches, folder: Path, manifest: dict, done: dict, writer: bool) -> dict[str, list]:
    """The local and torchrun launchers: one launch after the other, in this process."""
    from benchmarks import launch as launch_mod

    for key, w, payload in launches:
        if key in done:
            continue
        if args.collect is not None:
            why = manifest["failed"].get(key) or "not run: the driver stopped before this launch (local launcher: " \
                                                  "nothing to collect)"
            _fail(args, key, w, why)
            continue
        try:
            ranks = launch_mod.launch(args, target, w, payload)
        except Exception as exc:  # noqa: BLE001 - reported with the tables
            _fail(args, key, w, str(exc), folder if writer else None)
            continue
        if ranks is None:  # torchrun with another W
            continue
        if writer:
            _save(folder / f"{key}.pkl", ranks)
        done[key] = _unwrap(key, ranks, args)
    return done


def _run_slurm(args, name, target, launches, folder: Path, manifest: dict, done: dict) -> dict[str, list]:
    from benchmarks import launch as launch_mod
    from benchmarks import slurm_launch as S

    settings = launch_mod.rank_settings(args)
    sfolder = Path(manifest.get("slurm_folder") or args.slurm_folder or (Path(args.out) / "slurm")).resolve()
    sfolder.mkdir(parents=True, exist_ok=True)
    sizes = {key: w for key, w, _ in launches}
    jobs = {}
    if args.collect is None:
        manifest["slurm_folder"] = str(sfolder)
        for key, w, _ in launches:  # every shape is checked before anything is submitted
            S.job_shape(args, w)
        # everything at once: the queue sees the whole sweep, and no W waits for the previous one to finish
        for key, w, payload in launches:
            if key in done:
                continue
            try:
                job = S.submit(args, target, w, payload, settings, sfolder, name)
            except S.NeverRuns as exc:  # sbatch refused it: the others still run
                _fail(args, key, w, str(exc), folder)
                continue
            jobs[key] = (job, w)
            manifest["jobs"][key] = {"job_id": str(job.job_id), "world_size": w}
            _write_manifest(folder, manifest)
            log(f"submitted SLURM job {job.job_id} (W={w}: {' x '.join(map(str, S.job_shape(args, w)))} "
                f"nodes x tasks); logs in {sfolder}", quiet=args.quiet)
    else:
        for key, rec in manifest["jobs"].items():
            if key not in done and key not in manifest["failed"]:
                jobs[key] = (S.job_from_record(sfolder, rec["job_id"], rec["world_size"]), rec["world_size"])
        for key, w, _ in launches:
            if key not in done and key not in jobs:
                _fail(args, key, w, manifest["failed"].get(key) or "never submitted (the driver stopped before "
                                                                     "submitting it)")

    def on_done(key: str, ranks: list) -> None:
        _save(folder / f"{key}.pkl", ranks)
        done[key] = _unwrap(key, ranks, args)
        log(f"{name} W={sizes[key]}: SLURM job {jobs[key][0].job_id} done", quiet=args.quiet)

    def on_fail(key: str, why: str) -> None:
        _fail(args, key, sizes[key], why, folder)

    S.wait_all(jobs, settings, args.queue_timeout, args.quiet, on_done, on_fail)
    return done


def interrupted_message(args, name: str, folder: Path, manifest: dict, done: dict) -> str:
    """Ctrl-C: what keeps running, and the commands that collect or cancel it."""
    script = f"benchmarks/{_script_of(name)}"
    waiting = {k: rec for k, rec in manifest.get("jobs", {}).items() if k not in done and k not in manifest["failed"]}
    if args.launcher == "slurm" and waiting:
        ids = " ".join(rec["job_id"] for rec in waiting.values())
        listed = ", ".join(f"{rec['job_id']} (W={rec['world_size']})" for rec in waiting.values())
        return (f"interrupted. These SLURM jobs keep running: {listed}.\n"
                f"  collect their tables later:  python {script} --collect {folder}\n"
                f"  or cancel them:              scancel {ids}")
    return (f"interrupted; nothing keeps running. The launches that finished ({', '.join(done) or 'none'}) are "
            f"kept in {folder}; the previous tables in {args.out} are untouched.")


def _script_of(name: str) -> str:
    return {"gpt2": "gpt2_small.py", "train": "train_gpt.py"}.get(name, f"bench_{name}.py")


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / "manifest.tmp"
    tmp.write_text(json.dumps({k: v for k, v in manifest.items() if k != "folder"}, indent=2))
    tmp.replace(folder / "manifest.json")


def _fail(args, key: str, w: int, why: str, folder: Path | None = None) -> None:
    """A launch failed: say so now, keep the reason (in the manifest too, for --collect)."""
    args.sweep_failures.append(f"{key} (W={w}): {why}")
    log(f"FAILED {key} (W={w}): {why}" if "\n" not in why else f"FAILED {key} (W={w}): {why.splitlines()[0]}",
        quiet=False)
    manifest = getattr(args, "sweep_manifest", None)
    if folder is not None and manifest is not None and is_writer():
        manifest.setdefault("failed", {})[key] = why
        _write_manifest(folder, manifest)


def failures_note(args: argparse.Namespace) -> str:
    """Lines for under a table: the launches that did not finish (their rows are missing)."""
    fails = getattr(args, "sweep_failures", [])
    return "".join(f"- not measured, {f.splitlines()[0]}\n" for f in fails)


def machine_line(args: argparse.Namespace) -> str:
    """The machine the ranks ran on (every launch's ranks together), for the top of a table."""
    return machine.summary([m for ms in getattr(args, "sweep_machines", {}).values() for m in ms])


def finish(args: argparse.Namespace, name: str, raw: dict, markdown: str, plot: Callable[[], Any] | None,
           more_plots: dict[str, Callable[[], Any]] | None = None) -> dict:
    """Write the tables of a sweep, then raise SweepFailed if a launch failed.

    The machine the ranks ran on heads the table and goes into the JSON. A complete sweep replaces <out>/<name>.*
    and becomes <out>/<name>.sweep; an incomplete one writes <out>/<name>.incomplete.* and leaves the earlier
    complete results where they were."""
    fails = getattr(args, "sweep_failures", [])
    raw = {**raw, "machine": machine_line(args), "ranks_machines": getattr(args, "sweep_machines", {})}
    markdown = machine_line(args) + "\n\n" + markdown + failures_note(args)
    suffix = ".incomplete" if fails else ""
    paths = {}
    if is_writer():
        paths = write_outputs(args.out, name, raw, markdown, plot, quiet=args.quiet, quick=args.quick, suffix=suffix,
                              more_plots=more_plots)
        folder = Path(getattr(args, "sweep_folder", ""))
        final = folder_of(args, name)
        if not fails and folder.parent.resolve() == final.parent.resolve() and folder.name != final.name \
                and folder.exists():
            shutil.rmtree(final, ignore_errors=True)  # the previous complete sweep: this one replaces it
            folder.rename(final)
            args.sweep_folder = final
        if not fails:
            for stale in Path(args.out).glob(f"{name}*.incomplete.*"):  # an older failed run's tables
                stale.unlink()
    if fails:
        where = args.sweep_folder
        raise SweepFailed(
            f"{len(fails)} launch(es) of {name} failed; the tables of the others are in "
            f"{paths.get('md', '<out>/' + name + '.incomplete.md')} (the earlier complete results, if any, are "
            f"untouched):\n" + "\n".join(f"  {f}" for f in fails)
            + (f"\nOnce the cause is fixed, rerun; or, for jobs still queued or running, "
               f"`python benchmarks/{_script_of(name)} --collect {where}` writes the tables when they finish "
               f"(it keeps these reasons)." if args.launcher == "slurm" else ""))
    return raw
