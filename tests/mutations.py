"""Mutation check: plant each fault the suite must catch, one at a time, in a copy of the
package, run the tests that should catch it, and report which ones did.

    python tests/mutations.py [--only NAME]

Each mutation is a textual patch of one place in ``isp_comm/`` (checked to apply
exactly once). A mutation is *killed* when its tests fail. The kill rate goes to the
README; this script is not part of the CI suite (it reruns several slow tests per
mutation, about 6 minutes on the 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BREAKDOWN = "tests/test_memory_breakdown.py::"
FSDP2_BREAKDOWN = BREAKDOWN + "test_fsdp2_breakdown_counts_local_shards_and_resized_gathers"
WRITES = "tests/test_state_sharding.py::test_writes_nobody_announces_reach_the_gathers"
REPLICA_SYNC = "tests/test_replica_sync.py::"
UNPLANNED = "tests/test_engine_parity.py::test_steps_that_did_not_go_as_planned_train_on_like_a_plain_loop[False]"
# name -> (file, old text, new text, tests that must fail)
MUTATIONS: dict[str, tuple[str, str, str, list[str]]] = {
    "skipped update of one block": (
        "isp_comm/hooks/reductions.py",
        "        r.unit.accumulate_grad(r.out, r.group)",
        "        if r.unit.index != 1:\n            r.unit.accumulate_grad(r.out, r.group)",
        ["tests/test_engine_parity.py::test_parity_replicas_and_no_overlap"],
    ),
    "gradients at 0.75x (bf16 run)": (
        "isp_comm/hooks/reductions.py",
        "            r.out.div_(self._post if r.group.dtype in LOW_PRECISION else self.groups.world_size)",
        "            r.out.div_((self._post if r.group.dtype in LOW_PRECISION else self.groups.world_size) / 0.75)",
        ["tests/test_mixed_precision.py::test_bf16_training_tracks_fp32"],
    ),
    "local-norm clip": (
        "isp_comm/state.py",
        '        reduce(part[:1], group, size, "the clip\'s norm all-reduce")  # the sharded part, in place',
        "        pass  # mutation: the sharded part stays local",
        ["tests/test_state.py::test_clip_grad_norm_equals_single_process"],
    ),
    "pieces' norm over WP only": (
        "isp_comm/state.py",
        "        group, size = (g.world_group, g.world_size) if self.pieces else (g.wp_group, g.wp_size)",
        "        group, size = (g.wp_group, g.wp_size)",
        ["tests/test_state_sharding.py::test_world_sharding_matches_single_process[4-2]"],
    ),
    "stale WP shards after a step": (
        "isp_comm/hooks/refresh.py",
        "        while id(unit) in self._stale:  # again",
        "        while False and id(unit) in self._stale:  # again",
        ["tests/test_state_sharding.py::test_world_sharding_matches_single_process[4-2]"],
    ),
    "a fused optimizer's step unseen": (
        "isp_comm/communicator.py",
        "        self.engine.refresh.mark_stale({id(p) ",
        "        set() and self.engine.refresh.mark_stale({id(p) ",  # mutation: no step marks the WP shards stale
        ["tests/test_state_sharding.py::test_every_write_to_the_pieces_reaches_the_gathers"],
    ),
    "a frozen piece's step unseen": (
        "isp_comm/communicator.py",
        "if p.requires_grad or p.grad is not None})",
        "if p.requires_grad})",  # mutation: a frozen parameter's zero gradient is stepped, unseen
        [WRITES],
    ),
    "only the last state dict watched": (
        "isp_comm/hooks/refresh.py",
        "            self._watched.append((weakref.ref(root), root.detach(), root._version))",
        "            self._watched[:] = [(weakref.ref(root), root.detach(), root._version)]",
        [WRITES],
    ),
    "a dropped state dict's kept tensors unwatched": (
        "isp_comm/hooks/refresh.py",
        "for r, alias, _ in self._watched if r() is not None]",
        "for r, alias, _ in self._watched if False]",
        [WRITES],
    ),
    "a state dict dropped before a look unseen": (
        "isp_comm/hooks/refresh.py",
        "        written = self._gone_written or any(alias._version != n for _, alias, n in self._watched)",
        "        written = self._gone_written or any("
        "alias._version != n for r, alias, n in self._watched if r() is not None)",
        [WRITES],
    ),
    "a block called alone reads stale shards": (
        "isp_comm/hooks/engine.py",
        "        if not self._in_root:  # a block called on its own",
        "        if False:  # a block called on its own",
        [WRITES],
    ),
    "a block called alone prefetches the next": (
        "isp_comm/hooks/engine.py",
        "        if self._in_root:\n            self.prefetch(unit.index + 1)",
        "        if True:\n            self.prefetch(unit.index + 1)",
        [WRITES],
    ),
    "storage moved in place taken for re-pointing": (
        "isp_comm/units.py",
        "            if shard.data_ptr() - self.master.data_ptr() == self._homes[i]:",
        "            if shard.data_ptr() - self.master.untyped_storage().data_ptr() * 0 == self._homes[i]:",
        [WRITES],
    ),
    "a frozen parameter's gradient dropped": (
        "isp_comm/hooks/reductions.py",
        "            p.grad = old if p.grad is None else old.add_(p.grad)",
        "            if p.requires_grad:\n                p.grad = old if p.grad is None else old.add_(p.grad)",
        [
            "tests/test_engine_parity.py::test_a_parameter_frozen_between_forward_and_backward_keeps_its_earlier_gradient"
        ],
    ),
    "deferred replica reductions issued anyway": (
        "isp_comm/hooks/reductions.py",
        "            self._syncing = self.replica_sync or self.groups.replica_size == 1",
        "            self._syncing = True",
        [REPLICA_SYNC + "test_the_replicas_reduce_once_a_step[world]"],
    ),
    "a deferred sum reduced apart from the syncing backward's": (
        "isp_comm/hooks/reductions.py",
        "        r.handle = CompletedHandle()\n        self._add_deferred(r.unit, r.group, r.out)",
        "        r.handle = CompletedHandle()",
        [REPLICA_SYNC + "test_the_replicas_reduce_once_a_step[world]"],
    ),
    "a deferred sum dropped when the syncing backward skips its block": (
        "isp_comm/hooks/reductions.py",
        "            self._reduce_deferred()",
        "            self._deferred.clear()",
        [REPLICA_SYNC + "test_deferred_with_unused_parameters_and_a_block_the_last_micro_step_skips[wp2x2]"],
    ),
    "re-pointed parameters left": (
        "isp_comm/hooks/engine.py",
        "        for unit in (u for u in (self.root, *self.summed, *self.units) if u is not None):\n            moved",
        "        for unit in ():\n            moved",
        [WRITES],
    ),
    "a backward an exception escaped never ended": (
        "isp_comm/hooks/engine.py",
        "            try:\n                self.end_backward()\n",
        "            try:\n                pass\n",
        [UNPLANNED],
    ),
    "a second forward's gather in another slot": (
        "isp_comm/hooks/block_state.py",
        "(backward and self.saved_views) or self.views_held",
        "backward and self.saved_views",
        ["tests/test_engine_parity.py::test_a_gather_keeps_the_slot_a_live_forward_saved_views_of"],
    ),
    "a forward after a dropped one leaves the reductions armed for before": (
        "isp_comm/hooks/engine.py",
        "        arm, self._trainable_at = self.phase is Phase.IDLE or changed or resync, now",
        "        arm, self._trainable_at = self.phase is Phase.IDLE or resync, now",
        ["tests/test_engine_parity.py::test_requires_grad_changed_after_a_forward_with_grad"],
    ),
    "requires_grad changed between live forwards let through": (
        "isp_comm/hooks/engine.py",
        "        if changed and not second and any(st.views_held for st in self.states):",
        "        if False:",
        ["tests/test_engine_parity.py::test_requires_grad_changed_after_a_forward_with_grad"],
    ),
    "a frozen block's views held by nothing": (
        "isp_comm/hooks/engine.py",
        "            self.states[unit.index].hold_views_for(marked[0].grad_fn)",
        "            pass",
        ["tests/test_engine_parity.py::test_a_gather_keeps_the_slot_a_live_forward_saved_views_of[frozen]"],
    ),
    "a frozen block's backward ends only at the next block's": (
        "isp_comm/hooks/engine.py",
        "        for index in sorted(self._ending_unseen):",
        "        for index in sorted(i for i in self._ending_unseen if now is None or i == now.index + 1):",
        ["tests/test_engine_parity.py::test_two_forwards_then_one_backward_train_as_a_plain_model"],
    ),
    "an early exit's prefetched block kept": (
        "isp_comm/hooks/engine.py",
        "        if not raised:\n            self._release_leftovers()\n",
        "        pass\n",
        ["tests/test_engine_parity.py::test_a_forward_that_exits_early_trains_as_a_plain_model[config_kw0]"],
    ),
    "the last weights' check left unread at a state dict": (
        "isp_comm/communicator.py",
        "self.model.register_state_dict_post_hook(lambda *_: check.flush())",
        "self.model.register_state_dict_post_hook(lambda *_: None)",
        [
            "tests/test_validation.py::test_the_last_check_no_backward_read_is_read_where_the_weights_leave_the_run[full]"
        ],
    ),
    "an MoE's fused experts left whole": (
        "isp_comm/discovery.py",
        "    return isinstance(module, nn.Linear) or any(p.dim() >= 2 for p in own)\n",
        "    return isinstance(module, nn.Linear)\n",
        ["tests/test_hf.py::test_moe_experts_fused_into_3d_tensors_are_sharded[2-2-wp]"],
    ),
    "a killed rank stamped after its peer's error left unnamed": (
        "isp_comm/train/launch.py",
        "    rank, first = first_failure(exc)\n",
        "    rank, first = exc.get_first_failure()\n",
        ["tests/test_survive.py::test_a_job_ended_by_a_signalled_rank_exits_with_its_code"],
    ),
    "a failed wait's late ranks cleared before the handle is told": (
        "isp_comm/backends/symm_cpu.py",
        "        self._wait_flags_until(g, base, target, what)\n        self._stalled[0] = None\n",
        "        try:\n            self._wait_flags_until(g, base, target, what)\n"
        "        finally:\n            self._stalled[0] = None\n",
        ["tests/test_backends.py::test_a_wait_as_long_as_the_backends_deadline_names_the_late_rank"],
    ),
    "an expert's tensors read into its neighbour's rows": (
        "isp_comm/hf_checkpoint.py",
        "                rows = local[cell.expert - first].narrow(",
        "                rows = local[(cell.expert - first + 1) % local.shape[0]].narrow(",
        ["tests/test_hf_checkpoint.py::test_a_published_moe_checkpoint_is_read_expert_by_expert[mixtral-2-2-wp]"],
    ),
    "an expert's rows written as its neighbour's tensors": (
        "isp_comm/hf_checkpoint.py",
        "        files.write(cell.key, value[cell.expert - first].narrow(",
        "        files.write(cell.key, value[(cell.expert - first + 1) % value.shape[0]].narrow(",
        ["tests/test_hf_checkpoint.py::test_a_published_moe_checkpoint_is_read_expert_by_expert[mixtral-2-2-wp]"],
    ),
    "an MoE's router loss of each chunk alone": (
        "isp_comm/sequence_parallel/router.py",
        "    sum_over_group(sums)  # the sequences' counts, probability sums and token count",
        "    pass  # mutation: each chunk's own counts and sums",
        ["tests/test_sequence_parallel.py::test_an_moes_router_loss_under_sp_is_the_whole_sequences"],
    ),
    "an MoE's router loss's gradient not scaled by SP": (
        "isp_comm/sequence_parallel/router.py",
        "    local = experts * group_size * (share * probs).sum() / sums[-1]",
        "    local = experts * (share * probs).sum() / sums[-1]",
        ["tests/test_sequence_parallel.py::test_an_moes_router_loss_under_sp_is_the_whole_sequences"],
    ),
    "a forward that returns None taken for one that raised": (
        "isp_comm/communicator.py",
        "raised=out is None and sys.exc_info()[1] is not None",
        "raised=out is None",
        ["tests/test_engine_parity.py::test_a_forward_that_exits_early_and_returns_none_trains_as_a_plain_model"],
    ),
    "whole gradients set aside at the forward, out of zero_grad()'s reach": (
        "isp_comm/hooks/reductions.py",
        "            self._armed, self._arrived = True, set()\n",
        "            self._armed, self._arrived = True, set()\n"
        "            for p in (*self.replicated, *self.wp_summed):\n"
        "                self._set_aside(p)\n",
        ["tests/test_engine_parity.py::test_zero_grad_between_forward_and_backward"],
    ),
    "a failed forward's outer region kept": (
        "isp_comm/hooks/engine.py",
        "            if self._in_root:  # the last forward was interrupted",
        "            if False:  # the last forward was interrupted",
        [UNPLANNED.replace("[False]", "[True]")],
    ),
    "pieces cut unlike DTensor": (
        "isp_comm/layout.py",
        "        c = -(-self.valid_rows // replicas)",
        "        c = -(-self.chunk_rows // replicas)  # mutation: padded rows chunked, not DTensor's",
        ["tests/test_state_sharding.py::test_pieces_are_the_local_tensors_dtensor_computes"],
    ),
    "no-op load_state_dict": (
        "isp_comm/state.py",
        '        into the shards and replicated tensors. Keys must match exactly."""',
        '        into the shards and replicated tensors. Keys must match exactly."""\n        return',
        ["tests/test_state.py::test_state_dict_mistakes_are_value_errors"],
    ),
    "no-op optimizer-state load": (
        "isp_comm/communicator.py",
        "        self._state.load_optimizer_state_dict(opt, osd)",
        "        return",
        ["tests/test_state.py::test_optimizer_state_from_full_tensors_is_loaded"],
    ),
    "bf16 accumulation in a reduction": (
        "isp_comm/backends/symm_cpu.py",
        "        if out.is_floating_point() and out.dtype not in (torch.float32, torch.float64):",
        "        if False:  # mutation: accumulate in the dtype itself",
        [
            "tests/test_backends.py::test_backend_contract",
            "tests/test_backends.py::test_symmetric_buffers_are_written_by_peers",
        ],
    ),
    "a replica that drifts": (
        "isp_comm/hooks/reductions.py",
        "        r.replica = self.backend.all_reduce(r.out, self.groups.replica_group)",
        "        r.replica = CompletedHandle()  # mutation: the replicas' shards are never averaged",
        ["tests/test_engine_parity.py::test_parity_replicas_and_no_overlap"],
    ),
    "halved traffic in the planner's link model": (
        "isp_comm/planner/links.py",
        "        parts.append((INTRA, twice * (n - 1) / n * nbytes, twice * (n - 1)))",
        "        parts.append((INTRA, twice * (n - 1) / n * nbytes / 2, twice * (n - 1)))",
        [
            "tests/test_virtual_tiers.py::test_a_collectives_time_from_published_figures",
            "tests/test_virtual_tiers.py::test_the_step_models_traffic_on_each_tier_by_hand",
        ],
    ),
    "NICs charged the least a node needs, not NCCL's ring": (
        "isp_comm/planner/links.py",
        "        parts.append((INTER, ring / fewest, inter_steps))",
        "        parts.append((INTER, twice * (n - fewest) / (n * fewest) * nbytes, inter_steps))",
        [
            "tests/test_virtual_tiers.py::test_a_collectives_time_from_published_figures",
            "tests/test_virtual_tiers.py::test_groups_spread_unevenly_over_nodes_go_at_the_pace_of_their_thinnest_node",
            "tests/test_virtual_tiers.py::test_the_step_models_traffic_on_each_tier_by_hand",
        ],
    ),
    "a node's network given to each of its GPUs whole, not shared": (
        "isp_comm/planner/targets.py",
        "            return self.network_bytes_per_s / self.per_node",
        "            return self.network_bytes_per_s",
        [
            "tests/test_virtual_tiers.py::test_a_node_with_one_nic_shares_it_among_its_gpus",
            "tests/test_planner.py::test_a_plan_on_a_network_of_one_nic_a_node_picks_the_state_over_the_world",
        ],
    ),
    "a block's activation gradients counted twice in the backward's forecast": (
        "isp_comm/memory_forecast/phases.py",
        '"activation gradients": 2 * hidden + traced.largest[i] +',
        '"activation gradients": 4 * hidden + 2 * traced.largest[i] +',
        ["tests/test_memory_breakdown.py::test_breakdown_on_2_ranks_adds_up_and_lines_up_with_the_forecast"],
    ),
    "a node's network divided by the nodes, not by its GPUs": (
        "isp_comm/planner/targets.py",
        "            return self.network_bytes_per_s / self.per_node",
        "            return self.network_bytes_per_s / self.nodes",
        ["tests/test_virtual_tiers.py::test_a_node_with_one_nic_shares_it_among_its_gpus"],
    ),
    "an all-reduce across nodes timed in its ring's steps, not its tree's": (
        "isp_comm/planner/links.py",
        "            intra_steps, inter_steps = 2 * (most - 1), 2 * math.ceil(math.log2(nodes))",
        "            intra_steps, inter_steps = 2 * (n - nodes), 2 * (nodes - 1)",
        ["tests/test_virtual_tiers.py::test_a_collectives_time_from_published_figures"],
    ),
    "halved traffic on the virtual flat link": (
        "isp_comm/backends/virtual.py",
        "    share = (n - 1) / n * nbytes",
        "    share = (n - 1) / n * nbytes / 2",
        ["tests/test_virtual.py::test_each_collective_takes_its_modelled_time_and_writes_local_bytes"],
    ),
    "one tier for every link (CPU and planner)": (
        "isp_comm/backends/tiers.py",
        "        for tier, seconds in demand.tiers:\n",
        "        for _, seconds in demand.tiers:\n            tier = 'one'\n",
        [
            "tests/test_virtual_tiers.py::test_tiers_run_at_once_and_a_tier_serves_one_collective_at_a_time",
            "tests/test_virtual_tiers.py::test_the_virtual_world_runs_nvlink_and_infiniband_at_once_and_shares_each",
        ],
    ),
    "one stream for every tier (CUDA)": (
        "isp_comm/backends/virtual.py",
        'spin_after("virtual tiers", tier, start, s)',
        'spin_after("virtual tiers", "one", start, s)',
        ["tests/test_virtual_tiers.py::test_the_cuda_path_gives_the_same_order_on_streams"],
    ),
    "compiled blocks traced as eager ones": (
        "isp_comm/memory_forecast/activations.py",
        "        elif compiled:\n            b.forward = compiled_forward(b, inside)",
        "        elif False:\n            b.forward = compiled_forward(b, inside)",
        ["tests/test_memory_forecast_compiled.py"],
    ),
    "a compiled block's trace on the eager path": (
        "isp_comm/memory_forecast/activations.py",
        "            torch.compiler._is_compiling_flag = True\n",
        "            torch.compiler._is_compiling_flag = compiling\n",
        ["tests/test_memory_forecast_compiled.py::test_the_trace_takes_the_path_a_compiled_block_takes"],
    ),
    "DTensors counted at their global size (memory breakdown)": (
        "isp_comm/memory_breakdown/tracker.py",
        '        t = getattr(t, "_local_tensor", t)\n        try:',
        "        try:",
        [FSDP2_BREAKDOWN],
    ),
    "storages resized in place counted at their first size (memory breakdown)": (
        "isp_comm/memory_breakdown/tracker.py",
        "        grew = False\n        with self._lock:",
        "        grew = False\n        return grew\n        with self._lock:",
        [FSDP2_BREAKDOWN, BREAKDOWN + "test_breakdown_follows_the_slots_made_and_freed_without_the_pool"],
    ),
    "FSDP2's copy operators name nothing (memory breakdown)": (
        "isp_comm/memory_breakdown/fsdp2.py",
        'OPERATOR_PARTS = {"fsdp::all_gather_copy_in"',
        'OPERATOR_PARTS = {} and {"fsdp::all_gather_copy_in"',
        [BREAKDOWN + "test_fsdp2s_copies_name_the_buffers_they_fill"],
    ),
    "the pool forecast all step without it (memory_pool=False)": (
        "isp_comm/memory_forecast/phases.py",
        "    gathered = plan.pool_bytes - plan.rs_bytes if pooled else",
        "    gathered = plan.pool_bytes - plan.rs_bytes if True else",
        [BREAKDOWN + "test_breakdown_follows_the_slots_made_and_freed_without_the_pool"],
    ),
    "the pairs made per reduce without the pool left unnamed (memory breakdown)": (
        "isp_comm/memory_breakdown/tracker.py",
        "        for pair in self._lent:  # named at any peak",
        "        for pair in ():  # named at any peak",
        [BREAKDOWN + "test_breakdown_follows_the_slots_made_and_freed_without_the_pool"],
    ),
    "the CPU virtual comm thread keeps its last collective's tensors": (
        "isp_comm/backends/virtual.py",
        "            job = body = None\n",
        "            pass\n",
        [FSDP2_BREAKDOWN],
    ),
    "states made for a checkpoint kept past the first step": (
        "isp_comm/state.py",
        "        self._handle = opt.register_step_pre_hook(self._first_step)\n",
        "        self._handle = opt.register_step_pre_hook(lambda *_: None)\n",
        ["tests/test_state.py::test_a_fresh_optimizers_state_dict_leaves_its_training_as_it_was"],
    ),
    "states made only for a fresh optimizer (not for parameters never stepped)": (
        "isp_comm/state.py",
        "        missing = [p for p in params if not opt.state.get(p)]\n",
        "        missing = [] if opt.state else params\n",
        ["tests/test_unused_parameters.py::test_a_checkpoint_of_parameters_not_yet_stepped_resumes[wp2]"],
    ),
    "the states' lr-0 step with a CPU float32 lr for a tensor one": (
        "isp_comm/state.py",
        'g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0',
        'g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0',
        ["tests/test_state.py::test_the_states_step_keeps_a_tensor_learning_rates_dtype_and_device"],
    ),
    "unused parameters decided by each rank alone (find_unused_parameters)": (
        "isp_comm/hooks/unused.py",
        '        self.collectives.all_reduce(used, self.group, self.size, "all-reduce of the parameters\' use")',
        "        pass",
        ["tests/test_unused_parameters.py"],
    ),
    "whole buckets issued mid-backward with find_unused_parameters": (
        "isp_comm/hooks/reductions.py",
        "            self._active = self._syncing and self.config.overlap and not self.config.find_unused_parameters",
        "            self._active = self._syncing and self.config.overlap",
        ["tests/test_unused_parameters.py::test_whole_parameters_used_by_some_ranks_on_one_queue"],
    ),
    "a block whose weights got no gradient keeps its slot to the backward's end": (
        "isp_comm/hooks/engine.py",
        "        if not unit.requires_grad or not st.weights_get_gradients():",
        "        if not unit.requires_grad:",
        ["tests/test_engine_parity.py::test_a_block_that_uses_none_of_its_weights_trains_as_a_plain_model[every-rank]"],
    ),
    "no zeros reduced for a block some ranks left unused (find_unused_parameters)": (
        "isp_comm/hooks/engine.py",
        "            if block.requires_grad and self.unused is not None:",
        "            if False:",
        [
            "tests/test_engine_parity.py::test_a_block_that_uses_none_of_its_weights_trains_as_a_plain_model"
            "[one-rank-one-queue]"
        ],
    ),
    "states dcp.load filled dropped at the first step": (
        "isp_comm/state.py",
        "            if marks is None or (made and _unwritten(now, marks)):",
        "            if marks is None or made:",
        ["tests/test_state.py::test_states_dcp_loaded_in_place_outlive_the_first_step"],
    ),
    "the optimizer's own state dict left as plain shards (torch's get_state_dict)": (
        "isp_comm/state.py",
        '                sd["state"][pid] = {k: self._state_value(fqn, k, p, v) for k, v in st.items()}\n',
        "                pass\n",
        ["tests/test_state.py::test_torchs_get_and_set_state_dict_save_and_resume_the_optimizer_too"],
    ),
    "a replicated parameter's post-accumulate-grad hooks run before the average": (
        "isp_comm/hooks/reductions.py",
        "            self.user_hooks.hold((p for b in self._buckets for p in b.params), whole=True, ours=ours)\n",
        "            pass\n",
        ["tests/test_grad_hooks.py::test_an_optimizer_stepped_in_the_backward_trains_as_on_the_plain_model[2]"],
    ),
    "a register_hook on a shard left never to run": (
        "isp_comm/hooks/engine.py",
        "            refuse_gradient_hooks(named, wrapping=False)",
        "            pass",
        ["tests/test_grad_hooks.py::test_gradient_hooks_that_would_never_run_are_refused[wp2]"],
    ),
    "a gradient hook put on before wrapping dropped": (
        "isp_comm/discovery.py",
        "    refuse_gradient_hooks(named, wrapping=True)",
        "    pass",
        ["tests/test_grad_hooks.py::test_gradient_hooks_that_would_never_run_are_refused[pieces]"],
    ),
    "replicas that part left unchecked": (
        "isp_comm/consistency.py",
        "        if apart:\n            names = list(apart)\n",
        "        if False:\n            names = list(apart)\n",
        ["tests/test_validation.py::test_replicas_stepped_apart_stop_the_run_and_say_why[torch]"],
    ),
    "rows alike after a later init left unchecked": (
        "isp_comm/consistency.py",
        '            raise RuntimeError(f"isp-comm: at backward {ended}, {rows_alike(alike)}")\n',
        "            pass\n",
        ["tests/test_validation.py::test_weights_initialised_after_the_first_step_stop_the_run_at_the_next_check[wp2]"],
    ),
    "weights written between a forward and its backward left unchecked": (
        "isp_comm/hooks/block_state.py",
        "        self._check_unwritten()\n",
        "",
        [
            "tests/test_engine_parity.py::test_weights_written_between_forward_and_backward_are_refused_as_autograd_does[wp2]"
        ],
    ),
    "shards' hooks run after each forward's reduction of one backward": (
        "isp_comm/hooks/engine.py",
        "            self.reducer.user_hooks.defer_shards()",
        "            pass",
        ["tests/test_grad_hooks.py::test_an_optimizer_stepped_in_the_backward_of_two_forwards_steps_once[wp2]"],
    ),
    "the outer parameters left swapped by a forward that raised": (
        "isp_comm/communicator.py",
        "            always_call=True,\n        )\n        self._wrapper_check",
        "            always_call=False,\n        )\n        self._wrapper_check",
        ["tests/test_engine_parity.py::test_a_forward_that_raised_puts_the_outer_parameters_back_at_once[bf16]"],
    ),
    "a shard frozen since the forward given its gradient": (
        "isp_comm/units.py",
        "        if group is self.whole_group and all(s.requires_grad for s in self.shards):",
        "        if group is self.whole_group:",
        ["tests/test_engine_parity.py::test_a_block_frozen_between_forward_and_backward_gets_no_gradient[wp2]"],
    ),
    "a whole parameter frozen since the forward given zeros": (
        "isp_comm/hooks/reductions.py",
        "                    if not p.requires_grad:  # frozen since the forward: autograd made it none either\n",
        "                    if False:\n",
        ["tests/test_engine_parity.py::test_a_block_frozen_between_forward_and_backward_gets_no_gradient[wp2]"],
    ),
    "an in-place reduce-scatter summed into the chunk it reads": (
        "isp_comm/backends/symm_cpu.py",
        "        elif any(overlaps(out, c) for c in chunks[1:]):\n",
        "        elif False:\n",
        ["tests/test_backends.py::test_reduce_scatter_in_place_into_its_own_chunk"],
    ),
    "sizes that do not fit issued": (
        "isp_comm/backends/symm_cpu.py",
        "        _check_sizes(kind, group, out, inp)\n",
        "        pass\n",
        ["tests/test_backends.py::test_sizes_that_do_not_fit_are_refused_at_issue"],
    ),
    "a symmetric buffer on some ranks only, unseen": (
        "isp_comm/backends/symm_cpu.py",
        "        mine = _signature(_DIRECT[what] if direct else what, nbytes, dtype)\n",
        "        mine = _signature(what, nbytes, dtype)\n",
        ["tests/test_backends.py::test_a_gather_into_a_symmetric_buffer_on_some_ranks_only_is_out_of_step"],
    ),
    "a segment left by a failed map": (
        "isp_comm/backends/shm.py",
        "            if create:\n                Segment.unlink(name)\n            raise SharedMemoryError(_cannot(",
        "            raise SharedMemoryError(_cannot(",
        ["tests/test_backends.py::test_a_segment_that_cannot_be_mapped_is_a_shared_memory_error_and_leaves_nothing"],
    ),
    "virtual spins at the default priority": (
        "isp_comm/backends/virtual.py",
        "SPIN_PRIORITY = -64\n",
        "SPIN_PRIORITY = 0\n",
        ["tests/test_virtual_tiers.py::test_the_cuda_path_gives_the_same_order_on_streams"],
    ),
    "compiled regions fused across a matrix product": (
        "isp_comm/planner/fusion.py",
        "        return not any(above[c] & members for c in _bits(depends & cuts))",
        "        return True",
        ["tests/test_planner_compiled.py::test_a_region_reads_once_and_writes_what_leaves_it"],
    ),
}


