"""The autograder: what ships to Gradescope (build_bundle.py copies this folder's grading files; staff only).

    grading_plugin.py   pytest plugin: runs each test; its parts: grading_selection.py (which tests, points,
                        order), grading_limits.py (time limits, budget shares, hang blame), grading_results.py
                        (Gradescope's results.json written as the run goes, complete at every moment),
                        student_limits.py (all of the rank user's memory), cleanup.py (what a test leaves)
    grade.py            the grading command; also Gradescope's entry point (run_autograder calls it)
    sanitize.py         every line the grader prints and every output in results.json
    review.py           the staff review: lines of a submission that reach into the grader or around the process
                        group (results.json's extra_data, the log; a command over a folder of submissions)
    build_bundle.py     builds the Gradescope zip: setup.sh, run_autograder, the staff tree with the stubs and
                        the public and hidden tests; refuses to build if any of the reference is inside
    results_schema.py   checks a results.json against Gradescope's format (CI)
    test_times.json     the reference's time per graded test (the plugin's limits)

One package: its modules import each other relatively (``from .grading_selection import ...``) and nothing here
edits ``sys.path`` (tests/staff/test_package_imports.py). Its commands run as modules from the tree's root:

    python -m staff.autograder.grade --results results.json [-- -m task3 -x ...]   # grade this tree's task files

which runs, in a child process group it kills at --timeout:

    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 FSDP_IMPL=student FSDP_RANK_MEMORY_LIMIT_BYTES=... [FSDP_RANK_USER=...] \\
    python -m pytest -p staff.autograder.grading_plugin -p pytest_timeout -p no:cacheprovider \\
        -c pyproject.toml --rootdir . --confcutdir . --continue-on-collection-errors \\
        --grade-results results.json --grade-budget 480 tests/public tests/hidden

Build the Gradescope bundle:

    python -m staff.autograder.build_bundle --out dist/autograder.zip

The grader's own self-tests (broken submissions, mutants, lies, time measurement) are the package
``staff.grader_selftest``, never shipped.
"""
