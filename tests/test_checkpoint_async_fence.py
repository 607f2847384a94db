"""An async save writes from the live state with no host copy; the optimizer's next step waits for it."""
import threading
import time

import torch

from megatron_zero.checkpoint.storage import writer as writer_module
from megatron_zero.checkpoint.storage.reader import open_checkpoint
from megatron_zero.checkpoint.storage.writer import CheckpointWriter
from megatron_zero.zero.optimizer import ZeroOptimizer


def test_step_waits_for_the_async_writer_and_the_file_holds_the_pre_step_state(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = ZeroOptimizer(list(model.named_parameters()), stage=0, lr=0.1)
    model(torch.randn(4, 64)).square().sum().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    events = []
    slow_write = writer_module._write_files

    def write_slowly(*args):
        time.sleep(0.5)  # the background writer is slower than the step would be
        out = slow_write(*args)
        events.append("written")
        return out

    monkeypatch.setattr(writer_module, "_write_files", write_slowly)
    writer = CheckpointWriter()
    threads_before = threading.active_count()
    writer.save(str(tmp_path), "global_step1", [("model.pt", dict(model.state_dict()))], iteration=1,
                async_save=True)
    assert threading.active_count() == threads_before + 1  # returned at once; the writer runs in the background
    opt.before_next_step(writer.wait_until_state_read)
    opt.step()
    events.append("stepped")
    writer.wait()
    assert events == ["written", "stepped"]
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())  # the step did change them
    saved = open_checkpoint(str(tmp_path)).load("model.pt")
    assert all(torch.equal(saved[n], before[n]) for n in before)
