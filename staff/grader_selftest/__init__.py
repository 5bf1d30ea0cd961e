"""The grader's self-tests (staff only; never in the bundle or the release): submissions made from the reference
that the grader must grade right, and the measurement its time limits come from.

    zoo.py              broken submissions the grader must survive (CI: tests/staff/test_zoo.py); zoo_forgeries.py
                        (results forged from inside a rank), zoo_hangs.py (hangs graded in full)
    mutant_list.py      the hand-written seeded bugs of the reference
    mutations.py        the self-test: the suite must kill every mutant of mutant_list.py (CI: test_mutations.py)
    mutant_grading.py   how a mutant is graded and what kills it (mutations.py and machine_mutants.py)
    machine_mutants.py  cosmic-ray's mutants, graded (machine_mutants_report.py writes MACHINE_MUTANTS.md and
                        machine_mutants.json)
    lies.py             submissions that lie about memory or bytes, and their honest twins (lies.json)
    measure_times.py    the reference's time per graded test: writes staff/autograder/test_times.json

One package, imported as ``staff.grader_selftest`` (and ``staff.autograder`` for the grader itself); nothing here
edits ``sys.path``. Run from the repository root: ``python -m staff.grader_selftest.zoo --help``.
"""
