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
# resumes at another world size (test_checkpoint), the budget's error naming the lowest peak,
# and HSDP across rehearsed nodes (test_rehearsal) with test_mesh's 2-rank checks. A test
# marked for the release tier stays in the fast tier: the release tier leaves the slow one out.
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
    # One spawn of 2 ranks for these three (about 11 s); the checkpoints that load and
    # verify stay in test_checkpoint_integrity.py.
    "tests/test_checkpoint_recovery.py::test_the_model_alone_loads_from_a_checkpoint_with_optimizer_state",
    "tests/test_checkpoint_recovery.py::test_safetensors_that_differ_between_ranks_raise_on_every_rank_and_change_nothing",
    "tests/test_checkpoint_recovery.py::test_safetensors_copied_to_another_path_load",
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
    # The README's test step reached 528 s in CI (its budget: 8 minutes): about 125 s of tests
    # moved here, each with a sibling that stays in the fast tier: selective and backend_full
    # recomputation; a checkpoint of another shape refused through fxshard.load; budgets of
    # 560 and 600 KiB; the HF Trainer's best model and second train; the MNIST demo's own
    # failure and data tests (the README's demo command runs the demo); the volume of every
    # other setup.
    "tests/test_checkpointing.py::test_checkpointing_trains_bit_for_bit_like_without[full]",
    "tests/test_checkpoint.py::test_bad_input_raises_on_every_rank_and_changes_nothing[checkpoint_of_another_model]",
    "tests/test_budget.py::test_a_budget_above_a_reachable_peak_is_met[540]",
    "tests/test_hf_trainer.py::test_fxshard_trainer_trains_as_the_trainers_ddp_run",
    "tests/test_examples.py::test_mnist_demo_trains_prints_graphs_and_saves",
    "tests/test_examples.py::test_mnist_compare_ddp_prints_both_systems_with_equal_losses",
    "tests/test_report.py::test_communication_is_the_theoretical_volume_exactly[2-mlp-zero3]",
)


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    import pytest

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
