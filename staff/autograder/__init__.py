"""The autograder: grading plugin and command, the Gradescope bundle, and their self-tests (staff only).

    grading_plugin.py   pytest plugin: runs each test; its parts: grading_selection.py (which tests, points,
                        order), grading_limits.py (time limits, budget shares, hang blame), grading_results.py
                        (Gradescope's results.json written as the run goes, complete at every moment)
    grade.py            the grading command; also Gradescope's entry point (run_autograder calls it)
    build_bundle.py     builds the Gradescope zip: setup.sh, run_autograder, the staff tree with the stubs and
                        the public and hidden tests; refuses to build if any of the reference is inside
    results_schema.py   checks a results.json against Gradescope's format (CI)
    mutant_list.py      the seeded bugs of the reference (never shipped)
    mutations.py        the self-test: the suite must kill every mutant of mutant_list.py (CI)
    mutant_grading.py   how a mutant is graded and what kills it (mutations.py and machine_mutants.py)
    zoo.py              broken submissions the grader must survive (CI; never shipped; zoo_forgeries.py,
                        zoo_hangs.py)

Grade this tree's task files (what CI and staff use):

    python staff/autograder/grade.py --results results.json [-- -m task3 -x ...]

which runs, in a child process group it kills at --timeout:

    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 FSDP_IMPL=student FSDP_RANK_MEMORY_LIMIT_BYTES=... [FSDP_RANK_USER=...] \\
    python -m pytest -p staff.autograder.grading_plugin -p pytest_timeout -p no:cacheprovider \\
        -c pyproject.toml --rootdir . --confcutdir . --continue-on-collection-errors \\
        --grade-results results.json --grade-budget 480 tests/public tests/hidden

Build the Gradescope bundle:

    python staff/autograder/build_bundle.py --out dist/autograder.zip

Self-tests (marker ``staff``): tests/staff/test_grading_plugin.py, test_autograder_bundle.py, test_zoo.py,
test_mutations.py; by hand: ``python staff/autograder/mutations.py`` and ``python staff/autograder/zoo.py``.
"""
