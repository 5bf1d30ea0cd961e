"""Design-revealing terms per task, and the hint folder that explains each one (staff only).

Nothing a student reads outside ``hints/`` says *how*: which PyTorch facility to use, the steps of a method, or a
pitfall's solution right after posing it. The how lives in graduated hints that a stuck student opens one level
at a time:

    hints/taskN/<NN-topic>/1-question.md    level 1: the question to ask yourself
    hints/taskN/<NN-topic>/2-mechanism.md   level 2: the mechanism (which facility or idea, and why it fits)
    hints/taskN/<NN-topic>/3-recipe.md      level 3: the recipe, as precise as a full docstring

``DESIGN_TERMS[N]`` maps each term that would give away Task N's design to the hint folder (relative to the
repository root) whose level-2 or level-3 file covers it. A term is a literal string matched case-sensitively as
a substring. tests/staff/test_design_terms.py reads everything a student reads outside ``hints/``: every
``handout/*.typ`` file (Typst comments aside: they never reach the PDF, and the release ships no Typst), the
docstrings and ``#`` comments of the task stubs, of ``fsdp_assignment/support/`` and of ``adapters.py``, and the
assertion messages and failure texts of ``tests/public/`` (read with ``ast``, as Python runs them). Every term
of every task must be absent from all of it, with two narrow exceptions below; and each term must occur in the
level-2 or level-3 file of the hint folder it names.

- ``VOCABULARY``: a term that is also the subject's ordinary vocabulary or a provided name outside its task
  (``all-reduce`` is DDP's collective; ``shard_range`` is a method of Task 2's FlatParameter). It is checked in
  its own task's places only: Task N's stub, the handout's Task N section (``handout/tasks.typ``) and
  ``tests/public/test_taskN_*.py``.
- ``ALLOWED_IN``: a file that must name a term to do its own job (the memory tracker wraps
  ``UntypedStorage.resize_``).

To add a term: add it here with its hint folder, write it into that folder's ``2-mechanism.md`` or
``3-recipe.md``, and take it out of every place above (for a stub: the reference's docstrings and the comments
that the stub copies; then ``python staff/make_stubs.py``).
"""

from __future__ import annotations

