"""The launcher helper's failure summary names the exceptions of a failed run, wherever they stand in its output."""

from titan_runs import failure

COMPILER_FAILURE = """[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 10, in <module>
[rank0]: torch._dynamo.exc.Unsupported: flex_attention with max_scores
[rank0]:   torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:
[rank0]: LoweringException: NoValidChoicesError: No choices to select
[rank0]:   target: flex_attention
[rank0]:   args[1]: TensorBox(StorageBox(
[rank0]:   args[6]: {'OUTPUT_LOGSUMEXP': True, 'OUTPUT_MAX': True}
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_every_exception_line_is_named_above_the_tail_even_when_the_tail_holds_none():
    summary = failure(COMPILER_FAILURE, tail=60)
    named = summary.split("--- output tail ---")[0].splitlines()
    assert named == [
        "exceptions named:",
        "[rank0]: torch._dynamo.exc.Unsupported: flex_attention with max_scores",
        "[rank0]:   torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:",
        "[rank0]: LoweringException: NoValidChoicesError: No choices to select",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ]
    assert summary.endswith(COMPILER_FAILURE[-60:])


def test_dumped_arguments_and_plain_log_lines_are_not_taken_for_exceptions():
    lines = "[rank0]:   args[1]: TensorBox(\n[rank0]: step:  1  loss:  8.1\nNote: the run goes on\n"
    assert failure(lines, tail=20) == lines[-20:]