def _copy_repo(dest: str) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))


def _stale(name: str) -> str:
    """Why mutation ``name``'s patch would not apply to the package as it is ('' when it would)."""
    path, old, _, _ = MUTATIONS[name]
    with open(os.path.join(ROOT, path)) as f:
        n = f.read().count(old)
    return "" if n == 1 else f"mutation {name!r}: the patched text occurs {n} times in {path}"


def run(name: str) -> tuple[bool, float, str]:
    """(killed, seconds, the failing test's last line) for mutation ``name``."""
    path, old, new, tests = MUTATIONS[name]
    with tempfile.TemporaryDirectory(prefix="isp-mutation-") as tmp:
        _copy_repo(tmp)
        target = os.path.join(tmp, path)
        with open(target) as f:
            text = f.read()
        if text.count(old) != 1:
            raise SystemExit(f"mutation {name!r}: the patched text occurs {text.count(old)} times in {path}")
        with open(target, "w") as f:
            f.write(text.replace(old, new))
        t0 = time.monotonic()
        # ISP_SLOW=1: a test of the slow tier named here runs (it would be skipped, and
        # the mutation counted as missed); a run in which nothing ran proves nothing
        env = {**os.environ, "PYTHONPATH": tmp, "ISP_SLOW": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        try:
            res = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
        finally:
            _remove_stale_segments()
        lines = [line for line in res.stdout.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        if res.returncode == 0 and " passed" not in last:
            raise SystemExit(f"mutation {name!r}: no test ran ({last!r})")
        return res.returncode != 0, time.monotonic() - t0, last


def _remove_stale_segments() -> None:
    """Unlink the shared-memory segments whose creating process is gone, as isp-train
    does at its start: a planted fault may leave its ranks' segments behind (one of
    them is that fault), and a run of all of them left one in /dev/shm."""
    from isp_comm.backends import shm

    for name in shm.stale_segments():
        shm.Segment.unlink(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the mutations whose name contains this")
    args = ap.parse_args()
    names = [n for n in MUTATIONS if args.only in n]
    stale = [_stale(name) for name in names]  # every patch checked before any runs: a stale one stops the run at once
    if any(stale):
        raise SystemExit("\n".join(s for s in stale if s))
    killed = 0
    print("| mutation | tests | caught | s |\n|---|---|---|---:|")
    for name in names:
        dead, secs, last = run(name)
        killed += dead
        tests = ", ".join(t.split("::")[-1] for t in MUTATIONS[name][3])
        print(f"| {name} | {tests} | {'yes' if dead else 'NO: ' + last} | {secs:.0f} |", flush=True)
    print(f"\nkill rate: {killed}/{len(names)}")
    return 0 if killed == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