DESIGN_TERMS: dict[int, dict[str, str]] = {
    1: {
        "pre-order": "hints/task1/01-replay-order",
        "module.modules()": "hints/task1/01-replay-order",
        "module.apply": "hints/task1/01-replay-order",
        "to_empty": "hints/task1/01-replay-order",
        "scratch": "hints/task1/02-tied-parameters",
        "swap_tensors": "hints/task1/03-sharded-units",
    },
    2: {
        "resize_": "hints/task2/02-freeing-memory",
        "torch.split": "hints/task2/03-views-and-gradients",
        "torch.empty": "hints/task2/03-views-and-gradients",
        "requires_grad_": "hints/task2/03-views-and-gradients",
        "reshape": "hints/task2/03-views-and-gradients",
    },
    3: {
        "register_forward_pre_hook": "hints/task3/01-hooks",
        "register_forward_hook": "hints/task3/01-hooks",
        "with_kwargs": "hints/task3/01-hooks",
        "all_gather_into_tensor": "hints/task3/02-all-gather",
        "all_gather_single": "hints/task3/02-all-gather",
        "non_blocking": "hints/task3/02-all-gather",
        "pinned": "hints/task3/02-all-gather",
        "version counter": "hints/task3/03-views-after-gather",
        ".data": "hints/task3/03-views-after-gather",
        "fresh views": "hints/task3/03-views-after-gather",
        "wait_for_unshard": "hints/task3/03-views-after-gather",
        "reshard_unit": "hints/task3/04-in-flight-gathers",
        "the unit FORWARD": "hints/task3/01-hooks",
    },
    4: {
        "register_multi_grad_hook": "hints/task4/01-regather-before-backward",
        'mode="any"': "hints/task4/01-regather-before-backward",
        "ReduceOp": "hints/task4/02-reduce-scatter-mean",
        "reduce_scatter_tensor": "hints/task4/02-reduce-scatter-mean",
        "reduce_scatter_single": "hints/task4/02-reduce-scatter-mean",
        "RegisterPostBackward": "hints/task4/03-frozen-units-lora",
        "register_post_accumulate_grad_hook": "hints/task4/03-frozen-units-lora",
        "autograd.Function": "hints/task4/03-frozen-units-lora",
        "identity": "hints/task4/03-frozen-units-lora",
        "view_as": "hints/task4/03-frozen-units-lora",
        "newest first": "hints/task4/03-frozen-units-lora",
        "queue_callback": "hints/task4/04-end-of-backward",
        "_execution_engine": "hints/task4/04-end-of-backward",
        "backward_callback_queued": "hints/task4/04-end-of-backward",
        "_current_graph_task_id": "hints/task4/05-activation-checkpointing",
        "enable_grad": "hints/task4/05-activation-checkpointing",
        "final callback": "hints/task4/04-end-of-backward",
        "first pre-backward": "hints/task4/04-end-of-backward",
        "finalize_backward": "hints/task4/04-end-of-backward",
    },
    5: {
        "all_reduce": "hints/task5/02-global-norm",
        "all-reduce": "hints/task5/02-global-norm",
        "sum of squares": "hints/task5/02-global-norm",
        "shard_range": "hints/task5/03-model-state-dict",
        "copy_into_shard": "hints/task5/03-model-state-dict",
        "dim() == 0": "hints/task5/04-optimizer-state-dict",
        "zeros_like": "hints/task5/04-optimizer-state-dict",
    },
    6: {
        "recording_order": "hints/task6/01-execution-order",
        "shared.units[0]": "hints/task6/01-execution-order",
        "pending_reduce_scatters": "hints/task6/04-async-reduce-scatter",
        "_current_graph_task_id": "hints/task6/05-recomputation-and-skipped-units",
        "_in_backward": "hints/task6/05-recomputation-and-skipped-units",
        "instead of gathering again": "hints/task6/02-forward-prefetch",
        "record_forward_order": "hints/task6/01-execution-order",
        "prefetch_forward": "hints/task6/02-forward-prefetch",
        "prefetch_backward": "hints/task6/03-backward-prefetch",
        "in its pre-backward": "hints/task6/03-backward-prefetch",
    },
    7: {
        "_fsdp_owner": "hints/task7/02-ties-across-units",
        "mark each parameter": "hints/task7/02-ties-across-units",
        "weakref": "hints/task7/02-ties-across-units",
        "__class__": "hints/task7/03-fsdp-module-class",
        "swap the module's class": "hints/task7/03-fsdp-module-class",
        "subclass": "hints/task7/03-fsdp-module-class",
        "register_forward_pre_hook": "hints/task7/04-lazy-root-init",
        "forward pre-hook": "hints/task7/04-lazy-root-init",
        "unsharded_dtype": "hints/task7/05-mixed-precision",
        "mark left on each flattened parameter": "hints/task7/02-ties-across-units",
        "the unit that flattened it": "hints/task7/02-ties-across-units",
        "lazy_init": "hints/task7/04-lazy-root-init",
    },
}

# Terms checked only in their own task's places (see the module docstring), each with the reason.
VOCABULARY: dict[str, str] = {
    "all-reduce": "DDP's collective (Background), HSDP's across replicas (bonus); 'no all-reduce' is a contract",
    "all_reduce": "the collective's name, in the debugging example of a hang",
    "all_gather_single": "the collective's name: the handout's Background teaches the primitives by name",
    "all_gather_into_tensor": "its deprecated name, in the Background and the warnings table",
    "reduce_scatter_single": "the collective's name: the handout's Background teaches the primitives by name",
    "reduce_scatter_tensor": "its deprecated name, in the Background and the warnings table",
    "pinned": "the pinned torch version; the CPU-offload bonus's pinned memory is its contract",
    "subclass": "Python's word (a tensor subclass such as DTensor)",
    "shard_range": "a method of Task 2's FlatParameter (Task 2's contract)",
    "unsharded_dtype": "a keyword of Task 2's FlatParameter (Task 2's contract)",
}

# Files that must name a term to do their own job: path -> {term: why}.
ALLOWED_IN: dict[str, dict[str, str]] = {
    "fsdp_assignment/support/memory.py": {
        "resize_": "the tracker wraps UntypedStorage.resize_ to follow storages that shrink and grow in place "
                   "(and its resize_label argument)",
    },
}
