import os
import sys

# Check graph invariants after every pass, in this process and in spawned ranks.
os.environ.setdefault("FXSHARD_VERIFY", "1")
sys.path.insert(0, os.path.dirname(__file__))
# Inductor compiles in-process: no worker pool to outlive a spawned rank.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# -- tiers --------------------------------------------------------------------------------------
# The README's test command runs the fast tier (``-m "not slow"``, from pyproject's addopts); .ci/run
# runs the slow tier (``-m slow``) after it, and both on the other torch releases. The slow tier:
# - a test's 3-rank case when the same test runs on 2 and 3 ranks (and perhaps 1) only: these spawn
#   real ranks. The fast tier keeps the 2-rank case; uneven shards stay in it through
#   test_checkpoint (1 and 3 ranks), test_plan and test_local_ranks (3, 5, 7 ranks, no spawn).
# - tests marked ``@pytest.mark.slow`` in their file: the quick benchmark, the Llama-scale explains,
#   the gloo stress loop, the GPT example script (its resume at another world size is also
#   test_checkpoint's, in the fast tier), Lightning's precision flags (test_lightning), every
#   doc page's examples (test_doc_examples), auto()'s toys (test_auto: each traces every
#   candidate), no_sync under Inductor (test_recipe) and a second job loading the first's
#   Inductor graphs from torch's cache (test_compile_cache);
#   and variants of fast-tier checks marked there with ``pytest.param(..., marks=slow)``:
#   timeouts that wait out their seconds, world size 1 parity, simulated world sizes 4 and 8,
#   Lightning's validate load, the CLI's HF explain, the 4-rank HSDP error messages.
# The release tier (``-m "release and not slow"``, on torch 2.11 and 2.15 in .ci/run): tests marked
# ``@pytest.mark.release`` (tests/test_compat.py checks that every row of compat's table has one).


