"""Parametrized cases and single tests that run in the slow tier only (tests/conftest.py marks them `slow`), each
with the default-run test that covers its claim. They keep the default run under its 20-minute budget on 2 cores;
`scripts/test.sh --all` runs them."""

SLOW_CASES = {
    "tests/test_checkpoint_resume.py::test_resume_is_bit_identical[2-2-8-2-True]":
        "test_resume_is_bit_identical[1-1-4-3-False]; tests/test_cli_resume.py's TP/PP resumes",
    "tests/test_pipeline_interleaved.py::test_pretrain_saves_and_resumes_across_layouts[default]":
        "test_gpt_interleaved_matches_reference; tests/test_universal_checkpoint.py::test_universal_resume",
    "tests/test_zero_overlap.py::test_pretrain_with_overlap_flags_logs_the_same_losses":
        "test_overlap_is_bit_identical (the same overlap paths, bit for bit)",
    "tests/test_cli_resume.py::test_resume_matches_uninterrupted_run[mistral-as saved]":
        "test_resume_matches_uninterrupted_run[gpt2-as saved] and [llama-universal]",
    "tests/test_cli_resume.py::test_resume_matches_uninterrupted_run[llama-as saved]":
        "test_resume_matches_uninterrupted_run[gpt2-as saved] and [llama-universal]",
    "tests/test_universal_checkpoint.py::test_universal_resume[d-pp4dp2]":
        "test_universal_resume[a-same] and [f-zero3]; test_direct_reshaped_resume",
    "tests/test_universal_checkpoint.py::test_universal_resume[e-tp2dp1-ga8]":
        "test_universal_resume[a-same] and [f-zero3]; test_direct_reshaped_resume",
    "tests/test_pipeline_gpt.py::test_pipeline_matches_reference[2-2-1-3-None-False]":
        "test_pipeline_matches_reference[2-2-1-3-None-True] and [2-2-2-2-None-False]",
    "tests/test_pipeline_gpt.py::test_pipeline_matches_reference[1-4-1-4-None-False]":
        "test_pipeline_matches_reference[1-2-1-4-None-False] and [1-3-1-3-None-False]",
    "tests/test_context_parallel_cli.py::test_resume_reshaped[cp1]":
        "test_resume_as_saved; tests/test_context_parallel_parity.py's layouts",
    "tests/test_zero_zeropp.py::test_pretrain_reads_the_zeropp_keys":
        "the in-process ZeRO++ parity tests of tests/test_zero_zeropp.py; test_arguments_overlap's key mapping",
    "tests/test_checkpoint_titan.py::test_convert_checkpoint_cli_dcp_universal_round_trip":
        "test_titan_round_trip_and_logits (the same conversion in-process)",
    "tests/test_muon_cli.py::test_switching_optimizer_on_resume_loads_the_weights_and_starts_it_fresh":
        "tests/test_muon_checkpoint.py (Muon's saved state and its load)",
    "tests/test_checkpoint_layout.py::test_deepspeed_zero_to_fp32_reads_our_dp_only_checkpoint[2]":
        "test_deepspeed_zero_to_fp32_reads_our_dp_only_checkpoint[1]",
    "tests/test_checkpoint_layout.py::test_deepspeed_zero_to_fp32_reads_our_dp_only_checkpoint[3]":
        "test_deepspeed_zero_to_fp32_reads_our_dp_only_checkpoint[1]; tests/test_zero_state.py",
    "tests/test_checkpoint_latest.py::test_a_damaged_latest_with_no_checkpoint_beside_it_is_one_sentence_from_one_rank":
        "test_a_damaged_latest_resumes_from_the_newest_verified_checkpoint",
    "tests/test_zero_pipeline.py::test_tp2_pp2_dp2_matches_torch_adamw[2]":
        "test_tp2_pp2_dp2_matches_torch_adamw[1]",
    "tests/test_consolidate_fp32.py::test_zero_to_fp32_cli":
        "test_consolidate[tp2pp2dp2-zero1]; tests/test_standalone_zero_to_fp32_cli.py",
    "tests/test_reliability_cli.py::test_an_injected_persistent_error_stops_with_exit_17_and_no_later_checkpoint":
        "tests/test_reliability_units.py's verdicts (the faulty rank named) and the transient/anomaly CLI test",
    "tests/test_training_memory_flags.py::test_checkpoint_resumes_with_and_without_the_flags":
        "the flags' parity tests in tests/test_training_memory_flags.py; tests/test_cli_resume.py",
    "tests/test_console_scripts.py::test_console_script_runs[megatron-zero-convert-to-hf]":
        "test_console_script_runs[megatron-zero-pretrain] (the same entry-point wiring); tests/test_hf_*.py",
    "tests/test_console_scripts.py::test_console_script_runs[megatron-zero-ds-to-universal]":
        "test_console_script_runs[megatron-zero-pretrain]; tests/test_universal_checkpoint.py",
    "tests/test_console_scripts.py::test_console_script_runs[megatron-zero-generate-text]":
        "test_console_script_runs[megatron-zero-pretrain]; tests/test_generate*.py",
    "tests/test_console_scripts.py::test_console_script_runs[megatron-zero-zero-to-fp32]":
        "test_console_script_runs[megatron-zero-pretrain]; tests/test_consolidate_fp32.py",
    "tests/test_tensor_parallel_cross_entropy.py::test_matches_torch_cross_entropy[4-1000.0]":
        "test_matches_torch_cross_entropy[2-1000.0] and [2-1.0]",
    "tests/test_model_parity.py::test_tp_matches_reference[4-exact]":
        "test_tp_matches_reference[2-padded] and [2-exact]",
    "tests/test_pipeline_interleaved.py::test_interleaved_matches_single_process[2-2-6-False]":
        "test_interleaved_matches_single_process[2-2-4-False] and [4-2-8-False]",
    "tests/test_pipeline_interleaved.py::test_interleaved_matches_single_process[2-3-2-False]":
        "test_interleaved_matches_single_process[2-2-4-False] and [4-2-8-False]",
    "tests/test_device_placement.py::test_trainer_makes_every_tensor_on_its_device[dp2_zero3]":
        "test_trainer_makes_every_tensor_on_its_device[dp2_zero2_cpu_optimizer] and [pp2]",
    "tests/test_zero_trajectory.py::test_zero_matches_adamw[2-0.0-100]":
        "test_zero_matches_adamw[4-0.3-0]",
    "tests/test_cli_hf_import.py::test_import_trains_and_resumes[hf-llama-as saved]":
        "tests/test_hf_qwen3.py::test_cli_import_trains_at_tp2_pp2 (a Llama-family import trained from the CLI)",
    "tests/test_checkpoint_layout.py::test_our_zero_to_fp32_consolidates_tp2_pp2_dp2":
        "tests/test_consolidate_fp32.py::test_consolidate[tp2pp2dp2-zero1]",
    "tests/test_training_e2e.py::test_sigterm_saves_and_exits_zero_then_resumes":
        "tests/test_launch_faults.py::test_sigterm_to_the_launch_script_saves_and_exits_zero; tests/test_cli_resume.py",
    "tests/test_checkpoint_resume_paths.py::test_dp2_checkpoint_resumes_on_one_rank_plain_and_universal":
        "tests/test_universal_checkpoint.py::test_universal_resume; tests/test_elastic_resize.py's resumes at another DP",
    "tests/test_tensor_parallel_cross_entropy.py::test_matches_torch_cross_entropy[4-1.0]":
        "test_matches_torch_cross_entropy[2-1.0] (the same vocabulary split over two ranks)",
    "tests/test_model_parity.py::test_tp_matches_reference[4-padded]":
        "test_tp_matches_reference[2-padded] (the padded vocabulary split over two ranks)",
    "tests/test_tensor_parallel_mappings.py::test_mapping_semantics[4]":
        "test_mapping_semantics[2] (each mapping's forward and backward over a group of two)",
    "tests/test_tensor_parallel_mappings.py::test_parallel_layers_match_dense[4]":
        "test_parallel_layers_match_dense[2]",
    "tests/test_pipeline_gpt.py::test_pipeline_matches_reference[2-2-2-2-None-False]":
        "test_pipeline_matches_reference[2-2-1-3-None-True] (TP2 x PP2); "
        "tests/test_zero_pipeline.py::test_tp2_pp2_dp2_matches_torch_adamw[1] (TP2 x PP2 x DP2)",
    "tests/test_two_nodes.py::test_two_nodes_match_one":
        "tests/test_slurm_sbatch_script.py (scripts/torchrun_node.sh's rendezvous per node); .ci/run runs this case",
    "tests/test_cuda_compile.py::test_torch_bindings_parse_against_torch_headers":
        ".ci/run's CUDA step runs it on every CI run (nvcc, no GPU needed); tests/test_ops_kernel_report.py",
    "tests/test_cuda_compile.py::test_every_cu_file_compiles_for_sm80_and_sm90":
        ".ci/run's CUDA step runs it on every CI run (nvcc, no GPU needed); tests/test_ops_kernel_report.py",
    "tests/test_qwen3_toy.py::test_cp2_matches_one_process":
        "tests/test_context_parallel_parity.py's Llama CP2 layouts (GQA, RoPE) and tests/test_qk_norm.py (QK-norm, "
        "its own head dimension, TP2 x PP2)",
    "tests/test_universal_checkpoint.py::test_universal_resume[c-tp4dp2]":
        "test_universal_resume[a-same] and [f-zero3]; test_direct_reshaped_resume; "
        "tests/test_universal_llama.py::test_resume_matches_uninterrupted_run[tp1-dp8-universal]",
    "tests/test_schedule_resume_cli.py::test_changed_train_iters_on_resume_is_refused":
        "tests/test_schedule_resume.py::test_refused_where_megatron_core_refuses[train_iters=20] (the same check "
        "and sentence); tests/test_startup_checks.py's resume refusals from the command line",
    "tests/test_checkpoint_latest.py::test_a_damaged_latest_resumes_from_the_newest_verified_checkpoint":
        "tests/test_checkpoint_resume_paths.py::test_without_latest_the_newest_verified_checkpoint_is_resumed; "
        "test_a_damaged_latest_with_no_checkpoint_beside_it_is_one_sentence_from_one_rank",
    "tests/test_checkpoint_fault_injection.py::test_tools_refuse_a_flipped_byte_unless_told_not_to_verify":
        "test_every_read_path_refuses_every_flipped_byte (the readers the tools call); "
        "tests/test_standalone_zero_to_fp32_verify.py (a tool's refusal from the command line)",
    "tests/test_hf_gpt2.py::test_conversion_memory_is_about_one_tensor":
        "tests/test_convert_memory.py (the converters hold about one tensor)",
}
