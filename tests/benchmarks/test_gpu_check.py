"""Fast checks of the one-GPU check's pure parts (no GPU, no vLLM engine, no Mooncake).

The check itself (``bash benchmarks/gpu/run.sh``) needs a GPU and minutes; these tests cover
what decides its verdict: the arguments, whether the stack must be installed, the comparison of
answers, the pull figures from Prometheus text, the ratio to the transport's ceiling, the
clean-transfer checks, the budget and the report.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the benchmark lives outside the installed package
    sys.path.insert(0, str(REPO_ROOT))

checks = importlib.import_module("benchmarks.gpu.checks")
run_gpu_check = importlib.import_module("benchmarks.gpu.run_gpu_check")


# -- arguments -----------------------------------------------------------------------------


def test_defaults_are_one_gpu_tcp_float32():
    args = run_gpu_check.parse_args([])
    assert args.device == "cuda"
    assert args.protocol == "tcp"
    assert args.dtype == "float32"
    assert args.logprob_tolerance == 1e-4
    assert args.gpu_memory_utilization == 0.3
    assert args.budget_s == 600
    assert args.json == REPO_ROOT / "benchmarks" / "results" / "gpu-check-cuda.json"


def test_bf16_gets_a_looser_default_tolerance_and_an_explicit_one_wins():
    assert run_gpu_check.parse_args(["--dtype", "bfloat16"]).logprob_tolerance == 5e-2
    args = run_gpu_check.parse_args(["--dtype", "bfloat16", "--logprob-tolerance", "0.2"])
    assert args.logprob_tolerance == 0.2


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-memory-utilization", "0.6"],  # two instances cannot each take 60 %
        ["--gpu-memory-utilization", "0"],
        ["--timing-requests", "0"],
        ["--device", "npu"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        run_gpu_check.parse_args(argv)


def test_device_setup_splits_the_gpu_or_sizes_the_cpu_cache():
    args = run_gpu_check.parse_args(["--gpu", "1", "--engine-args", "--max-num-seqs 4"])
    engine_args, env = run_gpu_check.device_setup(args)
    assert engine_args == ("--gpu-memory-utilization", "0.3", "--max-num-seqs", "4")
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    engine_args, env = run_gpu_check.device_setup(run_gpu_check.parse_args(["--device", "cpu"]))
    assert engine_args == ()
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_timed_prompt_is_cut_to_its_token_count():
    seen = []

    def tokenize(text: str) -> list[int]:
        seen.append(text)
        return [len(seen)] * 7

    prompt = run_gpu_check.long_prompt(tokenize, 20)
    assert prompt == [1] * 7 + [2] * 7 + [3] * 6
    assert len(set(seen)) == 3  # distinct phrases
    with pytest.raises(ValueError):
        run_gpu_check.long_prompt(lambda text: [], 3)
    with pytest.raises(SystemExit):  # the prompt and the answer must fit the context
        run_gpu_check.parse_args(["--long-prompt-tokens", "505"])


# -- the installed stack -------------------------------------------------------------------


def probe(**changes) -> checks.StackProbe:
    """A CUDA machine with everything in place; ``changes`` break one thing."""
    values = {
        "modules": dict.fromkeys(checks.REQUIRED_MODULES),
        "distributions": {"vllm": "0.32.0", "mooncake-transfer-engine-cuda13": "0.3.13"},
        "torch_cuda": "13.0",
        "plugin_entry_point": True,
        "package_dir": "/repo/vllm_ascend_mooncake",
        "checkout_package_dir": "/repo/vllm_ascend_mooncake",
    }
    values.update(changes)
    return checks.StackProbe(**values)


def test_a_complete_cuda_stack_is_ready():
    assert checks.stack_action(probe(), "cuda") == (checks.READY, [])


def test_a_missing_module_means_installing_the_stack():
    modules = {**dict.fromkeys(checks.REQUIRED_MODULES), "mooncake.engine": "ImportError: x"}
    action, reasons = checks.stack_action(probe(modules=modules), "cuda")
    assert action == checks.INSTALL_STACK
    assert reasons == ["mooncake.engine does not import: ImportError: x"]


def test_the_cpu_stack_is_not_a_cuda_stack():
    cpu = probe(
        distributions={"vllm-cpu": "0.32.0", "mooncake-transfer-engine-non-cuda": "0.3.13"},
        torch_cuda=None,
    )
    action, reasons = checks.stack_action(cpu, "cuda")
    assert action == checks.INSTALL_STACK
    assert "found vllm-cpu" in reasons[0]
    assert "torch is not a CUDA build" in reasons
    assert checks.stack_action(cpu, "cpu") == (checks.READY, [])


def test_only_the_package_is_installed_when_the_stack_is_there():
    action, reasons = checks.stack_action(probe(plugin_entry_point=False), "cuda")
    assert action == checks.INSTALL_PACKAGE
    assert "entry point" in reasons[0]
    action, reasons = checks.stack_action(probe(package_dir="/elsewhere/pkg"), "cuda")
    assert action == checks.INSTALL_PACKAGE
    assert "/elsewhere/pkg" in reasons[0]


def test_exit_codes_of_the_stack_check_are_what_run_sh_expects():
    script = (REPO_ROOT / "benchmarks" / "gpu" / "run.sh").read_text()
    assert checks.CHECK_EXIT_CODES == {"ready": 0, "install-package": 3, "install-stack": 4}
    assert '"$status" -eq 3' in script
    assert '"$status" -eq 4' in script
    assert "pip install -e '.[cuda,test]'" in script


def test_run_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO_ROOT / "benchmarks" / "gpu" / "run.sh")], check=True)


# -- answers -------------------------------------------------------------------------------


def answer(tokens, tops):
    return {"choices": [{"token_ids": tokens, "logprobs": {"top_logprobs": tops}}]}


REFERENCE = answer([5, 6], [{"a": -0.1, "b": -2.0}, {"c": -0.5, "d": -1.0}])


def test_equal_answers_pass_and_report_the_largest_difference():
    got = answer([5, 6], [{"a": -0.10005, "b": -2.0}, {"c": -0.5, "d": -1.0}])
    comparison = checks.compare_answers("p", got, REFERENCE, 1e-4)
    assert comparison.ok
    assert comparison.same_tokens
    assert comparison.max_logprob_diff == pytest.approx(5e-5)


def test_a_different_token_fails_and_names_the_position():
    got = answer([5, 7], [{"a": -0.1, "b": -2.0}, {"c": -0.5, "d": -1.0}])
    comparison = checks.compare_answers("p", got, REFERENCE, 1e-4)
    assert not comparison.ok
    assert "position 1" in comparison.problems[0]


def test_logprobs_beyond_the_tolerance_or_other_top_tokens_fail():
    far = answer([5, 6], [{"a": -0.2, "b": -2.0}, {"c": -0.5, "d": -1.0}])
    assert "0.1 > 0.0001" in checks.compare_answers("p", far, REFERENCE, 1e-4).problems[0]
    other = answer([5, 6], [{"a": -0.1, "x": -2.0}, {"c": -0.5, "d": -1.0}])
    assert "position 0" in checks.compare_answers("p", other, REFERENCE, 1e-4).problems[0]
    short = answer([5], [{"a": -0.1, "b": -2.0}])
    assert not checks.compare_answers("p", short, REFERENCE, 1e-4).ok


# -- metrics and the ceiling ----------------------------------------------------------------

METRICS = """\
# HELP vllm:mooncake_hetero_pull_seconds x
vllm:mooncake_hetero_pull_seconds_count{engine="0",model_name="m"} 10.0
vllm:mooncake_hetero_pull_seconds_sum{engine="0",model_name="m"} 0.05
vllm:mooncake_hetero_pull_bytes_sum{engine="0",model_name="m"} 5242880.0
vllm:mooncake_hetero_pull_descriptors_sum{engine="0",model_name="m"} 40.0
vllm:mooncake_hetero_pull_phase_seconds_sum{engine="0",model_name="m",phase="read"} 0.04
vllm:mooncake_hetero_pull_phase_seconds_sum{engine="0",model_name="m",phase="fixup"} 0.001
vllm:mooncake_hetero_failed_pulls_total{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
"""


def test_metric_sum_over_label_sets_and_with_a_label():
    assert checks.metric_sum(METRICS, "vllm:mooncake_hetero_pull_phase_seconds_sum") == 0.041
    assert checks.metric_sum(
        METRICS, "vllm:mooncake_hetero_pull_phase_seconds_sum", {"phase": "read"}
    ) == pytest.approx(0.04)
    assert checks.metric_sum(METRICS, "vllm:kv_cache_usage_perc") == 0.0
    assert checks.metric_sum(METRICS, "vllm:not_there") is None


def test_pull_figures_are_per_pull_between_two_snapshots():
    before = checks.PullSnapshot.parse(METRICS)
    after_text = (
        METRICS.replace('count{engine="0",model_name="m"} 10.0', 'count{engine="0"} 14.0')
        .replace('seconds_sum{engine="0",model_name="m"} 0.05', 'seconds_sum{engine="0"} 0.09')
        .replace("5242880.0", "9437184.0")
    )
    figures = checks.pull_figures(before, checks.PullSnapshot.parse(after_text))
    assert figures["pulls"] == 4
    assert figures["mean_pull_s"] == pytest.approx(0.01)
    assert figures["mean_bytes"] == 1 << 20
    assert figures["failed"] == 0
    assert checks.pull_figures(before, before) == {}


def test_ceiling_ratio_is_ceiling_over_ours():
    figures = {"mean_pull_s": 0.010, "mean_read_s": 0.008, "mean_bytes": float(1 << 30)}
    ratios = checks.ceiling_ratios(figures, [0.009, 0.007, 0.008])
    assert ratios["ceiling_s"] == 0.008
    assert ratios["ratio_pull"] == pytest.approx(0.8)
    assert ratios["ratio_read"] == pytest.approx(1.0)
    assert ratios["ceiling_gib_per_s"] == pytest.approx(125.0)
    assert checks.ceiling_ratios(figures, []) == {}
    assert "ratio_read" not in checks.ceiling_ratios({**figures, "mean_read_s": 0.0}, [0.008])


def test_ceiling_descriptors_cover_the_bytes_in_chunks():
    local, remote, lengths = checks.descriptors(1000, 50_000, 2_500_000, chunk=1 << 20)
    assert lengths == [1 << 20, 1 << 20, 2_500_000 - (2 << 20)]
    assert local == [1000, 1000 + (1 << 20), 1000 + (2 << 20)]
    assert remote == [50_000, 50_000 + (1 << 20), 50_000 + (2 << 20)]
    with pytest.raises(ValueError):
        checks.descriptors(0, 0, 0)


# -- clean transfers, budget, report -------------------------------------------------------


def test_clean_transfers_need_one_pull_per_request_and_nothing_failed_or_expired():
    assert checks.transfer_problems({"successful": 12, "failed": 0, "expired": 0}, 12, 1) == []
    problems = checks.transfer_problems({"successful": 11, "failed": 1, "expired": 2}, 12, 1)
    assert len(problems) == 3
    assert "1 pull(s) failed" in problems
    assert len(checks.transfer_problems({}, 12, 1)) == 2  # neither instance answered


def test_budget_caps_waits_and_runs_out():
    now = [0.0]
    budget = checks.Budget(100, clock=lambda: now[0])
    assert budget.timeout(600, "x") == 100
    assert budget.timeout(30, "x", reserve_s=45) == 30
    now[0] = 60
    assert budget.timeout(600, "x", reserve_s=30) == 10
    now[0] = 90
    with pytest.raises(checks.BudgetExceeded, match="before y"):
        budget.timeout(600, "y", reserve_s=10)
    with pytest.raises(ValueError):
        checks.Budget(0)


def report(comparisons, problems=()):
    return checks.build_report(
        args={"device": "cuda"},
        environment={"gpu": None},
        phases={"total": 12.345},
        comparisons=comparisons,
        transfers={},
        ceiling={},
        problems=list(problems),
    )


def test_report_passes_only_with_equal_answers_and_no_problem():
    ok = checks.compare_answers("p", REFERENCE, REFERENCE, 1e-4)
    bad = checks.compare_answers(
        "q", answer([1, 2], REFERENCE["choices"][0]["logprobs"]["top_logprobs"]), REFERENCE, 1e-4
    )
    passed = report([ok])
    assert passed["passed"] and passed["reasons"] == []
    assert passed["phases_s"] == {"total": 12.35}
    json.dumps(passed)  # serialisable as it is
    failed = report([ok, bad], ["1 pull(s) failed"])
    assert not failed["passed"]
    assert failed["reasons"][0] == "1 pull(s) failed"
    assert failed["reasons"][1].startswith("q: tokens differ")
    assert failed["answers"]["equal"] == 1
    assert not report([])["passed"]  # nothing compared is not a pass


def test_summary_lines_end_with_the_verdict():
    ok = checks.compare_answers("p", REFERENCE, REFERENCE, 1e-4)
    assert run_gpu_check.summary_lines(report([ok]))[-1] == "PASSED"
    assert run_gpu_check.summary_lines(report([ok], ["x"]))[-1] == "FAILED: x"


def test_instances_sharing_a_gpu_start_one_at_a_time(monkeypatch, tmp_path):
    """LocalDeployment.start(one_at_a_time=True): prefill ready before decode starts (vLLM
    profiles the GPU's memory at start-up); the default starts both at once."""
    deployment_module = importlib.import_module("vllm_ascend_mooncake.launch.deployment")
    calls = []
    monkeypatch.setattr(
        deployment_module, "start_servers", lambda servers, timeout_s: calls.append(servers)
    )
    monkeypatch.setattr(deployment_module.LocalDeployment, "_start_proxy", lambda *a: None)
    spec = deployment_module.DeploymentSpec(model="m", prefill_tp=1, log_dir=str(tmp_path))
    pd = deployment_module.LocalDeployment(spec)
    pd.start(one_at_a_time=True)
    assert calls == [(pd.prefill,), (pd.decode,)]
    calls.clear()
    pd.start()
    assert calls == [(pd.prefill, pd.decode)]
