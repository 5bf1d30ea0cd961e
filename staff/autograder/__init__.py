"""The autograder: the grading pytest plugin, the grading command, the Gradescope bundle, and its self-tests.

    grading_plugin.py   pytest plugin: points per test, per-task score table, Gradescope results.json as it goes
    grade.py            the grading command (runs pytest with the plugin, isolated), and Gradescope's entry point
    build_bundle.py     builds the Gradescope autograder zip (setup.sh, run_autograder, the staff tree, no reference)
    mutations.py        seeded bugs of the reference; the suite must catch them (staff only, not in the bundle)
    zoo.py              broken submissions the grader must survive (staff only, not in the bundle)
"""