# Whole tests (every case: their cases share one run of ranks) in the slow tier for the fast
# tier's 8 minutes; each has a faster sibling that stays: the HF Trainer and the OPT/BART traces
# for the HF models, the steady-state peak for the optimizer step's time, the 3-rank bf16 run
# and test_recipe's other FSDP2 comparisons, the MLP and the broken model through the backend,
# the default schedule's parity everywhere, the CollectiveMismatchError of test_errors, the
# budget's predicted peaks (test_budget, test_explain) and the schedule at one batch size, the
# resumes at another world size (test_checkpoint), the budget's error naming the lowest peak
# (test_a_budget_above_a_reachable_peak_is_met[540]), and HSDP across rehearsed nodes
# (test_rehearsal) with test_mesh's 2-rank checks. A test marked for the release tier stays in
# the fast tier: the release tier leaves the slow one out.
SLOW_FOR_TIME = (
    "tests/test_hf.py::test_hf_model_with_padding_mask_traces_and_matches_ddp",
    "tests/test_report.py::test_a_steady_state_step_with_its_optimizer_is_predicted_within_three_percent",
    "tests/test_recipe.py::test_bf16_matches_fsdp2_mixed_precision",
    "tests/test_backend.py::test_backend_matches_ddp[2-gpt]",
    "tests/test_schedule_parity.py::test_option_trains_like_the_default_and_ddp",
    "tests/test_consistency.py::test_divergent_ranks_raise_instead_of_hanging",
    "tests/test_budget.py::test_the_measured_peak_stays_within_the_budget",
    "tests/test_memory_schedule.py::test_the_schedule_is_the_same_at_every_batch_size",
    "tests/test_checkpoint.py::test_resume_loads_the_saved_parameters_bitwise",
    "tests/test_checkpoint.py::test_resume_at_two_ranks_continues_bitwise",
    "tests/test_checkpoint.py::test_a_save_killed_on_one_rank_leaves_the_previous_checkpoint_loadable",
    "tests/test_budget.py::test_tighter_budgets_buy_memory_with_resharding_then_recompute",
    "tests/test_budget.py::test_the_chosen_schedule_trains_like_the_default",
    "tests/test_budget.py::test_the_backend_plans_the_budget_too",  # the last of results()'s readers
    "tests/test_mesh.py::test_no_shard_hsdp_and_hpz_on_4_ranks_train_like_ddp_and_hsdp_checkpoints_resume_on_2",
    # It waits out its timeout (17 s); a save or load on one rank within the timeout stays.
    "tests/test_checkpoint_integrity.py::test_a_stalled_writer_raises_on_every_rank_within_the_timeout",
    # Five explains of a 4-block GPT (23 s): the offload's device peak stays in
    # test_explain_offload_lowers_the_device_peak_by_the_shards_and_gradients, the optimizer's
    # state in test_report; the CLI's budget table (12 s) beside the budget's own tests.
    "tests/test_offload.py::test_the_optimizer_step_is_a_phase_of_the_peak_and_offload_takes_it_to_the_host",
    "tests/test_explain.py::test_cli_explain_shows_the_memory_budget_choice",
    # A Llama-family HF model in bf16 through both front ends (37 s): bf16 through the backend
    # against FSDP2 (test_recipe) and the HF models' traces stay.
    "tests/test_hf.py::test_llama_family_model_trains_in_bf16_through_both_front_ends",
    # For the quantized gathers' tests: the exit on fxshard's own gloo groups (23 s; the clean
    # exits of test_checkpoint_integrity's spawned ranks stay), a peer stalled inside a step
    # (19 s; one rank in validation while the others wait stays), the 3-rank resume (13 s; the
    # 1-rank one stays) and zero_grad dropping no_sync's sums (15 s; the step over pending
    # sums raising stays).
    "tests/test_exit.py::test_fxshard_never_communicates_on_the_users_gloo_group_and_quiesces_its_own",
    "tests/test_consistency.py::test_a_peer_stalled_inside_a_step_gives_a_clear_error_within_the_timeout",
    "tests/test_checkpoint.py::test_resume_at_another_world_size_continues[3]",
    "tests/test_recipe.py::test_the_optimizers_zero_grad_drops_no_syncs_sums_as_ddps_does",
    # Each with a sibling that stays in the fast tier: the budget's error naming the lowest peak
    # tried (test_a_budget_above_a_reachable_peak_is_met[540]); budgets of 540 and 600 KiB met
    # beside 560; the MNIST demo's own failure and data tests (the README's demo command runs the
    # demo); the HF Trainer's resume from a checkpoint, which loads saved weights into the shards
    # too.
    "tests/test_budget.py::test_a_budget_no_schedule_meets_is_an_error_naming_the_lowest_peak",
    "tests/test_budget.py::test_a_budget_above_a_reachable_peak_is_met[560]",
    "tests/test_examples.py::test_mnist_demo_trains_prints_graphs_and_saves",
    "tests/test_examples.py::test_mnist_compare_ddp_prints_both_systems_with_equal_losses",
    "tests/test_hf_trainer.py::test_best_model_and_a_second_train_load_into_the_shards",
    # A test that only reads a cached spawn saves nothing here: the fast tier's next reader pays
    # for the spawn. These run in spawns of their own that only the slow tier starts.
    # Inductor compute compiled from a cold cache (about 75 s of ranks): fxshard.compile's
    # Inductor run stays (test_driver's test_compile_runs_inductor_compute_like_the_backend, in
    # the release tier for inductor_partition_fn), and the backend's eager runs against DDP;
    # dropout through fxshard.compile stays in test_parity.
    "tests/test_backend.py::test_inductor_compute_matches_ddp",
    "tests/test_backend.py::test_inductor_compute_trains_with_dropout",
    # Every model of the suite at batch sizes that differ per rank (about 15 s): the MLP's
    # smaller last batch on one rank stays (test_partial_last_batch_trains_exactly_like_ddp).
    "tests/test_consistency.py::test_every_model_trains_like_ddp_when_batch_sizes_differ_per_rank_every_step",
    # Clipping active through the HF Trainer, against its DDP run: sharded.clip_grad_norm_ against
    # DDP's (test_recipe's test_clip_grad_norm_matches_ddp) and Lightning's clipping stay.
    "tests/test_hf_trainer.py::test_clipping_scales_the_gradients_as_ddp_does",
    # Each with a sibling that stays in the fast tier: a peer that left, said as a closed
    # connection and not a timeout (test_errors' full state dict on one rank, the case whose
    # other rank leaves at once); the files fxshard.compile's and the backend's dump= write
    # (test_driver's test_every_front_end_takes_the_same_options) and the CLI's explain writing
    # its trace (test_trace_events); the README's explain command beside inspecting.md's; the
    # fused attention explain(device="cpu") plans with, beside CUDA's on meta; the GPT at 2
    # simulated ranks and every other model at 3 and 5 (uneven shards).
    "tests/test_consistency.py::test_a_peer_that_died_is_reported_at_once_without_claiming_a_timeout",
    "tests/test_explain.py::test_cli_explain_writes_every_dump_file",
    "tests/test_explain.py::test_the_docs_explain_command_runs_on_the_gpt_example[docs/inspecting.md]",
    "tests/test_explain.py::test_explain_for_cuda_without_a_device_takes_cudas_fused_attention_on_meta",
    "tests/test_local_ranks.py::test_graphs_on_simulated_ranks_match_autograd[gpt-3]",
    "tests/test_local_ranks.py::test_graphs_on_simulated_ranks_match_autograd[gpt-5]",
    # Explain's peaks with and without recomputation: the ranks' report predicts each within 3%
    # of the measured peak, and the measured peaks fall in the same order (test_checkpointing).
    # The budget's choice of the units to offload: a budget that offloads some units, not all,
    # trained like DDP (test_offload_trains_exactly_like_ddp_with_clipping_and_adamw[budget]).
    "tests/test_checkpointing.py::test_explain_predicts_less_memory_with_checkpointing",
    "tests/test_offload.py::test_the_budget_offloads_only_the_units_it_needs_largest_first",
    # Every reader of test_checkpoint_recovery's spawn (about 12 s): consolidate's one error line,
    # nothing written, on a damaged checkpoint (test_checkpoint) and a flipped bit
    # (test_checkpoint_integrity); fxshard.checkpoint.load, the ranks reading different
    # checkpoints and a copy at another path (test_checkpoint_integrity), pretrained safetensors
    # into a meta-built model (test_checkpoint).
    "tests/test_checkpoint_recovery.py::test_the_model_alone_loads_from_a_checkpoint_with_optimizer_state",
    "tests/test_checkpoint_recovery.py::test_safetensors_that_differ_between_ranks_raise_on_every_rank_and_change_nothing",
    "tests/test_checkpoint_recovery.py::test_safetensors_copied_to_another_path_load",
    "tests/test_checkpoint_recovery.py::test_consolidate_of_a_checkpoint_missing_a_data_file",
    "tests/test_checkpoint_recovery.py::test_consolidate_into_a_missing_folder",
    "tests/test_checkpoint_recovery.py::test_consolidate_onto_a_full_disk",
    # Two spawns of 2 ranks each (about 12 s each): the agreement that raises on every rank stays
    # (test_checkpoint's test_bad_input_raises_on_every_rank_and_changes_nothing), and
    # sync_module_states broadcasting rank 0's weights and buffers (test_recipe).
    "tests/test_errors.py::test_ranks_that_pass_different_full_state_dicts_all_raise_even_one_that_passed_nothing",
    "tests/test_errors.py::test_sync_module_states_with_a_meta_buffer_on_rank_0_raises_on_every_rank_naming_it",
)


