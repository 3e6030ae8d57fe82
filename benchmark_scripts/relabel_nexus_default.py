"""Keep published Nexus cells true after Nexus's default moved to ``prompt_top_k=True`` (2026-12-01).

Cells stored under the label ``nexus`` ran the old default, the reservoir at the one-shot step too.
This script renames them ``nexus-reservoir`` (which pins ``prompt_top_k=False``), and, with
``--topk-is-default``, renames ``nexus-prompt-topk`` cells to ``nexus`` (that label is exactly today's
default). Then it re-keys the file's provenance: the stored ``"nexus"`` hash is replaced by one key per
Nexus label present, each pinning that label's options (``nexus[prompt_top_k=False]``, ...).

It refuses unless the stored ``"nexus"`` hash equals today's ``nexus[prompt_top_k=False]`` hash: that
equality shows the cells' code and today's code do the same thing once the option is pinned, so the
pinned keys' hashes (computed today) are the cells' own. The note in the provenance says so.

    python benchmark_scripts/relabel_nexus_default.py figures/eval/tasks/smollm2/tasks.json --topk-is-default
    python benchmark_scripts/relabel_nexus_default.py FILE --provenance-only   # re-key, cells already renamed
    python benchmark_scripts/relabel_nexus_default.py figures/eval/speed.json --whole  # a benchmark's rows
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.evaluation.provenance import key_of, method_fingerprint, method_of  # noqa: E402
from veloxquant_mlx.evaluation.labels import SUFFIXES  # noqa: E402
from veloxquant_mlx.evaluation.results import ResultStore, pinned_options  # noqa: E402

_CONFIG_SUFFIXES = [s for s in SUFFIXES if s != "-ada"]  # the suffixes the migrated labels could carry

OLD, RESERVOIR, PROMPT_TOPK = "nexus", "nexus-reservoir", "nexus-prompt-topk"


def renamed(label, topk_is_default: bool):
    """The new label, or None: ``nexus`` -> ``nexus-reservoir`` and ``nexus-4bit-g32`` ->
    ``nexus-reservoir-4bit-g32`` (config suffixes kept); ``nexus-prompt-topk[...]`` -> ``nexus[...]``."""
    if not isinstance(label, str):
        return None
    moves = {OLD: RESERVOIR, **({PROMPT_TOPK: OLD} if topk_is_default else {})}
    for old in sorted(moves, key=len, reverse=True):
        rest = label[len(old):] if label.startswith(old) else None
        while rest:
            suffix = next((x for x in _CONFIG_SUFFIXES if rest.startswith(x)), None)
            if suffix is None:
                break
            rest = rest[len(suffix):]
        if rest == "":
            return moves[old] + label[len(old):]
    return None


def rename_cells(data: dict, topk_is_default: bool) -> int:
    """Rename the labels in every cell (its id and its record); returns how many cells moved."""
    moves = {}
    cells, n = {}, 0
    for cid, rec in data.get("cells", {}).items():
        label = rec.get("method") if isinstance(rec, dict) else None
        new = renamed(label, topk_is_default)
        if new is not None:
            moves[label] = new
            cid, hits = re.subn(rf"(^|\|)method={re.escape(label)}(\||$)", rf"\g<1>method={new}\g<2>", cid)
            if hits != 1:
                raise SystemExit(f"cell id {cid!r} does not carry its method once; refusing to rename")
            rec = {**rec, "method": new, "relabelled": f"was {label!r} (before Nexus's default moved to "
                                                          "prompt_top_k=True, 2026-12-01)"}
            n += 1
        cells[cid] = rec
    if "cells" in data:
        data["cells"] = cells
    for row in data.get("rows", []):  # a list-of-rows figure (quant_lone_check.py)
        new = renamed(row.get("method"), topk_is_default)
        if new is not None:
            moves[row["method"]] = new
            row["method"], n = new, n + 1
    for stage in data.get("grid", {}).get("plan", []) or []:
        stage["methods"] = [moves.get(m, m) for m in stage.get("methods", [])]
    if "methods" in data.get("grid", {}):
        data["grid"]["methods"] = [moves.get(m, m) for m in data["grid"]["methods"]]
    return n


def _rekeyed(prov: dict, fingerprint: dict, note: str) -> dict:
    """``prov`` with the new fingerprint and ``note`` appended to its note."""
    return {**prov, "fingerprint": dict(sorted(fingerprint.items())),
            "note": (prov.get("note", "") + " | " + note).lstrip(" |")}


def rekey(prov: dict, labels: set) -> dict:
    """The provenance with the old ``nexus`` hash replaced by one pinned key per Nexus label."""
    fp = dict(prov.get("fingerprint") or {})
    old = fp.pop(OLD, None)
    pinned_reservoir = key_of(RESERVOIR, options=pinned_options(RESERVOIR))
    today = method_fingerprint(pinned_reservoir)
    if old is None:
        raise SystemExit("the provenance has no 'nexus' hash: nothing to re-key")
    if old != today:
        raise SystemExit(f"stored nexus hash {old} != today's {pinned_reservoir} {today}: the cells' code "
                         "differs beyond the default; re-run them instead")
    for label in sorted(labels):
        if method_of(label) == OLD:
            key = key_of(label, options=pinned_options(label))
            fp[key] = method_fingerprint(key)
    note = (f"re-keyed 2026-12-01 by benchmark_scripts/relabel_nexus_default.py: cells labelled 'nexus' ran "
            f"prompt_top_k=False (then the default) and are now 'nexus-reservoir'; the stored nexus hash {old} "
            f"equals today's {pinned_reservoir}, so each Nexus label's pinned key is hashed on today's code")
    return _rekeyed(prov, fp, note)


def rekey_whole(prov: dict) -> dict:
    """For a benchmark figure without per-cell labels: every stored Nexus key (``nexus``,
    ``nexus:ada``, ...) becomes its ``prompt_top_k=False`` twin, each checked equal to today's hash.
    Its rows named 'nexus' measured the reservoir default of the time; the note says so."""
    fp, moved = dict(prov.get("fingerprint") or {}), []
    for key in [k for k in fp if k.partition(":")[0] == OLD]:
        setting = key.partition(":")[2]
        twin = key_of(RESERVOIR, options=pinned_options(RESERVOIR)) + (f":{setting}" if setting else "")
        if method_fingerprint(key) == fp[key]:
            continue  # this setting did not move (e.g. nexus:stream: no one-shot step)
        if method_fingerprint(twin) != fp[key]:
            raise SystemExit(f"stored {key} hash {fp[key]} != today's {twin} {method_fingerprint(twin)}: "
                             "re-run the figure instead")
        fp[twin] = fp.pop(key)
        moved.append(f"{key} -> {twin}")
    if not moved:
        raise SystemExit("no Nexus key moved: nothing to re-key")
    note = ("re-keyed 2026-12-01 by benchmark_scripts/relabel_nexus_default.py --whole: the rows named 'nexus' "
            "ran prompt_top_k=False, the default until 2026-12-01; " + ", ".join(moved)
            + " (each stored hash equals today's hash of the pinned key)")
    return _rekeyed(prov, fp, note)


def restamp_after_resume(path: Path, rev: str) -> None:
    """The run's own stamp compared the new cells with REV's un-re-keyed provenance; compare them with
    the re-keyed one instead (``resumed`` still marks the file stale if any kept cell's code moved)."""
    import subprocess

    from veloxquant_mlx.evaluation.provenance import provenance, resumed

    old_data = json.loads(subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                                         check=True).stdout)
    rename_cells(old_data, topk_is_default=False)
    old_labels = {r["method"] for r in old_data["cells"].values() if isinstance(r, dict) and "method" in r}
    old = rekey(old_data["provenance"], old_labels)
    data = json.loads(path.read_text())
    run_command = data["provenance"]["command"]  # the eval run that added the cells
    keys = ResultStore(path, data["experiment"]).fingerprint_keys(data)  # as the run's own stamp keys them
    new = {**provenance(run_command, keys), "date": data["provenance"]["date"],
           "commit": data["provenance"]["commit"]}  # the run's own, not this script's
    data["provenance"] = {**resumed(old, new), "note": (
        f"stamped by benchmark_scripts/relabel_nexus_default.py --after-resume {rev}: the run's cells against "
        f"the re-keyed provenance of the cells it kept (measured at {old.get('commit')}); "
        + old.get("note", ""))}
    path.write_text(json.dumps(data, indent=1))
    print(f"{path}: {'STALE: ' + data['provenance']['stale_reason'] if 'stale_reason' in data['provenance'] else 'fresh'}; "
          f"keys {sorted(data['provenance']['fingerprint'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--topk-is-default", action="store_true",
                    help="also rename 'nexus-prompt-topk' cells to 'nexus' (today's default)")
    ap.add_argument("--provenance-only", action="store_true", help="cells already renamed: re-key only")
    ap.add_argument("--whole", action="store_true",
                    help="a benchmark figure without per-cell labels: its 'nexus' rows are the reservoir's; "
                         "re-key the provenance only (docs quoting it must say so)")
    ap.add_argument("--after-resume", metavar="REV",
                    help="the file was relabelled at REV's state, then a run added cells (its stamp marked it "
                         "stale): re-key REV's provenance, then stamp the file anew against it")
    args = ap.parse_args(argv)
    if args.after_resume:
        for path in args.files:
            restamp_after_resume(path, args.after_resume)
        return 0
    for path in args.files:
        data = json.loads(path.read_text())
        if args.whole:
            data["provenance"] = rekey_whole(data["provenance"])
            path.write_text(json.dumps(data, indent=1))
            print(f"{path}: re-keyed; keys {sorted(data['provenance']['fingerprint'])}")
            continue
        n = 0 if args.provenance_only else rename_cells(data, args.topk_is_default)
        rows = list(data.get("cells", {}).values()) + data.get("rows", [])
        labels = {r["method"] for r in rows if isinstance(r, dict) and "method" in r}
        data["provenance"] = rekey(data["provenance"], labels)
        path.write_text(json.dumps(data, indent=1))
        print(f"{path}: {n} cells renamed; keys {sorted(data['provenance']['fingerprint'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
