"""tests/checker_corpus/score.py RESULTS_DIR: the corpus's cases scored from what run.sh left in RESULTS_DIR
(results.tsv: id, the peer's exit status, the checker's, seconds; <n>.log: the checker's output per case).

A correct case passes when the checker passed it (exit 0). A planted mistake passes when the checker failed it
(exit 1), or passed it "by a stated limit": its PASS output has a line `power-json: {"lr": x, "weight_decay": y,
"grad_scale": z, "clip": w}` (the relative errors below which the checker cannot see a mistake of that kind;
null where it could not say) and the plant's recorded size is below the stated power for every kind the size
has (a plant with no size of these kinds, or a null power, cannot pass by a limit: that PASS is silent).
Naming is read from the failure's output alone: `named: <class id>` equal to the case's class is named
strictly; `fits: id1, id2 (...)` with the case's class among the ids is an ambiguity stated; a `named:` of
another class, or a `fits:` without the case's class, is misnamed, and a misnamed failure counts as failed.
Without any of these lines a failure is unnamed (the checker before it printed them). A case whose peer did not
run, or whose checker exited with neither 0 nor 1, is an error and fails.

Prints a table per half (its rows: the correct cases, then the mistakes by category), a summary line per half,
the cases that failed, and "N passed, M failed". Exit status 0 when none failed.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import BY_ID, CATEGORIES_ORDER, all_cases  # noqa: E402

POWER_KINDS = ("lr", "weight_decay", "grad_scale", "clip")


def read_output(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def naming(text):
    """(named id or None, [fits ids] or None) from the checker's output."""
    named = fits = None
    for line in text.splitlines():
        if line.startswith("named: ") and named is None:
            named = line[len("named: "):].strip().split()[0].rstrip(".,;:") if line[len("named: "):].strip() else ""
        elif line.startswith("fits: ") and fits is None:
            body = line[len("fits: "):].split(" (")[0]
            fits = [part.strip().rstrip(".,;:") for part in body.split(",") if part.strip()]
    return named, fits


def power(text):
    """The PASS's stated power (a dict), or None where it states none (or not as JSON)."""
    for line in text.splitlines():
        if line.startswith("power-json: "):
            try:
                value = json.loads(line[len("power-json: "):])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def within_stated_limit(size, stated):
    judged = [k for k in POWER_KINDS if k in size]
    if not judged or not stated:
        return False
    # "unbounded": the PASS states that no error of that kind, of any size, could have shown (a clipping
    # threshold where every step was clipped); null: it could not say.
    return all(stated.get(k) == "unbounded" or (isinstance(stated.get(k), (int, float)) and
                                                 not isinstance(stated.get(k), bool) and size[k] < stated[k])
               for k in judged)


def score(case, peer_status, check_status, text):
    """The case's outcome: a dict with `outcome`, `naming`, `passed` (the corpus's verdict) and `note`."""
    margin = re.search(r"^margin: the difference is (\S+) x", text, re.M)
    note = f"margin {margin.group(1)}" if margin else ""
    if peer_status is None:
        return {"outcome": "not run", "naming": "", "passed": False, "note": "no result"}
    if peer_status == 3:
        return {"outcome": "error", "naming": "", "passed": False, "note": "broken plant (generate.py plant)"}
    if peer_status != 0:
        return {"outcome": "error", "naming": "", "passed": False, "note": f"the peer exited {peer_status}"}
    if check_status not in (0, 1):
        return {"outcome": "error", "naming": "", "passed": False, "note": f"the checker exited {check_status}"}
    if case["kind"] == "correct":
        closest = re.search(r"the closest call: (step \d+, [0-9.]+) of the tolerance", text)
        return {"outcome": "passed" if check_status == 0 else "failed", "naming": "", "passed": check_status == 0,
                "note": (f"closest call {closest.group(1)}" if closest else note)}
    if check_status == 0:
        stated = power(text)
        legit = within_stated_limit(case["size"], stated)
        return {"outcome": "passed by stated limit" if legit else "passed silently", "naming": "", "passed": legit,
                "note": f"size {json.dumps(case['size'])}, stated power {json.dumps(stated)}"}
    named, fits = naming(text)
    if named == "none":  # the checker says it names nothing: unnamed, not a wrong name
        how = "unnamed"
        note += "; named: none"
    elif named is not None:
        how = "named" if named == case["cls"] else "misnamed"
        note += f"; named: {named}"
    elif fits is not None:
        how = "ambiguity" if case["cls"] in fits else "misnamed"
        note += f"; fits: {', '.join(fits)}"
    else:
        how = "unnamed"
    return {"outcome": "failed", "naming": how, "passed": how != "misnamed", "note": note.strip("; ")}