# The slow tier's longest files first (seconds on the 2-core machine): pytest-xdist hands each
# worker whole files in collection order (.ci/run's --no-loadscope-reorder; by default it orders
# them by their number of tests), so the longest, started last, left one core idle for minutes
# (the budget search's one test: 282 s of 1219, while the other worker had ended at 1026).
LONGEST_FIRST = (
    "tests/test_explain_budget_search.py",  # 282 while it scanned every reshard prefix; 67 since
    "tests/test_explain.py",  # 254
    "tests/test_auto.py",  # 188
    "tests/test_doc_examples.py",  # 175
    "tests/test_budget.py",  # 149
    "tests/test_examples.py",  # 110
)


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    import pytest

    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest as collected

    for item in items:
        if any(item.nodeid == name or item.nodeid.startswith(name + "[") for name in SLOW_FOR_TIME):
            item.add_marker(pytest.mark.slow)

    sizes: dict[tuple[str, str], set[int]] = {}
    for item in items:
        size = getattr(item, "callspec", None) and item.callspec.params.get("world_size")
        if isinstance(size, int):
            sizes.setdefault((item.fspath.strpath, item.originalname), set()).add(size)
    for item in items:
        size = getattr(item, "callspec", None) and item.callspec.params.get("world_size")
        if size == 3 and {2, 3} <= sizes[(item.fspath.strpath, item.originalname)] <= {1, 2, 3}:
            item.add_marker(pytest.mark.slow)
