"""A sweep: the launches one benchmark makes (one per world size, sometimes a W=1 baseline too), run so that
nothing finished is lost.

    <out>/<name>.sweep/manifest.json   the command line, the launcher, and under SLURM every job's id and W
    <out>/<name>.sweep/<key>.pkl       each launch's results (every rank's dict), written as soon as it finished,
                                       before the next launch is tried or waited for

Under SLURM every launch of the sweep is submitted at once (one job each: their shapes differ, so they cannot be
one job array), then waited for in order. A launch that fails (a rank raised, it ran past --timeout) is reported and
the sweep goes on; the tables are written from what finished and the failures are raised afterwards
(``raise_failures``). ``--collect FOLDER`` re-reads the manifest, waits for the jobs still running, and rebuilds the
tables: what a driver that was killed mid-sweep would have written.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path
from typing import Any

from benchmarks import launch as launch_mod
from benchmarks.report import is_writer, log


def folder_of(args: argparse.Namespace, name: str) -> Path:
    return Path(args.out) / f"{name}.sweep"


def load_manifest(folder: Path, name: str) -> dict:
    """The manifest of the ``name`` sweep in ``folder`` (the .sweep folder itself, or the <out> holding it)."""
    folder = Path(folder)
    for candidate in (folder / "manifest.json", folder / f"{name}.sweep" / "manifest.json"):
        if candidate.exists():
            manifest = json.loads(candidate.read_text())
            if manifest["name"] != name:
                raise SystemExit(f"--collect {folder}: that is a {manifest['name']!r} sweep, not {name!r}")
            manifest["folder"] = str(candidate.parent.resolve())  # where its results are, whatever --out says now
            return manifest
    raise SystemExit(f"--collect {folder}: no {name} sweep there (looked for manifest.json and "
                     f"{name}.sweep/manifest.json)")


def _save(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(obj))
    tmp.replace(path)  # atomic: a driver killed while writing leaves no half file


def run(args: argparse.Namespace, name: str, target: str, launches: list[tuple[str, int, dict]]) -> dict[str, list]:
    """Run (or with --collect, gather) ``launches`` = [(key, W, payload)]; return {key: every rank's result} for
    the launches that finished. Failures are kept in ``args.sweep_failures`` for ``raise_failures``."""
    folder = folder_of(args, name) if args.collect is None else Path(load_manifest(args.collect, name)["folder"])
    args.sweep_failures = []
    writer = is_writer()
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / "manifest.json"
    if args.collect is None and writer:
        manifest = {"name": name, "argv": args.argv, "launcher": args.launcher, "target": target, "jobs": {},
                    "created": time.strftime("%Y-%m-%d %H:%M:%S"), "launches": [[k, w] for k, w, _ in launches]}
        for old in folder.glob("*.pkl"):  # a new sweep in the same place: earlier results are not this sweep's
            old.unlink()
        manifest_path.write_text(json.dumps(manifest, indent=2))
    elif args.collect is not None:
        manifest = load_manifest(folder, name)
    else:
        manifest = {"jobs": {}}

    done: dict[str, list] = {}
    for key, _, _ in launches:
        if (folder / f"{key}.pkl").exists():
            done[key] = pickle.loads((folder / f"{key}.pkl").read_bytes())
    if args.launcher == "slurm":
        return _run_slurm(args, name, target, launches, folder, manifest, done)

    for key, w, payload in launches:
        if key in done:
            continue
        if args.collect is not None:
            _fail(args, key, w, "not run: the driver stopped before this launch (local launcher: nothing to collect)")
            continue
        try:
            ranks = launch_mod.launch(args, target, w, payload)
        except Exception as exc:  # noqa: BLE001 - reported with the tables
            _fail(args, key, w, str(exc))
            continue
        if ranks is None:  # torchrun with another W
            continue
        done[key] = ranks
        if writer:
            _save(folder / f"{key}.pkl", ranks)
    return done


def _run_slurm(args, name, target, launches, folder: Path, manifest: dict, done: dict) -> dict[str, list]:
    from benchmarks import slurm_launch as S

    settings = launch_mod.rank_settings(args)
    sfolder = Path(manifest.get("slurm_folder") or args.slurm_folder or (Path(args.out) / "slurm")).resolve()
    sfolder.mkdir(parents=True, exist_ok=True)
    jobs = {}
    if args.collect is None:
        manifest["slurm_folder"] = str(sfolder)
        # everything at once: the queue sees the whole sweep, and no W waits for the previous one to finish
        for key, w, payload in launches:
            if key in done:
                continue
            try:
                job = S.submit(args, target, w, payload, settings, sfolder, name)
            except S.NeverRuns:
                _write_manifest(folder, manifest)
                if manifest["jobs"]:
                    log(f"jobs already submitted keep running: {manifest['jobs']}; "
                        f"`--collect {folder}` gathers them", quiet=False)
                raise
            jobs[key] = job
            manifest["jobs"][key] = {"job_id": str(job.job_id), "world_size": w}
            _write_manifest(folder, manifest)
            log(f"submitted SLURM job {job.job_id} (W={w}: {' x '.join(map(str, S.job_shape(args, w)))} "
                f"nodes x tasks); logs in {sfolder}", quiet=args.quiet)
    else:
        for key, rec in manifest["jobs"].items():
            if key not in done:
                jobs[key] = S.job_from_record(sfolder, rec["job_id"], rec["world_size"])
    for key, w, _ in launches:
        if key in done:
            continue
        if key not in jobs:
            _fail(args, key, w, "never submitted (the driver stopped before submitting it)")
            continue
        t0 = time.perf_counter()
        try:
            ranks = S.wait(jobs[key], w, settings, args.queue_timeout, args.quiet)
        except S.NeverRuns:
            raise  # at once, with SLURM's reason; earlier W's results are already on disk
        except Exception as exc:  # noqa: BLE001 - a failed rank, a timeout: reported with the tables
            _fail(args, key, w, f"SLURM job {jobs[key].job_id}: {type(exc).__name__}: {exc}")
            continue
        done[key] = ranks
        _save(folder / f"{key}.pkl", ranks)
        log(f"{name} W={w}: SLURM job {jobs[key].job_id} done ({time.perf_counter() - t0:.1f} s waited here)",
            quiet=args.quiet)
    return done


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / "manifest.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(folder / "manifest.json")


def _fail(args, key: str, w: int, why: str) -> None:
    args.sweep_failures.append(f"{key} (W={w}): {why}")
    log(f"FAILED {key} (W={w}): {why.splitlines()[0] if why else ''}", quiet=False)


def failures_note(args: argparse.Namespace) -> str:
    """Lines for under a table: the launches that did not finish (their rows are missing)."""
    fails = getattr(args, "sweep_failures", [])
    return "".join(f"- not measured, {f.splitlines()[0]}\n" for f in fails)


def raise_failures(args: argparse.Namespace) -> None:
    """After the tables are written: a sweep with failed launches still fails, with every reason."""
    fails = getattr(args, "sweep_failures", [])
    if fails:
        raise RuntimeError(f"{len(fails)} launch(es) failed; the tables hold the rest:\n" + "\n".join(fails))