COLUMNS = ["cases", "correct passed", "correct failed", "bugs failed", "passed by stated limit", "passed silently",
           "named strictly", "ambiguity stated", "misnamed", "errors"]


def tally(rows):
    t = dict.fromkeys(COLUMNS, 0)
    for case, result in rows:
        t["cases"] += 1
        if result["outcome"] in ("error", "not run"):
            t["errors"] += 1
        elif case["kind"] == "correct":
            t["correct " + result["outcome"]] += 1
        else:
            key = {"failed": "bugs failed"}.get(result["outcome"], result["outcome"])
            t[key] += 1
            t[{"named": "named strictly", "ambiguity": "ambiguity stated", "misnamed": "misnamed"}.get(
                result["naming"], "cases")] += 0 if result["naming"] in ("", "unnamed") else 1
    return t


def table(half, rows):
    groups = [("correct", [r for r in rows if r[0]["kind"] == "correct"])]
    for category in CATEGORIES_ORDER:
        members = [r for r in rows if r[0]["kind"] == "bug" and BY_ID[r[0]["cls"]]["category"] == category]
        if members:
            groups.append((f"bugs: {category}", members))
    print(f"\n{half}: {len(rows)} cases")
    print("| " + " | ".join(["row"] + COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for label, members in groups + [("all", rows)]:
        t = tally(members)
        print("| " + " | ".join([label] + [str(t[c]) for c in COLUMNS]) + " |")
    t = tally(rows)
    bugs = sum(1 for c, _ in rows if c["kind"] == "bug")
    correct = t["correct passed"] + t["correct failed"]
    failed_bugs = t["bugs failed"]
    print(f"summary {half}: correct {t['correct passed']}/{correct} passed; mistakes {bugs}: {failed_bugs} failed "
          f"({t['named strictly']} named strictly, {t['ambiguity stated']} ambiguity stated, {t['misnamed']} misnamed, "
          f"{failed_bugs - t['named strictly'] - t['ambiguity stated'] - t['misnamed']} unnamed), "
          f"{t['passed by stated limit']} passed by a stated limit, {t['passed silently']} passed silently; "
          f"{t['errors']} errors")


def main(results_dir):
    cases = {c["id"]: c for c in all_cases()}
    status = {}
    with open(os.path.join(results_dir, "results.tsv")) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if len(fields) >= 4 and fields[0] in cases:
                status[fields[0]] = (int(fields[1]), int(fields[2]) if fields[2] != "-" else None, fields[3],
                                     fields[4] if len(fields) > 4 else "")
    by_half = {}
    failures = []
    for case_id, (peer_status, check_status, seconds, log) in status.items():
        case = cases[case_id]
        text = read_output(os.path.join(results_dir, log)) if log else ""
        result = score(case, peer_status, check_status, text)
        by_half.setdefault(case["half"], []).append((case, result))
        if not result["passed"]:
            failures.append(f"FAIL {case_id}: {result['outcome']}"
                            f"{' (' + result['naming'] + ')' if result['naming'] else ''}; {result['note']}")
    for half in ("dev", "held-out"):
        if half in by_half:
            table(half, by_half[half])
    if failures:
        print()
        print("\n".join(failures))
    passed = sum(r["passed"] for rows in by_half.values() for _, r in rows)
    total = sum(len(rows) for rows in by_half.values())
    print(f"{passed} passed, {total - passed} failed")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
