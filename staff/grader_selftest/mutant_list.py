"""The hand-written mutants: each one edit of one reference task file, the student bug it stands for, and (where
the public tests miss it) the hidden test meant to catch it. Grading and the report live in mutations.py; the
grading path is mutant_grading.py's, shared with the machine-generated mutants.

New mutants go at the end of the list (``MUTANTS += [...]``, ids of the issue's own range) with their kind in
mutations.py's ``KIND_OF``. Staff-only: mutants contain pieces of the solution and never go into the bundle or the
release.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    task: int              # the task file edited
    old: str
    new: str
    bug: str               # the student's mistake it stands for
    issue_bug: str = ""    # the bug of the issue's list it seeds ("" when it is an extra)
    target: str = ""       # a hidden test that catches it, run first ("" when the public tests suffice)


MUTANTS: list[Mutant] = [
    # ---- Task 1: meta-device init ------------------------------------------------------------------------
    Mutant("m01", 1, "    for sub in module.modules():\n        own_params =",
           "    for sub in reversed(list(module.modules())):\n        own_params =",
           "materializes children before parents: the RNG is replayed in another order",
           "meta init that consumes the RNG in another order"),
    Mutant("m02", 1, "        owned = sharded_owned.get(id(sub), [])\n",
           "        owned = [o for o in sharded_owned.get(id(sub), [])\n"
           "                 if (id(o[0]), o[0].aliases[o[1]]) not in initialized]\n",
           "skips the later owner of a tied weight in sharded units, so its init never consumes random numbers",
           "meta init that consumes the RNG in another order", "test_sharded_meta_init_replays_the_rng_exactly"),
    Mutant("m03", 1, "            if key not in initialized:  # a tied alias seen again only consumed random numbers\n",
           "            if True:\n",
           "a tied weight takes the value of its later owner's init (the scratch init is copied into the shard)",
           "tied weights updated twice, or once on the wrong rank"),
    Mutant("m04", 1, "            delattr(sub, attr)  # the full tensor is freed here\n", "            pass\n",
           "keeps every module's full parameters alive after copying its slice: the whole model materializes"),
    Mutant("m05", 1, "        if not hasattr(sub, \"reset_parameters\"):\n",
           "        if False:\n",
           "no TypeError for a module that owns meta state but has no reset_parameters()",
           "", "test_module_without_reset_parameters_is_rejected"),
    Mutant("m06", 1, "        for name, b in own_buffers:\n            sub._buffers[name] = torch.empty(",
           "        for name, b in own_buffers:\n            continue\n            sub._buffers[name] = torch.empty(",
           "buffers are left on the meta device"),
    # ---- Task 2: FlatParameter ---------------------------------------------------------------------------
    Mutant("m07", 2, "self.padded_numel = -(-self.numel // world_size) * world_size",
           "self.padded_numel = self.numel // world_size * world_size",
           "pads down (floor) instead of up: the last elements are lost when W does not divide numel",
           "padding wrong when W does not divide numel", "test_padding_edge_cases"),
    Mutant("m08", 2, "self.padded_numel = -(-self.numel // world_size) * world_size",
           "self.padded_numel = (self.numel // world_size + 1) * world_size",
           "always adds padding, a whole extra W elements when W divides numel",
           "padding wrong when W does not divide numel", "test_padding_edge_cases"),
    Mutant("m09", 2, "self.shard = nn.Parameter(torch.zeros(self.shard_numel",
           "self.shard = nn.Parameter(torch.ones(self.shard_numel",
           "the shard is not zero-initialized, so its padding is garbage",
           "padding wrong when W does not divide numel"),
    Mutant("m10", 2, "            if id(param) not in unique:\n                unique[id(param)] = (name, param)\n"
                     "                self.param_names.append(name)\n            self.aliases[name] = unique[id(param)][0]",
           "            if name not in unique:\n                unique[name] = (name, param)\n"
           "                self.param_names.append(name)\n            self.aliases[name] = unique[name][0]",
           "deduplicates by name instead of identity: a tied weight is flattened, and updated, twice",
           "tied weights updated twice, or once on the wrong rank"),
    Mutant("m11", 2, "        # Resizing the storage (not dropping the tensor) returns the memory while every view stays valid.\n"
                     "        self.unsharded.untyped_storage().resize_(0)\n",
           "        fresh = torch.empty(self.padded_numel, dtype=self.unsharded.dtype, "
           "device=self.unsharded.device)\n        fresh.untyped_storage().resize_(0)\n"
           "        self.unsharded.data = fresh\n",
           "'frees' by pointing the buffer at a new empty storage: the old one lives on in the views",
           "a reshard that drops the reference but keeps the storage", "test_reshard_really_frees_memory"),
    Mutant("m12", 2, "        return lo - self.param_offsets[i], hi - self.param_offsets[i], lo - self.shard_offset",
           "        return lo - self.param_offsets[i], hi - self.param_offsets[i], lo",
           "uses the flat offset, not the offset inside the shard: pieces land on the wrong rank's slots",
           "tied weights updated twice, or once on the wrong rank", "test_padding_edge_cases"),
    # ---- Task 3: forward -----------------------------------------------------------------------------------
    Mutant("m13", 3, "        if unit.reshard_after_forward:\n            reshard_unit(unit)",
           "        if False:\n            reshard_unit(unit)",
           "never reshards after forward"),
    Mutant("m14", 3, "    elif unit.sharded_state == ShardedState.SHARDED:\n        for flat_param in unit.flat_params:\n"
                     "            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)\n"
                     "    # Fresh views every time: views made under torch.no_grad() in an earlier forward would cut the "
                     "gradient path.\n    for flat_param in unit.flat_params:\n        flat_param.use_unsharded_views()\n",
           "    elif unit.sharded_state == ShardedState.SHARDED:\n        for flat_param in unit.flat_params:\n"
           "            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)\n"
           "            flat_param.use_unsharded_views()\n",
           "sets the views only when it gathers: views made under no_grad stay and cut the gradient path",
           "", "test_eval_under_no_grad_then_train"),
    Mutant("m15", 3, "    if shard.dtype != dtype or shard.device != flat_param.unsharded.device:\n"
                     "        # Stream-ordered before the collective, so a non-blocking host-to-device copy is safe here.\n"
                     "        shard = shard.to(device=flat_param.unsharded.device, dtype=dtype, non_blocking=True)\n",
           "",
           "all-gathers the fp32 shard into the low-precision buffer (no cast to param_dtype)", "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("m16", 3, "    if unit.param_dtype is None or not unit.cast_forward_inputs:",
           "    if True:", "never casts forward inputs to param_dtype", "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    # ---- Task 4: backward ---------------------------------------------------------------------------------
    Mutant("m17", 4, "op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM",
           "sums gradients over ranks instead of averaging", "gradients summed instead of averaged", "test_gradients_accumulate_over_backward_passes"),
    Mutant("m18", 4, "        with torch.enable_grad():\n            wait_for_unshard(unit)\n",
           "",
           "does not re-gather a resharded unit before its backward",
           "no re-gather in backward after reshard"),
    Mutant("m19", 4, "        grad = grad.to(unit.reduce_dtype or grad.dtype)\n",
           "        grad = grad.to(unit.reduce_dtype or grad.dtype)\n        grad[flat_param.numel:] = 1.0\n",
           "the padded flat gradient's padding is garbage (built with torch.empty), and is reduced as is",
           "padding gradients not zeroed", "test_gradients_accumulate_over_backward_passes"),
    Mutant("m20", 6, "        for pending in shared.pending_reduce_scatters:\n            _finish_reduce_scatter(pending)\n",
           "",
           "backward returns with the last async reduce-scatter unfinished: its gradient is missing at step()",
           "reduce-scatter not finished before step",
           "test_prefetch_gathers_each_unit_once_and_finishes_every_reduction"),
    Mutant("m21", 4, "        flat_param.shard.grad += grad_shard", "        flat_param.shard.grad = grad_shard",
           "overwrites the shard's gradient instead of accumulating into it",
           "", "test_gradients_accumulate_over_backward_passes"),
    Mutant("m22", 4, "        grad = grad.to(unit.reduce_dtype or grad.dtype)\n", "        grad = grad.to(grad.dtype)\n",
           "reduce-scatters in the parameters' dtype (bf16), ignoring reduce_dtype",
           "mixed precision reducing in the wrong dtype",
           "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("m23", 4, "            grad = flat_param.unsynced_grad.add_(grad)\n", "            grad = grad\n",
           "gradient accumulation keeps only the last micro-batch's gradient",
           "gradient accumulation that syncs too early or drops a micro-batch", "test_gradient_accumulation_over_two_steps_with_prefetch"),
    Mutant("m24", 4, "            grad = flat_param.unsynced_grad.add_(grad)\n            flat_param.unsynced_grad = None\n",
           "            grad = flat_param.unsynced_grad.add_(grad)\n",
           "the accumulated unsynced gradient is never cleared: it is added again in the next step",
           "gradient accumulation that syncs too early or drops a micro-batch",
           "test_gradient_accumulation_over_two_steps_with_prefetch"),
    Mutant("m25", 4, "                self.post_backward(unit)\n        self.wait_for_reductions(shared)\n",
           "                pass\n        self.wait_for_reductions(shared)\n",
           "no backstop in the final callback: units whose post-backward autograd never ran (the root, whose input "
           "needs no gradient; unused units) are neither reduced nor resharded"),
    # ---- Task 5: optimizer, clipping, checkpoints ---------------------------------------------------------
    Mutant("m26", 5, "    dist.all_reduce(local_sq, group=groups[0] if groups else None)\n", "",
           "clips by the local norm of this rank's shards", "clip norm computed locally", "test_clip_grad_norm_below_max_norm_changes_nothing"),
    Mutant("m27", 5, "    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)",
           "    clip_coef = max_norm / (total_norm + 1e-6)",
           "scales gradients up when their norm is below max_norm",
           "", "test_clip_grad_norm_below_max_norm_changes_nothing"),
    Mutant("m28", 5, "    return optimizer_cls([p for p in module.parameters() if p.requires_grad], **kwargs)",
           "    return optimizer_cls([fp.unsharded for _, fp in named_flat_params(module) if fp.requires_grad], "
           "**kwargs)",
           "builds the optimizer over the full (unsharded) flat parameters: state for the whole model on every rank",
           "optimizer state replicated instead of sharded"),
    Mutant("m29", 5, "                out[prefix + name] = flat_param.shard.detach()[at:at + end - start].clone()",
           "                out[prefix + name] = flat_param.shard.detach()[start:end].clone()",
           "sharded state dict slices the shard with the parameter's offsets, not the shard's"),
    Mutant("m30", 5, "                t = torch.zeros_like(shard)  # padding stays zero",
           "                t = torch.ones_like(shard)",
           "loading optimizer state leaves garbage in the padding (torch.empty_like), which leaks into the shard",
           "", "test_resume_keeps_padding_zero_and_matches"),
    Mutant("m31", 5, "    return {alias: unique[name] for alias, name in flat_param.aliases.items()}",
           "    return unique",
           "full state dicts list a tied weight under one of its names only"),
    # ---- Task 6: prefetching -----------------------------------------------------------------------------
    Mutant("m32", 6, "        if i + 1 < len(order) and order[i + 1] not in shared.recording_order:\n            _issue_unshard(order[i + 1])",
           "        for later in order[i + 1:]:\n            _issue_unshard(later)",
           "prefetches every later unit: all of them are unsharded at once",
           "prefetch that waits on the wrong handle or keeps every unit unsharded"),
    Mutant("m33", 6, "        if i + 1 < len(order) and order[i + 1] not in shared.recording_order:\n            _issue_unshard(order[i + 1])",
           "        if i + 1 < len(order) and order[i + 1] not in shared.recording_order:\n            later = order[i + 1]\n"
           "            if later.sharded_state == ShardedState.SHARDED and not later.pending_unshard:\n"
           "                for flat_param in later.flat_params:\n"
           "                    unit.pending_unshard.append(unshard(flat_param, later.group, "
           "param_dtype=later.param_dtype, async_op=True))",
           "keeps the prefetch handle on the wrong unit: the prefetched unit does not find it and gathers again",
           "prefetch that waits on the wrong handle or keeps every unit unsharded",
           "test_prefetch_gathers_each_unit_once_and_finishes_every_reduction"),
    Mutant("m34", 6, "        if i >= 1:\n            _issue_unshard(order[i - 1])",
           "        if i + 1 < len(order):\n            _issue_unshard(order[i + 1])",
           "backward prefetch goes the wrong way (the forward order instead of its reverse)"),
    # ---- Task 7: fully_shard ------------------------------------------------------------------------------
    Mutant("m35", 7, "        if name.rpartition(\".\")[2] in FLAT_PARAM_NAMES:\n            continue\n", "",
           "a parent unit flattens its children's flat parameters again",
           "nested units' parameters counted twice"),
    Mutant("m36", 7, "                    reduce_dtype=(mp.reduce_dtype or param_dtype) if mp is not None else None,",
           "                    reduce_dtype=param_dtype,",
           "ignores MixedPrecisionPolicy.reduce_dtype: reduces in param_dtype",
           "mixed precision reducing in the wrong dtype",
           "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("m37", 7, "    for unit in fsdp_units(module):\n        unit.requires_gradient_sync = requires_gradient_sync",
           "    for unit in fsdp_units(module)[:1]:\n        unit.requires_gradient_sync = requires_gradient_sync",
           "set_requires_gradient_sync reaches the root unit only: the others sync every micro-batch",
           "gradient accumulation that syncs too early or drops a micro-batch", "test_gradient_accumulation_over_two_steps_with_prefetch"),
    Mutant("m38", 7, "                    reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,",
           "                    reshard_after_forward=True, param_dtype=param_dtype,",
           "ignores fully_shard(reshard_after_forward=False)",
           "", "test_reshard_after_forward_false_via_fully_shard"),
    Mutant("m39", 7, "        if owner is not None and owner[0]() is not None:\n",
           "        if False:\n",
           "silently flattens a weight tied to another unit's a second time (unties it)",
           "tied weights updated twice, or once on the wrong rank"),
    Mutant("m41", 4, "        if _in_backward():\n            # A reentrant recomputation",
           "        if False:\n            # A reentrant recomputation",
           "reshards after a reentrant recomputation (checkpoint(block, use_reentrant=True)): every checkpointed "
           "unit is all-gathered twice per backward"),
    Mutant("m42", 1, "if b is not None and b.is_meta]", "if b is not None or b.is_meta]",
           "materializes every real buffer again (and trips on a None buffer): a buffer already off meta loses "
           "its values", "", "test_state_already_off_meta_is_kept"),
    Mutant("m43", 5, "    out.update({k: v.detach().clone() for k, v in _buffers(module).items()})",
           "    out.update({k: v.detach().clone() for k, v in _buffers(module).items() if v.is_floating_point()})",
           "leaves integer and boolean buffers out of the model state dict (FSDP2 keeps them)", "",
           "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m44", 6, "        if i + 1 < len(order) and order[i + 1] not in shared.recording_order:",
           "        if i + 1 < len(order):",
           "forward-prefetches the unit after one that runs a second time, although it already ran: it stays "
           "unsharded, unused, through backward (three units at once)", "",
           "test_prefetch_with_a_block_run_twice_keeps_two_units_unsharded"),
    Mutant("m40", 7, "        if owner is not None and owner[0]() is not None:\n",
           "        if owner is not None and any(owner[0]() is u.module for u in fsdp_units(module)):\n",
           "rejects a weight tied to a child unit's but not one tied to a sibling's: fully_shard(m.embed); "
           "fully_shard(m.head) unties TiedModel's weight", "tied weights updated twice, or once on the wrong rank",
           "test_tie_across_units_is_rejected_in_every_arrangement"),
    # ---- gradetests (issue 13 / 14): state beyond values, mixed precision, several outputs, late collectives,
    # wasted communication, checkpoints, no-sync cheats. Each seeds one of the issue's areas (see CATEGORIES).
    Mutant("g01", 1, "                         requires_grad=flat_param.shard.requires_grad)",
           "                         )",
           "materializes a sharded unit's shard as a new Parameter without its requires_grad: frozen shards train"),
    Mutant("g02", 1, "            fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), "
                     "requires_grad=p.requires_grad)",
           "            fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))",
           "materializes an unsharded module's parameters without their requires_grad: frozen parameters train",
           "", "test_meta_init_replays_the_rng_exactly"),
    Mutant("g03", 1, "        if not (own_params or own_buffers or owned):",
           "        if not (own_params or owned):",
           "skips modules that own only buffers: their buffers stay on meta and their init draws no random numbers",
           "", "test_sharded_meta_init_replays_the_rng_exactly"),
    Mutant("g04", 1, "    unsharded = torch.empty(flat_param.padded_numel, dtype=flat_param.unsharded.dtype, device=device)",
           "    unsharded = torch.empty(flat_param.padded_numel, dtype=flat_param.shard.dtype, device=device)",
           "re-creates the unsharded buffer in the shard's dtype: after meta init, mixed precision gathers fp32",
           "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("g05", 3, "    return _cast_floating(args, unit.param_dtype), _cast_floating(kwargs, unit.param_dtype)",
           "    return _cast_floating(args, unit.param_dtype), kwargs",
           "casts positional inputs to param_dtype but not keyword inputs",
           "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("g06", 3, "    if unit.pending_unshard:\n        for work in unit.pending_unshard:\n            work.wait()\n",
           "    if unit.pending_unshard:\n",
           "uses a prefetched all-gather's buffer without waiting on its handle (passes on gloo by luck)",
           "", "test_prefetch_gathers_each_unit_once_and_finishes_every_reduction"),
    Mutant("g07", 3, "    elif unit.sharded_state == ShardedState.SHARDED:\n        for flat_param in unit.flat_params:\n"
                     "            unshard(",
           "    else:\n        for flat_param in unit.flat_params:\n            unshard(",
           "all-gathers a unit again although it is unsharded already (reshard_after_forward=False, backward)",
           "", "test_reshard_after_forward_false_via_fully_shard"),
    Mutant("g08", 4, "            tensors = [t for t in _flatten_tensors(output) if t.requires_grad]",
           "            tensors = [t for t in _flatten_tensors(output)[:1] if t.requires_grad]",
           "the pre-backward hook watches only a unit's first output; a loss using another output skips it",
           "", "test_gradients_accumulate_over_backward_passes"),
    Mutant("g09", 4, "            flat_param.unsynced_grad = grad\n",
           "            dist.all_reduce(grad)\n            grad.div_(dist.get_world_size())\n"
           "            flat_param.unsynced_grad = grad\n",
           "set_requires_gradient_sync(False) still all-reduces every micro-batch (same values, wasted traffic)"),
    Mutant("g10", 4, "            grad = flat_param.unsynced_grad.add_(grad)\n",
           "            grad = flat_param.unsynced_grad.to(flat_param.unsharded.dtype).add_("
           "grad.to(flat_param.unsharded.dtype)).to(grad.dtype)\n",
           "sums gradients accumulated without sync in the parameters' bf16 instead of reduce_dtype",
           "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("g11", 4, "    work = _reduce_scatter_single(grad_shard, unsharded_grad.contiguous(), group, async_op)",
           "    full = unsharded_grad.contiguous() / dist.get_world_size(group)\n"
           "    dist.all_reduce(full, group=group)\n"
           "    grad_shard.copy_(full.narrow(0, flat_param.shard_offset, flat_param.shard_numel))\n"
           "    work = dist.barrier(group=group, async_op=True) if async_op else None",
           "all-reduces the whole gradient and keeps its slice (DDP traffic, same values) instead of reduce-scatter"),
    Mutant("g12", 5, "        torch_groups.append({**{k: v for k, v in saved_group.items() if k != \"params\"}, "
                     "\"params\": ids})",
           "        torch_groups.append({**{k: v for k, v in group.items() if k != \"params\"}, \"params\": ids})",
           "loading an optimizer checkpoint keeps the new optimizer's lr/weight decay instead of the saved ones"),
    Mutant("g13", 5, "    for k, v in _buffers(module).items():\n        v.copy_(state_dict[k])",
           "    for k, v in _buffers(module).items():\n        pass",
           "loading a model state dict restores the parameters but not the buffers",
           "", "test_resume_keeps_padding_zero_and_matches"),
    Mutant("g14", 5, "                    if dist.get_rank() == 0:\n",
           "                    if True:\n",
           "the full optimizer state is built on every rank (then dropped): the whole state in memory everywhere",
           "", "test_resume_keeps_padding_zero_and_matches"),
    Mutant("g15", 5, "    keep = not full or dist.get_rank() == 0",
           "    keep = True",
           "the full model state dict is built on every rank (then dropped): the whole model in memory everywhere",
           "", "test_resume_keeps_padding_zero_and_matches"),
    Mutant("g16", 6, "        if shared.recording_order:\n            shared.forward_order = shared.recording_order",
           "        if shared.recording_order and not shared.forward_order:\n"
           "            shared.forward_order = shared.recording_order",
           "learns the forward order once and never again: a changed order prefetches the wrong units",
           "", "test_prefetch_follows_a_changed_order_and_frees_units_that_never_run"),
    Mutant("g17", 6, "    def pre_backward(self, unit: FSDPUnit) -> None:\n"
                     "        \"\"\"Task 4's ``pre_backward``, then, with prefetching on (only then), ``prefetch_backward(unit)``: the\n"
                     "        next unit's all-gather is issued before this unit's backward computation starts.\"\"\"\n"
                     "        super().pre_backward(unit)\n",
           "    def post_backward(self, unit: FSDPUnit) -> None:\n"
           "        super().post_backward(unit)\n",
           "issues the backward prefetch after the unit's backward instead of before it: too late to overlap"),
    Mutant("g18", 6, "        super().pre_backward(unit)\n        if unit.shared.prefetch:\n            prefetch_backward(unit)\n",
           "        super().pre_backward(unit)\n",
           "never prefetches in backward: every unit is gathered synchronously when its backward starts"),
    Mutant("g19", 4, "            if unit.sharded_state == ShardedState.UNSHARDED or unit.pending_unshard or any(",
           "            if unit.sharded_state == ShardedState.UNSHARDED or any(",
           "a unit prefetched but never run stays allocated after backward (and later serves stale parameters)",
           "", "test_prefetch_follows_a_changed_order_and_frees_units_that_never_run"),
    Mutant("g20", 6, "    work.wait()\n    accumulate_shard_grad(flat_param, grad_shard)",
           "    accumulate_shard_grad(flat_param, grad_shard)",
           "adds an async reduce-scatter's output to the gradient without waiting on its handle",
           "", "test_prefetch_gathers_each_unit_once_and_finishes_every_reduction"),
    Mutant("g21", 7, "                    reduce_dtype=(mp.reduce_dtype or param_dtype) if mp is not None else None,",
           "                    reduce_dtype=(mp.reduce_dtype or param_dtype) if param_dtype is not None else None,",
           "a policy with only reduce_dtype (no param_dtype) is ignored: gradients reduced in fp32",
           "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("g22", 7, "                    cast_forward_inputs=mp.cast_forward_inputs if mp is not None else True)",
           "                    cast_forward_inputs=True)",
           "ignores cast_forward_inputs=False: inputs are cast to param_dtype anyway",
           "", "test_mixed_precision_gathers_and_reduces_in_the_right_dtypes"),
    Mutant("g23", 4, "                flat_param.unsharded.grad = None\n                self.reduce_grad(",
           "                self.reduce_grad(",
           "keeps the full flat gradient after reducing it: a full gradient per unit stays alive after backward",
           "", "test_backward_really_frees_full_parameters_and_gradients"),
    # ---- Bonus (issue 21): HSDP on a 2-D mesh, CPU offload. Each targets the bonus test that catches it (public
    # tests under tests/public/test_bonus_*.py, graded apart from the 100).
    Mutant("b01", 7, "        work, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group, async_op=True)",
           "        work, grad_shard = reduce_scatter_grad(flat_param, grad, None, async_op=True)",
           "HSDP: reduce-scatters over the whole world instead of the shard group", "",
           "test_hsdp_2x2_trains_like_one_process_and_fsdp2"),
    Mutant("b02", 7, "            dist.all_reduce(self.grad_shard, op=dist.ReduceOp.SUM, group=self.replicate_group)\n"
                     "            self.grad_shard.div_(dist.get_world_size(self.replicate_group))\n", "",
           "HSDP: no all-reduce across replicas (each replica trains on its own half of the batch)", "",
           "test_hsdp_2x2_trains_like_one_process_and_fsdp2"),
    Mutant("b03", 7, "            self.grad_shard.div_(dist.get_world_size(self.replicate_group))\n", "",
           "HSDP: sums the gradient shard across replicas instead of averaging (R times too large)", "",
           "test_hsdp_2x2_trains_like_one_process_and_fsdp2"),
    Mutant("b04", 7, "    return mesh.get_group(1), (replicate_group if dist.get_world_size(replicate_group) > 1 else None)",
           "    return None, None",
           "HSDP: ignores the 2-D mesh and shards over all W ranks (plain FSDP: no replication, no shard group)", "",
           "test_hsdp_2x2_trains_like_one_process_and_fsdp2"),
    Mutant("b05", 7, "    replicate_group = mesh.get_group(0)\n    return mesh.get_group(1), (",
           "    replicate_group = mesh.get_group(1)\n    return mesh.get_group(0), (",
           "HSDP: mesh dims swapped (dim 0 shards, dim 1 replicates), against FSDP2's convention", "",
           "test_hsdp_2x2_trains_like_one_process_and_fsdp2"),
    Mutant("b06", 7, "        if self.work is not None:\n            self.work.wait()\n            self.work = None\n"
                     "            dist.all_reduce(",
           "        if self.work is not None:\n            self.work = None\n            dist.all_reduce(",
           "HSDP: all-reduces the gradient shard before its reduce-scatter has finished", "",
           "test_hsdp_2x2_trains_like_one_process_and_fsdp2"),
    Mutant("b07", 5, "    dist.all_reduce(local_sq, group=groups[0] if groups else None)\n",
           "    dist.all_reduce(local_sq)\n",
           "HSDP: clip_grad_norm_ sums squares over every rank, counting each replica's shard R times", "",
           "test_hsdp_degenerate_meshes_4x1_and_1x4"),
    Mutant("b08", 5, "    _all_gather_single(full, local, group, False)",
           "    _all_gather_single(full, local, None, False)",
           "HSDP: checkpoints and gather_full_params gather over the whole world instead of the shard group", "",
           "test_hsdp_degenerate_meshes_4x1_and_1x4"),
    Mutant("b09", 7, "            if offload:\n                _offload_shard(flat_param, offload_policy.pin_memory)\n"
                     "            module.register_parameter(attr, flat_param.shard)\n",
           "            module.register_parameter(attr, flat_param.shard)\n"
           "            if offload:\n                _offload_shard(flat_param, offload_policy.pin_memory)\n",
           "CPU offload: moves the shard after registering it, so the optimizer steps a parameter FSDP no longer "
           "reads or writes gradients into", "", "test_cpu_offload_trains_like_one_process_and_fsdp2"),
    Mutant("b10", 7, "    if pin_memory and torch.cuda.is_available():",
           "    if pin_memory:",
           "CPU offload: pins memory whatever the machine (fails where there is no GPU)", "",
           "test_cpu_offload_trains_like_one_process_and_fsdp2"),
]

# ---- Frozen units and activation checkpointing (issue 9; added by the core helper, ids c01..) ----------------
MUTANTS += [
    Mutant("c01", 4, "            if inputs:\n                outputs = _RegisterPostBackward.apply(",
           "            if False:\n                outputs = _RegisterPostBackward.apply(",
           "no post-backward trigger on the unit's inputs: every unit (frozen weights included) stays unsharded "
           "until the final callback"),
    Mutant("c02", 4, "        ctx.hooks.post_backward(ctx.unit)\n",
           "        if any(fp.unsharded.grad is not None for fp in ctx.unit.flat_params):\n"
           "            ctx.hooks.post_backward(ctx.unit)\n",
           "post-backward only for units that got a gradient: a fully frozen unit stays unsharded until the end",
           "", "test_frozen_embedding_and_a_fully_frozen_unit"),
    # c03 and c04 (a recomputation's full pre-forward; post-forward's PRE_BACKWARD early return removed) became
    # equivalent with the reentrant fix (issue 19): every recomputation runs inside backward, where post_forward
    # no longer reshards (the _in_backward() branch), so neither can reshard a unit under its own backward. The
    # whole suite let both through in CI (139 s each); removed rather than counted as survivors.
    Mutant("c05", 4, "        with torch.enable_grad():\n            wait_for_unshard(unit)\n",
           "        if True:\n            wait_for_unshard(unit)\n",
           "pre-backward makes the views with grad mode off: a reentrant checkpoint inside the unit recomputes "
           "from views with no path to the flat gradient"),
    # c06 (a recomputed forward records the order and forward-prefetches) became equivalent with the prefetch fix
    # (issue 17, 1.2.0): prefetch_forward skips a unit that already ran in this forward, and during backward every
    # unit has, while record_forward_order never appends a unit twice. Only a recomputed *root* forward would
    # still differ (it restarts the recording); no test checkpoints the root. It survived the whole suite in CI
    # (105 s); removed rather than counted as a survivor.
    Mutant("c07", 4, "        unit.training_state = TrainingState.PRE_BACKWARD\n        with torch.enable_grad():\n",
           "        if unit.training_state == TrainingState.POST_BACKWARD:\n            return\n"
           "        unit.training_state = TrainingState.PRE_BACKWARD\n        with torch.enable_grad():\n",
           "pre-backward runs once per unit and backward: a unit run twice in forward is not re-gathered for its "
           "first run's backward", "", "test_unit_run_twice_and_detached_output"),
    Mutant("c08", 1, "                restore.append((name, materialized[id(p)]))\n",
           "                restore.append((name, materialized[id(p)]))\n                continue\n",
           "a tied weight's later owner is initialized on the meta tensor: its init consumes no random numbers, "
           "so every module after it differs", "meta init that consumes the RNG in another order",
           "test_meta_init_replays_the_rng_exactly"),
    Mutant("c09", 4, "                flat_param.unsharded.grad = None\n", "",
           "post-backward reduces the full gradient but keeps it on unsharded.grad: a full gradient per unit "
           "stays alive", "", "test_backward_really_frees_full_parameters_and_gradients"),
    Mutant("c10", 4, "                self.post_backward(unit)\n        self.wait_for_reductions(shared)\n",
           "                self.wait_for_reductions(shared)\n                self.post_backward(unit)\n",
           "the final callback waits for reductions before its backstop post-backwards: their async "
           "reduce-scatters (the root, the first block behind a frozen embedding) are in flight when backward "
           "returns", "reduce-scatter not finished before step", "test_prefetch_with_frozen_embedding_and_a_fully_frozen_unit"),
]

# ---- Paths nobody graded (issue 25; helper "cov", ids m60..m79): each killed by the graded differential --------
MUTANTS += [
    Mutant("m60", 4, "            inputs = [t for t in _flatten_tensors((args, kwargs)) if t.requires_grad]",
           "            inputs = [t for t in _flatten_tensors(args) if t.requires_grad]",
           "the post-backward trigger is attached to positional inputs only: a unit whose grad-carrying input is a "
           "keyword argument stays unsharded, its gradient unreduced, until the final callback", "",
           "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m61", 4, "        if torch.is_grad_enabled():\n            inputs = [t for t in _flatten_tensors((args, kwargs)) "
                     "if t.requires_grad]\n            if inputs:\n                outputs = _RegisterPostBackward.apply("
                     "self, unit, *inputs)\n                new = {id(t): o for t, o in zip(inputs, outputs)}\n"
                     "                args, kwargs = _replace_tensors(args, new), _replace_tensors(kwargs, new)\n"
                     "        return super().pre_forward(unit, args, kwargs)",
           "        args, kwargs = super().pre_forward(unit, args, kwargs)\n        if torch.is_grad_enabled():\n"
           "            inputs = [t for t in _flatten_tensors((args, kwargs)) if t.requires_grad]\n            if inputs:\n"
           "                outputs = _RegisterPostBackward.apply(self, unit, *inputs)\n"
           "                new = {id(t): o for t, o in zip(inputs, outputs)}\n"
           "                args, kwargs = _replace_tensors(args, new), _replace_tensors(kwargs, new)\n"
           "        return args, kwargs",
           "applies the post-backward trigger after the parameter views are made: post_backward runs before the "
           "gradient reaches unsharded.grad, so every unit's full gradient stays alive until the final callback", "",
           "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m62", 4, "        if not shared.backward_callback_queued:\n",
           "        if not shared.backward_callback_queued and unit.is_root:\n",
           "queues the final callback only from the root's pre-backward: a loss that does not pass through the "
           "root's output has no backstop (reductions never waited, units left unsharded, state never reset)", "",
           "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m63", 1, "    shard = nn.Parameter(torch.zeros(flat_param.shard_numel, dtype=flat_param.shard.dtype, device=device),",
           "    shard = nn.Parameter(torch.zeros(flat_param.shard_numel, device=device),",
           "materializes a sharded unit's shard in the default dtype: a bf16 or fp64 model built on meta comes back "
           "fp32", "", "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m64", 3, "    return _cast_floating(args, unit.param_dtype), _cast_floating(kwargs, unit.param_dtype)",
           "    for b in unit.module.buffers():\n        if torch.is_floating_point(b):\n"
           "            b.data = b.data.to(unit.param_dtype)\n"
           "    return _cast_floating(args, unit.param_dtype), _cast_floating(kwargs, unit.param_dtype)",
           "mixed precision casts the unit's floating-point buffers to param_dtype too (FSDP2 leaves buffers alone)",
           "", "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m65", 5, "            for name in flat_param.param_names:\n                start, end, at = flat_param.shard_range(name)\n"
                     "                out[prefix + name] = flat_param.shard.detach()[at:at + end - start].clone()",
           "            for alias, name in flat_param.aliases.items():\n"
           "                start, end, at = flat_param.shard_range(name)\n"
           "                out[prefix + alias] = flat_param.shard.detach()[at:at + end - start].clone()",
           "lists a tied weight under every alias in the sharded state dict (once, under its kept name, is the format)",
           "", "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m66", 7, "        if owner is not None and owner[0]() is not None:\n",
           "        if owner is not None and owner[0]() is not None and param.requires_grad:\n",
           "checks ties across units for trainable weights only: a frozen weight tied across two units is sharded "
           "twice without the ValueError", "", "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m67", 1, "            sub._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)",
           "            sub._buffers[name] = torch.empty(b.shape, device=device)",
           "materializes meta buffers in the default dtype: integer and boolean buffers come back float", "",
           "test_generated_scripts_match_torch_fsdp2"),
    Mutant("m68", 4, "lambda grads: self.pre_backward(unit),\n                                                              mode=\"any\")",
           "lambda grads: self.pre_backward(unit),\n                                                              mode=\"all\")",
           "pre-backward waits for the gradients of all of a unit's outputs (mode=\"all\"): with two outputs each "
           "made by its own layer, the first one's layer runs backward on freed parameters (setStorage ... size 0)",
           "", "test_generated_scripts_match_torch_fsdp2"),
]


# ---- A feature that silently switches off (issue 25; ids m50..m59): each is killed by a required test through the
# monitor's order invariants (forward-prefetch, backward-prefetch, no-early-gathers, reductions-overlap) on
# fully_shard's path, where set_prefetch is flipped between micro-batches.
MUTANTS += [
    Mutant("m50", 7, "    (PrefetchHooks() if replicate_group is None else _HybridHooks()).register(unit)",
           "    from .task4_backward import BackwardHooks\n"
           "    (BackwardHooks() if replicate_group is None else _HybridHooks()).register(unit)",
           "fully_shard registers Task 4's hooks instead of Task 6's: set_prefetch does nothing"),
    Mutant("m51", 6, "        while len(shared.pending_reduce_scatters) > 1:\n            _finish_reduce_scatter(",
           "        while shared.pending_reduce_scatters:\n            _finish_reduce_scatter(",
           "each asynchronous reduce-scatter is waited on right after it is issued: nothing overlaps"),
    Mutant("m52", 6, "        init_shared_state(units[0])\n    units[0].shared.prefetch = enabled",
           "        init_shared_state(units[0])\n        units[0].shared.prefetch = enabled",
           "set_prefetch takes effect only before the first forward (it sets the flag only when it creates the "
           "shared state)"),
    Mutant("m53", 6, "        super().pre_backward(unit)\n        if unit.shared.prefetch:\n            prefetch_backward(unit)\n",
           "        super().pre_backward(unit)\n        prefetch_backward(unit)\n",
           "backward prefetching runs while prefetching is off (by the order the last forward with it on recorded)"),
]


# ---- Dtypes nobody measured (issue 32; ids m69..m72): every one passed the required tests before issue 32's checks.
MUTANTS += [
    Mutant("m69", 1, "            fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), "
                     "requires_grad=p.requires_grad)",
           "            fresh = nn.Parameter(torch.empty(p.shape, device=device), requires_grad=p.requires_grad)",
           "materializes a module's own (unsharded) parameters in the default dtype: a bf16 or fp64 model built on "
           "meta comes back fp32", "", "test_meta_init_replays_the_rng_exactly"),
    Mutant("m70", 2, "resize_(self.padded_numel * self.unsharded.element_size())",
           "resize_(self.padded_numel * self.shard.element_size())",
           "allocates the gathered bf16 buffer with the fp32 shard's element size: twice the gathered memory under "
           "mixed precision, every number right"),
    Mutant("m71", 5, "    local = (flat_param.shard if local is None else local).detach().to(flat_param.unsharded.device)",
           "    local = (flat_param.shard.to(flat_param.unsharded.dtype) if local is None else local).detach().to(\n"
           "        flat_param.unsharded.device)",
           "gathers full parameters in the unsharded buffer's dtype: under mixed precision gather_full_params and "
           "the full state dict come back bf16"),
    Mutant("m72", 5, "                out.update({prefix + name: t for name, t in gathered.items()})",
           "                out.update({prefix + name: t.to(flat_param.unsharded.dtype) for name, t in gathered.items()})",
           "returns the full model state dict in param_dtype (bf16 under mixed precision), the parameters right"),
]


# ---- Bugs the public suite let through (issue 37; ids m80..m89): each is killed by a public test added for it.
# The issue's other such bugs were already seeded, each killed only by a hidden test until issue 37: m27 (clip
# coefficient not capped at 1), m62 (final callback queued from the root only), g14 and g15 (full state dicts on
# every rank), g05 (keyword inputs not cast), m66 (a frozen weight tied across units accepted) and m65 (a tied
# weight under both names in the sharded state dict).
MUTANTS += [
    Mutant("m80", 3, "    # An all-gather still in flight writes into the buffer: finish it before freeing the "
                     "storage.\n    for work in unit.pending_unshard:\n        work.wait()\n    unit.pending_unshard.clear()\n",
           "    unit.pending_unshard.clear()\n",
           "frees the buffer of a unit prefetched that then did not run with its all-gather still in flight (the "
           "handle dropped, never waited on)"),
    Mutant("m81", 3, "    work = _all_gather_single(flat_param.unsharded.data, shard, group, async_op)\n",
           "    with torch.no_grad():\n        version = flat_param.unsharded._version\n"
           "        work = _all_gather_single(flat_param.unsharded, shard, group, async_op)\n"
           "        torch._C._autograd._unsafe_set_version_counter((flat_param.unsharded,), (version,))\n",
           "gathers into the autograd-visible buffer and restores its version counter around the call: views saved "
           "for backward stay usable only when the gather completes inside the call (synchronously)"),
    Mutant("m82", 4, "            if inputs:\n"
                     "                outputs = _RegisterPostBackward.apply(self, unit, *inputs)\n"
                     "                new = {id(t): o for t, o in zip(inputs, outputs)}\n"
                     "                args, kwargs = _replace_tensors(args, new), _replace_tensors(kwargs, new)\n",
           "            for t in inputs:\n"
           "                t.register_hook(lambda grad, unit=unit: self.post_backward(unit))\n",
           "post-backward from a hook on each input tensor itself: when an earlier unit also reads that input, the "
           "hook waits for the earlier unit's backward too, and the unit stays unsharded through it"),
]


# ---- The survivors of issue 41's blind bugs (ids m83..m89): each killed by a public test added for it. ----------
MUTANTS += [
    Mutant("m83", 3, "    if isinstance(x, torch.Tensor):\n        return x.to(dtype) if torch.is_floating_point(x) else x",
           "    if isinstance(x, torch.Tensor):\n        return x.to(dtype) if x.dtype == torch.float32 else x",
           "under mixed precision casts only float32 inputs: fp64 and fp16 inputs reach the module uncast (the "
           "docstring says every floating-point tensor)"),
    Mutant("m84", 6, "        shared.pending_reduce_scatters.append((work, flat_param, grad_shard, grad))",
           "        shared.pending_reduce_scatters.append((work, flat_param, grad_shard, None))",
           "keeps no reference to an asynchronous reduce-scatter's input until its wait(): gloo's handle keeps none "
           "either, so on an asynchronous backend the collective reads freed memory"),
    Mutant("m85", 3, "        if unit.reshard_after_forward:\n            reshard_unit(unit)",
           "        if unit.__dict__.setdefault(\"_raf_first_forward\", unit.reshard_after_forward):\n"
           "            reshard_unit(unit)",
           "reads reshard_after_forward once, at the unit's first forward, and keeps that value: changing the "
           "documented switch between iterations does nothing"),
]
