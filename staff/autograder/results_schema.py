"""A check of results.json against Gradescope's autograder results format (staff CI; no dependency).

Gradescope's format (https://gradescope-autograders.readthedocs.io/en/latest/specs/): a JSON object with
``score`` (number), ``execution_time`` (seconds), ``output`` (text), optional ``visibility``,
``stdout_visibility``, ``extra_data``, ``output_format``, ``leaderboard``, and ``tests``: a list of objects with
``score``, ``max_score``, ``status`` ("passed" or "failed"), ``name``, ``number``, ``output``, ``visibility``
(and optional ``tags``, ``extra_data``, ``name_format``, ``output_format``). We require what our grader
promises: every one of these keys on every test, consistent scores, and nothing unknown.
"""

from __future__ import annotations

import math

VISIBILITIES = {"visible", "hidden", "after_due_date", "after_published"}
TOP_REQUIRED = {"score": (int, float), "execution_time": (int, float), "output": str, "tests": list}
TOP_OPTIONAL = {"visibility": str, "stdout_visibility": str, "extra_data": dict, "output_format": str,
                "leaderboard": list, "test_output_format": str, "test_name_format": str}
TEST_REQUIRED = {"name": str, "number": str, "score": (int, float), "max_score": (int, float), "status": str,
                 "output": str, "visibility": str}
TEST_OPTIONAL = {"tags": list, "extra_data": dict, "name_format": str, "output_format": str}


def _check_keys(obj: dict, required: dict, optional: dict, where: str) -> list[str]:
    problems = []
    for key, kind in required.items():
        if key not in obj:
            problems.append(f"{where}: missing {key!r}")
        elif isinstance(obj[key], bool) or not isinstance(obj[key], kind):
            problems.append(f"{where}: {key!r} is {type(obj[key]).__name__}, expected {kind}")
    for key, value in obj.items():
        if key in required:
            continue
        if key not in optional:
            problems.append(f"{where}: unknown key {key!r}")
        elif not isinstance(value, optional[key]):
            problems.append(f"{where}: {key!r} is {type(value).__name__}, expected {optional[key]}")
    return problems


def validate(data) -> list[str]:
    """Problems with ``data`` (a parsed results.json); empty when it conforms."""
    if not isinstance(data, dict):
        return ["results.json is not a JSON object"]
    problems = _check_keys(data, TOP_REQUIRED, TOP_OPTIONAL, "results")
    for key in ("visibility", "stdout_visibility"):
        if key in data and data[key] not in VISIBILITIES:
            problems.append(f"results: {key} {data[key]!r} is not one of {sorted(VISIBILITIES)}")
    tests = data.get("tests") if isinstance(data.get("tests"), list) else []
    numbers = set()
    for i, t in enumerate(tests):
        where = f"tests[{i}]"
        if not isinstance(t, dict):
            problems.append(f"{where}: not an object")
            continue
        problems += _check_keys(t, TEST_REQUIRED, TEST_OPTIONAL, where)
        if t.get("status") not in ("passed", "failed"):
            problems.append(f"{where}: status {t.get('status')!r} is not 'passed' or 'failed'")
        if t.get("visibility") not in VISIBILITIES:
            problems.append(f"{where}: visibility {t.get('visibility')!r} is not one of {sorted(VISIBILITIES)}")
        score, max_score = t.get("score"), t.get("max_score")
        if isinstance(score, (int, float)) and isinstance(max_score, (int, float)):
            if not (0 <= score <= max_score + 1e-9) or not math.isfinite(max_score):
                problems.append(f"{where}: score {score} outside [0, max_score={max_score}]")
            if t.get("status") == "failed" and score != 0:
                problems.append(f"{where}: a failed test scores {score}, not 0")
            if t.get("status") == "passed" and abs(score - max_score) > 1e-6:
                problems.append(f"{where}: a passed test scores {score} of {max_score}")
        if t.get("number") in numbers:
            problems.append(f"{where}: number {t.get('number')!r} is not unique")
        numbers.add(t.get("number"))
    if isinstance(data.get("score"), (int, float)) and tests:
        # Bonus tests (tag "bonus") are reported apart: the score is the required tests' sum.
        required = [t for t in tests if isinstance(t, dict) and "bonus" not in (t.get("tags") or [])]
        total = sum(t.get("score", 0) for t in required)
        if abs(total - data["score"]) > 0.011:
            problems.append(f"results: score {data['score']} is not the sum of the required tests' scores "
                            f"({total:.4f}; bonus tests apart)")
        bonus = [t for t in tests if isinstance(t, dict) and "bonus" in (t.get("tags") or [])]
        reported = (data.get("extra_data") or {}).get("bonus") if isinstance(data.get("extra_data"), dict) else None
        if bonus and not (isinstance(reported, dict) and abs(reported.get("score", -1) -
                                                              sum(t.get("score", 0) for t in bonus)) <= 0.011):
            problems.append(f"results: extra_data.bonus {reported!r} does not hold the bonus tests' score "
                            f"({sum(t.get('score', 0) for t in bonus):.4f})")
    return problems
